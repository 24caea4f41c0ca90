"""Options of ``batchjac.jacobian`` that must be refused or corrected rather than honoured
silently: ``out`` of another dtype, ``chunk_size`` beyond the rows, ``max_memory`` that is
not a size.

The model is a PyTorch linear map x -> x @ W.T: its Jacobian is W for every row.
"""

from __future__ import annotations

import re
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


# -- chunk_size larger than N ----------------------------------------------------------------

def test_chunk_size_beyond_the_rows_is_capped(problem: tuple[np.ndarray, np.ndarray],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    w, u = problem
    model = linear(w, torch.float64)
    ref = batchjac.jacobian(model, u)
    got = batchjac.jacobian(model, u, chunk_size=10**12, explain=True)
    assert "chunks of 20 rows (chunk_size was given" in capsys.readouterr().err
    np.testing.assert_array_equal(got, np.broadcast_to(w, (N, M, D)))
    np.testing.assert_array_equal(got, ref)
    plan = batchjac._plan.make_plan(n=N, k=D, m=M, in_elems=D, dtype=np.dtype(np.float64),
                                    mode="reverse", chunk_size=10**12, max_memory=10**9)
    assert (plan.chunk_size, plan.n_chunks) == (20, 1)
    # a chunk a few times the rows is kept: one compiled shape serves calls with other N
    kept = batchjac._plan.make_plan(n=5000, k=D, m=M, in_elems=D, dtype=np.dtype(np.float64),
                                    mode="reverse", chunk_size=16384, max_memory=10**9)
    assert (kept.chunk_size, kept.n_chunks) == (16384, 1)


def test_a_chunk_size_over_the_memory_budget_warns_at_the_users_call(
        problem: tuple[np.ndarray, np.ndarray]) -> None:
    from batchjac._plan import ChunkMemoryWarning

    w, u = problem
    with pytest.warns(ChunkMemoryWarning, match=r"chunk_size=20 needs ~") as rec:
        jac = batchjac.jacobian(linear(w), u, chunk_size=20, max_memory=2000)
    assert rec[0].filename == __file__  # the user's call, not a line of batchjac
    np.testing.assert_allclose(jac, np.broadcast_to(w, (N, M, D)), rtol=1e-6)


def test_chunk_size_over_the_memory_budget_is_reported() -> None:
    from batchjac._plan import ChunkMemoryWarning, bytes_per_row, make_plan

    per_row = bytes_per_row(D, M, D, 4)
    with pytest.warns(ChunkMemoryWarning, match=r"chunk_size=1000 needs ~.* more than the "
                                                r"memory budget \(max_memory\)"):
        plan = make_plan(n=5000, k=D, m=M, in_elems=D, dtype=np.dtype(np.float32), mode="auto",
                         chunk_size=1000, max_memory=100 * per_row)
    assert plan.chunk_size == 1000  # the user's choice is kept
    assert "more than the memory budget" in plan.reason


# -- max_memory that is not a size -----------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1, -2.5, 0,
                                   np.float64("nan"), "-5MB", "nanGB", "inf", "lots", "1.5XB",
                                   "", [512], True])
def test_bad_max_memory_is_refused_clearly(value: Any) -> None:
    from batchjac._config import parse_bytes

    shown = re.escape(repr(value))
    with pytest.raises(batchjac.InputError, match=rf"`max_memory` must be .*'512MB'.*got {shown}"):
        parse_bytes(value)


def test_bad_max_memory_in_jacobian(problem: tuple[np.ndarray, np.ndarray]) -> None:
    w, u = problem
    with pytest.raises(batchjac.InputError,
                       match=r"`max_memory` must be .*'512MB'.*got nan, which is not a finite"):
        batchjac.jacobian(linear(w), u.astype(np.float32), max_memory=float("nan"))


@pytest.mark.parametrize(("value", "nbytes"), [("512MB", 512 * 10**6), (2048, 2048),
                                               (np.int64(4096), 4096), (1.5e9, 1_500_000_000),
                                               (" 2 GiB ", 2 * 2**30)])
def test_good_max_memory(value: Any, nbytes: int) -> None:
    from batchjac._config import parse_bytes

    assert parse_bytes(value) == nbytes
