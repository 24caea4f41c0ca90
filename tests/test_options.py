"""Options of ``batchjac.jacobian`` that must be refused or corrected rather than honoured
silently: ``out`` of another dtype, ``chunk_size`` beyond the rows, ``max_memory`` that is
not a size.

The model is a PyTorch linear map x -> x @ W.T: its Jacobian is W for every row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import batchjac  # noqa: E402

N, M, D = 20, 3, 4


def linear(w: np.ndarray, dtype: Any = torch.float32) -> Any:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    return lin.eval()


@pytest.fixture(scope="module")
def problem() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2024)
    return rng.normal(size=(M, D)), rng.normal(size=(N, D))


# -- out= of the wrong dtype ----------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", [np.int32, np.bool_, np.float16, np.float64])
def test_out_of_another_dtype_is_refused(problem: tuple[np.ndarray, np.ndarray],
                                         out_dtype: Any) -> None:
    w, u = problem
    model = linear(w)
    out = np.full((N, M, D), 5, dtype=out_dtype)
    before = out.copy()
    name = np.dtype(out_dtype).name
    with pytest.raises(batchjac.InputError,
                       match=rf"`out` has dtype {name}.*computed in float32.*dtype=np\.float32"):
        batchjac.jacobian(model, u.astype(np.float32), out=out, chunk_size=7)
    np.testing.assert_array_equal(out, before)  # nothing was written


def test_out_of_the_compute_dtype_is_filled(problem: tuple[np.ndarray, np.ndarray]) -> None:
    w, u = problem
    out = np.zeros((N, M, D), np.float32)
    got = batchjac.jacobian(linear(w), u.astype(np.float32), out=out, chunk_size=7)
    assert got is out
    np.testing.assert_allclose(out, np.broadcast_to(w, (N, M, D)), rtol=1e-6)
    out64 = np.zeros((N, M, D), np.float64)
    batchjac.jacobian(linear(w, torch.float64), u, out=out64, chunk_size=7)
    np.testing.assert_array_equal(out64, np.broadcast_to(w, (N, M, D)))
