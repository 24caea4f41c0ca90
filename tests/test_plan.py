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


# -- chunk sizes by timing (_autotune.tune_rows) --------------------------------------------------
class _SlowKernel:
    """Sleeps ``rows * cost(rows)``: a kernel whose time per row we choose."""

    variants = ("default",)
    variant = "default"
    note = ""

    def __init__(self, size: int, cost: float) -> None:
        self.chunk_size, self.cost = size, cost

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[None, np.ndarray]:
        import time

        time.sleep(self.chunk_size * self.cost)
        return None, np.zeros((self.chunk_size, 1, 1), np.float32)

    provisional = __call__


class _FakeBound:
    def __init__(self, cost_of: dict[int, float]) -> None:
        self.cost_of, self.built = cost_of, []
        self.tuned_rows: dict = {}

    def kernel(self, mode: str, size: int, with_outputs: bool) -> _SlowKernel:
        self.built.append(size)
        return _SlowKernel(size, self.cost_of[size])


def _spec(n: int) -> object:
    from batchjac._validate import normalize

    return normalize((np.random.default_rng(0).normal(size=(n, 1)).astype("f4"),), wrt=None,
                     dtype=None, nan_policy="raise")


def test_tune_rows_takes_a_smaller_chunk_only_when_clearly_faster() -> None:
    from batchjac._autotune import tune_rows

    base = plan(n=4096, chunk_size=4096)
    us = 1e-6
    # 1,024 rows 30% faster per row than 4,096: taken; 256 rows slower: the descent stops there
    fake = _FakeBound({4096: 10 * us, 1024: 7 * us, 256: 30 * us, 64: 1 * us})
    tuned = tune_rows(fake, _spec(4096), base, False)
    assert (tuned.chunk_size, tuned.n_chunks) == (1024, 4)
    assert "timed per row" in tuned.reason
    assert 64 not in fake.built  # stopped after the clearly slower 256
    # 256 rows a little faster per row than 1,024 (within NEAR): the larger, fewer chunks
    fake = _FakeBound({4096: 20 * us, 1024: 14.2 * us, 256: 13.8 * us, 64: 60 * us})
    assert tune_rows(fake, _spec(4096), base, False).chunk_size == 1024
    # 2% faster is within the noise: the planned chunk stays
    fake = _FakeBound({4096: 10 * us, 1024: 9.8 * us, 256: 9.85 * us, 64: 9.9 * us})
    kept = tune_rows(fake, _spec(4096), base, False)
    assert kept.chunk_size == 4096
    assert "kept after timing" in kept.reason
    # below TUNE_MIN_ROWS nothing is timed
    small = _FakeBound({})
    assert tune_rows(small, _spec(500), plan(n=500), False).chunk_size == 500
    assert small.built == []


def test_tuned_chunks_give_the_same_jacobians(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("jax")
    from batchjac.examples import mlp_jacobian, mlp_weights, workload_inputs, workload_model

    model = workload_model("W1", "jax")
    unknown, known = workload_inputs("W1", 5000, seed=3)
    with monkeypatch.context() as patch:
        import batchjac._tuning

        patch.setattr(batchjac._tuning, "worth", lambda *a, **k: True)  # a job that repays it
        jac = batchjac.jacobian(model, unknown, known, explain=True)
    err = capsys.readouterr().err
    assert "kept after timing 5000 rows" in err or "timed per row: 5000 rows" in err
    ref = mlp_jacobian(mlp_weights((8, 64, 64, 4)), np.concatenate([unknown, known], 1))[:, :, :5]
    np.testing.assert_allclose(jac, ref, rtol=2e-4, atol=2e-5 * np.abs(ref).max())
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "off")
    batchjac.jacobian(model, unknown[:4000], known[:4000], explain=True)
    err = capsys.readouterr().err
    assert "timed one chunk" not in err
    assert "timed per row" not in err
    assert "chunks of 4000 rows" in err
    assert "kernel: default (BATCHJAC_AUTOTUNE=off: not timed)" in err
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "maybe")
    with pytest.raises(batchjac.InputError, match="BATCHJAC_AUTOTUNE must be 'on' or 'off'"):
        batchjac.jacobian(model, unknown[:3000], known[:3000])
