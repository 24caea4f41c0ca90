"""Where results go: the arrays a chunked run allocates for its result."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import batchjac
from batchjac import _sinks

from .conformance import SEED_SIZES
from .helpers import assert_jac_close


def _owner(a: np.ndarray) -> object:
    """What owns the memory behind ``a`` (through views and numpy's buffer wrapper)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    base = a.base
    return base.obj if isinstance(base, memoryview) else base


def test_small_result_is_an_ordinary_array() -> None:
    a = _sinks.new_result((10, 4, 5), np.float32)
    assert a.shape == (10, 4, 5)
    assert a.dtype == np.float32
    assert a.flags.owndata


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="MAP_POPULATE is Linux only")
def test_large_result_is_a_populated_mapping_that_works_as_an_array(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sinks, "POPULATE_BYTES", 1)
    a = _sinks.new_result((300, 4, 5), "float64")
    assert a.shape == (300, 4, 5)
    assert a.dtype == np.float64
    assert a.flags.writeable
    assert a.flags.c_contiguous
    assert isinstance(_owner(a), mmap.mmap)
    values = np.random.default_rng(4).normal(size=a.shape)
    a[...] = values
    np.testing.assert_array_equal(a, values)


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="MAP_POPULATE is Linux only")
def test_chunked_run_into_a_populated_result_matches_one_chunk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("jax")
    from batchjac.examples import mlp_jacobian, mlp_weights, seed_model, workload_inputs

    model = seed_model("jax")
    unknown, known = workload_inputs("W1", 700, seed=12)
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    monkeypatch.setattr(_sinks, "POPULATE_BYTES", 1)
    y, chunked = batchjac.jacobian(model, unknown, known, chunk_size=128, return_outputs=True)
    assert isinstance(_owner(chunked), mmap.mmap)
    assert isinstance(_owner(y), mmap.mmap)
    assert_jac_close(chunked, ref)
