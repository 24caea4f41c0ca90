"""The public surface: the names users are told to use are exported from ``batchjac``, and
``solve(..., out=)`` writes the resumable output ``batchjac solve`` writes."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchjac

DOCUMENTED = ["jacobian", "check", "propagate", "solve", "sensitivity", "write_report", "Store",
              "StoreResult", "SolveResult", "SolveStoreResult", "open_store", "read_manifest",
              "BatchJacError", "InputError", "InputFileError", "ModelError", "ModelLoadError",
              "NotConnectedError", "RowInteractionError", "StoreError", "StoreExistsError",
              "StoreMismatchError", "StoreBusyError", "StoreWriteError", "BatchJacWarning",
              "CovarianceClippedWarning", "ForwardModeFallbackWarning", "TrainingModeWarning",
              "XLAFallbackWarning", "RebindWarning", "TuneCacheWarning", "StoreRecomputeWarning",
              "ChunkMemoryWarning", "ZeroJacobianWarning", "UnwatchedValuesWarning"]


def test_documented_names_are_public() -> None:
    missing = [name for name in DOCUMENTED if name not in batchjac.__all__]
    assert not missing
    for name in batchjac.__all__:
        assert getattr(batchjac, name) is not None
    assert issubclass(batchjac.StoreMismatchError, batchjac.StoreExistsError)
    assert issubclass(batchjac.StoreError, batchjac.BatchJacError)
    assert issubclass(batchjac.InputFileError, batchjac.InputError)
    assert issubclass(batchjac.ModelLoadError, batchjac.ModelError)
    for warning in ("CovarianceClippedWarning", "ForwardModeFallbackWarning", "TrainingModeWarning",
                    "XLAFallbackWarning", "ZeroJacobianWarning"):
        assert issubclass(getattr(batchjac, warning), batchjac.BatchJacWarning)


def test_one_filter_silences_every_batchjac_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=batchjac.BatchJacWarning)
        warnings.warn("clipped", batchjac.CovarianceClippedWarning, stacklevel=1)
        warnings.warn("fallback", batchjac.XLAFallbackWarning, stacklevel=1)
        warnings.warn("someone else's", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["someone else's"]


# -- solve(out=) ----------------------------------------------------------------------------------

K, H, M, N = 2, 3, 4, 40


def _problem() -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    w1, w2 = rng.normal(size=(K + H, 8)) * 0.6, rng.normal(size=(8, M)) * 0.6
    t1, t2 = torch.tensor(w1), torch.tensor(w2)

    def model(z: Any) -> Any:
        return torch.tanh(z @ t1.to(z.dtype)) @ t2.to(z.dtype)

    x = rng.uniform(-1, 1, (N, K))
    h = rng.normal(size=(N, H))
    targets = np.tanh(np.concatenate([x, h], 1) @ w1) @ w2  # closed form of the model
    return model, x, h, targets


@pytest.mark.parametrize("suffix", ["", ".zarr"])
def test_solve_out_writes_the_store(tmp_path: Path, suffix: str) -> None:
    if suffix == ".zarr":
        pytest.importorskip("zarr")
    model, x_true, h, targets = _problem()
    out = tmp_path / f"solved{suffix}"
    res = batchjac.solve(model, targets, h, n_unknowns=K, bounds=(-2.0, 2.0), out=out, block_size=16)
    assert isinstance(res, batchjac.SolveStoreResult)
    assert (res.instances, res.blocks) == (N, 3)
    x = np.asarray(res.open("x"))
    np.testing.assert_allclose(x, x_true, atol=1e-6)  # float64 targets of the exact model
    ref = batchjac.solve(model, targets, h, n_unknowns=K, bounds=(-2.0, 2.0), reproducible=True)
    np.testing.assert_allclose(x, ref.x, rtol=0, atol=1e-9)
    np.testing.assert_array_equal(np.asarray(res.open("success")), ref.success)
    again = batchjac.solve(model, targets, h, n_unknowns=K, bounds=(-2.0, 2.0), out=out, block_size=16)
    assert (again.computed_blocks, again.resumed_blocks) == (0, 3)  # the same job: nothing to do


def test_solve_out_store_object_and_refusals(tmp_path: Path) -> None:
    model, _, h, targets = _problem()
    out = tmp_path / "solved"
    batchjac.solve(model, targets, h, n_unknowns=K, out=batchjac.Store(str(out)))
    with pytest.raises(batchjac.StoreMismatchError, match="different job"):
        batchjac.solve(model, targets * 2, h, n_unknowns=K, out=out)
    redone = batchjac.solve(model, targets * 2, h, n_unknowns=K,
                            out=batchjac.Store(str(out), overwrite=True))
    assert redone.computed_blocks == redone.blocks
    with pytest.raises(batchjac.InputError, match=r"`callback`.*not supported with `out=`"):
        batchjac.solve(model, targets, h, n_unknowns=K, out=tmp_path / "o2", callback=print)
    with pytest.raises(batchjac.InputError, match="`chunk_size`=8 is not supported with `out=`"):
        batchjac.solve(model, targets, h, n_unknowns=K, out=tmp_path / "o3", chunk_size=8)
    with pytest.raises(batchjac.InputError, match=r"`block_size`.*goes with `out=`"):
        batchjac.solve(model, targets, h, n_unknowns=K, block_size=8)
    with pytest.raises(batchjac.InputError, match="`bounds` must be a pair"):
        batchjac.solve(model, targets, h, n_unknowns=K, out=tmp_path / "o4", bounds=(1.0,))
