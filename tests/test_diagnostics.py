"""Errors that say what to do (issue 19): each bad call gets one error naming the argument, what
was received and the fix, and results that would be silently useless get a warning. Models are
small closed forms (a Dense layer, a linear map), so right results are checked exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchjac

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")


def _rng() -> np.random.Generator:
    return np.random.default_rng()  # fresh inputs each run: the checks must not depend on them


def _dense(width: int = 8, outputs: int = 4) -> Any:
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(outputs)])
    model.layers[-1].kernel.assign(_rng().normal(size=(width, outputs)).astype("f4"))
    return model


def _kernel(model: Any) -> np.ndarray:
    return np.asarray(model.layers[-1].kernel)


# -- integer known inputs are cast to the compute dtype -----------------------------------------

def test_integer_known_inputs_are_cast_to_the_compute_dtype() -> None:
    model, rng = _dense(), _rng()
    u = rng.normal(size=(12, 5)).astype("f4")
    h = rng.integers(-3, 4, size=(12, 3))  # int64: ConcatV2 refused float32 + int64
    jac = batchjac.jacobian(model, u, h)
    w = _kernel(model)
    np.testing.assert_allclose(jac, np.broadcast_to(w[:5].T, (12, 4, 5)), rtol=1e-6)
    # the known columns beside `wrt` of one integer table too
    x = rng.integers(-3, 4, size=(12, 8))
    jac = batchjac.jacobian(model, x, wrt=[1, 6])
    np.testing.assert_allclose(jac, np.broadcast_to(w[[1, 6]].T, (12, 4, 2)), rtol=1e-6)


# -- a DataFrame's column names -------------------------------------------------------------------

def test_dataframe_columns_name_the_unknowns(tmp_path: Any) -> None:
    pd = pytest.importorskip("pandas", reason="pandas is in the dev extra; DataFrames are tested "
                                              "where it is installed")
    model, rng = _dense(), _rng()
    names = [f"x{j}" for j in range(8)]
    frame = pd.DataFrame(rng.normal(size=(12, 8)).astype("f4"), columns=names)
    jac = batchjac.jacobian(model, frame, wrt=["x2", "x5", "x0"])
    w = _kernel(model)
    np.testing.assert_allclose(jac, np.broadcast_to(w[[2, 5, 0]].T, (12, 4, 3)), rtol=1e-6)
    with pytest.raises(batchjac.InputError, match=r"`wrt` names column 'nope', which `x` does not "
                                                  r"have; its columns are \['x0', 'x1'"):
        batchjac.jacobian(model, frame, wrt=["nope"])
    # a store labels the unknowns with the frame's column names
    result = batchjac.jacobian(model, frame, wrt=["x1", "x3"], out=str(tmp_path / "j.zarr"))
    assert result.open().shape == (12, 4, 2)
    assert batchjac.read_manifest(str(tmp_path / "j.zarr"))["metadata"]["unknown_names"] == ["x1", "x3"]
    # a text column is named, not reported as "ragged rows"
    frame["label"] = ["a"] * 12
    with pytest.raises(batchjac.InputTypeError, match=r"column\(s\) \['label'\] are not numeric"):
        batchjac.jacobian(model, frame, wrt=["x1"])
