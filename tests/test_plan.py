"""Planner: mode choice and chunk sizes."""

from __future__ import annotations

import numpy as np
import pytest

import batchjac
from batchjac._config import parse_bytes
from batchjac._plan import MAX_CHUNK, bytes_per_row, make_plan


def plan(**kw):
    args = {"n": 1000, "k": 5, "m": 4, "in_elems": 8, "dtype": np.dtype(np.float32), "mode": "auto",
            "chunk_size": None, "max_memory": 10**9}
    args.update(kw)
    return make_plan(**args)


def test_auto_mode_follows_shapes() -> None:
    assert plan(k=4, m=512).mode == "forward"  # W3, wide output
    assert plan(k=784, m=10).mode == "reverse"  # W2, wide input
    assert plan(k=5, m=4).mode == "reverse"
    assert plan(k=4, m=512, mode="reverse").mode == "reverse"
    assert "forward mode" in plan(k=4, m=512).reason


def test_chunks_fit_budget_and_compile_few_shapes() -> None:
    p = plan(n=1000)
    assert (p.chunk_size, p.n_chunks) == (1000, 1)
    p = plan(n=100_000)  # a 1 GB budget at ~21.8 kB a row: 45,955 rows at most
    assert p.n_chunks == 3
    assert p.chunk_size == 33_344  # balanced: 3 x 33,344, not 45,955 + 45,955 + 8,090
    assert p.chunk_size * bytes_per_row(5, 4, 8, 4) <= 10**9
    big = plan(n=10**6, max_memory=10**10)
    assert big.chunk_size <= MAX_CHUNK < big.chunk_size * 1.05  # capped, then balanced
    small_budget = plan(n=100_000, k=784, m=10, in_elems=784, max_memory=10**8)
    per_row = bytes_per_row(784, 10, 784, 4)
    assert small_budget.chunk_size * per_row <= 10**8
    padding = small_budget.chunk_size * small_budget.n_chunks - 100_000
    assert 0 <= padding < 0.02 * small_budget.chunk_size * small_budget.n_chunks  # balanced chunks
    sizes = {plan(n=n).chunk_size for n in range(2**14, 2**15)}
    assert len(sizes) <= 1025  # multiples of 16 in one octave of N, plus its upper end
    assert all(n <= plan(n=n).chunk_size <= n * 1.001 for n in range(1, 30000, 7))
    assert plan(n=10_000).chunk_size == 10_000  # round sizes need no padding


def test_bad_plan_options() -> None:
    with pytest.raises(batchjac.InputError, match="`mode` must be 'auto', 'forward' or 'reverse'"):
        plan(mode="fast")
    with pytest.raises(batchjac.InputError, match="`chunk_size` must be a positive integer; got 0"):
        plan(chunk_size=0)
    with pytest.raises(batchjac.InputError, match="`max_memory` must be a number of bytes or a string"):
        parse_bytes("lots")
    assert parse_bytes("512MiB") == 512 * 2**20
