"""The numpy backend (closed-form models) and, on it, the runner, the sinks and the stores
with no framework installed: every value against the closed form.

The model: ``y = A @ tanh(B @ z)`` per row, with ``dy/dz = A diag(1 - tanh^2) B``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac import ClosedForm
from batchjac._runner import chunk_bounds, chunks, iter_results, model_call, pad

D, M = 6, 3
_rng = np.random.default_rng(42)
A, B = _rng.normal(size=(M, 5)), _rng.normal(size=(5, D))


def f(z: np.ndarray) -> np.ndarray:
    return np.tanh(z @ B.T) @ A.T


def jac(z: np.ndarray) -> np.ndarray:
    s = 1 - np.tanh(z @ B.T) ** 2  # (N, 5)
    return np.einsum("mh,nh,hd->nmd", A, s, B)


MODEL = ClosedForm(f, jac)


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, D))


def test_finite_differences_agree_with_the_closed_form() -> None:
    z = data(4, 0)
    eps = 1e-6
    fd = np.stack([(f(z + eps * e) - f(z - eps * e)) / (2 * eps) for e in np.eye(D)], axis=-1)
    np.testing.assert_allclose(jac(z), fd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("wrt", "cols"), [(None, list(range(D))), ([0, 2, 5], [0, 2, 5]),
                                           ([4, 1], [4, 1]), (slice(1, 4), [1, 2, 3])])
def test_jacobian_every_column_selection(wrt: Any, cols: list[int]) -> None:
    z = data(50, 1)
    got = batchjac.jacobian(MODEL, z, wrt=wrt)
    np.testing.assert_allclose(got, jac(z)[..., cols], rtol=1e-12, atol=1e-12)


def test_unknown_known_concat_and_outputs() -> None:
    z = data(30, 2)
    y, got = batchjac.jacobian(MODEL, z[:, :2], z[:, 2:], return_outputs=True)
    np.testing.assert_allclose(got, jac(z)[..., :2], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y, f(z), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 100])
def test_chunked_equals_closed_form(chunk_size: int) -> None:
    z = data(100, 3)
    got = batchjac.jacobian(MODEL, z, chunk_size=chunk_size)
    np.testing.assert_allclose(got, jac(z), rtol=1e-12, atol=1e-12)


def test_out_memmap_filled_in_place(tmp_path: Path) -> None:
    z = data(90, 4)
    out = np.lib.format.open_memmap(tmp_path / "j.npy", mode="w+", dtype=np.float64, shape=(90, M, D))
    res = batchjac.jacobian(MODEL, z, chunk_size=16, out=out)
    assert res is out
    np.testing.assert_allclose(np.load(tmp_path / "j.npy"), jac(z), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("suffix", [".npy", ".zarr", ".h5"])
def test_store_equals_closed_form(tmp_path: Path, suffix: str) -> None:
    if suffix != ".npy":
        pytest.importorskip("zarr" if suffix == ".zarr" else "h5py")
    z = data(75, 5)
    res = batchjac.jacobian(MODEL, z, out=str(tmp_path / f"j{suffix}"), chunk_size=20,
                            return_outputs=True)
    assert (res.chunks, res.computed_chunks) == (4, 4)
    np.testing.assert_allclose(np.asarray(res.open()), jac(z), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(res.open("outputs")), f(z), rtol=1e-12, atol=1e-12)


def test_check_and_propagate_against_closed_forms() -> None:
    z = data(20, 6)
    assert batchjac.check(MODEL, z).passed
    cov = np.diag(np.linspace(0.01, 0.06, D))
    res = batchjac.propagate(MODEL, z, cov=cov)
    j = jac(z)
    np.testing.assert_allclose(res.cov, j @ cov @ j.transpose(0, 2, 1), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(res.mean, f(z), rtol=1e-12, atol=1e-12)


def test_repeated_calls_build_no_kernel() -> None:
    from batchjac import _backends

    model = ClosedForm(f, jac)
    batchjac.jacobian(model, data(40, 0), chunk_size=16)
    bound = next(iter(_backends._bound[model].values()))
    first = bound.trace_count
    assert first >= 1
    for seed in (1, 2):
        np.testing.assert_allclose(batchjac.jacobian(model, data(40, seed), chunk_size=16),
                                   jac(data(40, seed)), rtol=1e-12)
    assert bound.trace_count == first


def test_kernels_per_model_are_bounded_least_recently_used_dropped() -> None:
    """200 calls, each with a chunk size of its own: at most MAX_KERNELS kernels are kept (a
    compiled one holds its executable), the least recently used dropped first, never the one
    in use; a dropped size is built again when it comes back, with the right values."""
    from batchjac import _backends

    model = ClosedForm(f, jac)
    hot = 7
    for n in range(10, 210):
        x = data(n, n)
        np.testing.assert_allclose(batchjac.jacobian(model, x, chunk_size=n), jac(x), rtol=1e-12)
        batchjac.jacobian(model, data(hot, 0), chunk_size=hot)  # used all along: kept
    bound = next(iter(_backends._bound[model].values()))
    cap = 16  # BoundModel.MAX_KERNELS
    assert len(bound._kernels) == cap
    assert bound.has_kernel("reverse", hot, False)
    assert bound.has_kernel("reverse", 209, False)
    assert not bound.has_kernel("reverse", 10, False)
    assert bound.trace_count == 201  # each size once, the hot one once
    x = data(10, 1)
    np.testing.assert_allclose(batchjac.jacobian(model, x, chunk_size=10), jac(x), rtol=1e-12)
    assert bound.trace_count == 202
    assert len(bound._kernels) == cap


# -- the runner's pieces ---------------------------------------------------------------------------

def test_chunks_cover_the_rows_once() -> None:
    for n, cs in ((0, 4), (1, 4), (8, 4), (9, 4), (100, 7)):
        got = list(chunks(n, cs))
        assert [c.index for c in got] == list(range(len(got)))
        covered = [r for c in got for r in range(c.lo, c.hi)]
        assert covered == list(range(n))
        assert all(0 < c.rows <= cs for c in got)
    assert [c.index for c in chunks(20, 4, [3, 1])] == [3, 1]
    assert chunk_bounds(4, 4, 18) == chunk_bounds(4, 4, 18)
    assert (chunk_bounds(4, 4, 18).lo, chunk_bounds(4, 4, 18).hi) == (16, 18)


def test_pad_repeats_the_last_row() -> None:
    a = data(3, 7)
    p = pad(a, 5)
    np.testing.assert_array_equal(p[:3], a)
    np.testing.assert_array_equal(p[3:], np.repeat(a[-1:], 2, axis=0))
    assert pad(a, 3) is a


def test_the_boundary_names_the_chunk() -> None:
    def broken(*inputs: np.ndarray) -> np.ndarray:
        raise FloatingPointError("overflow in the model")

    with pytest.raises(batchjac.ModelError, match=r"failed on chunk 1 \(rows 10:20\).*overflow"):
        batchjac.jacobian(ClosedForm(f, lambda z: broken(z) if z[0, 0] > 9 else jac(z)),
                          np.concatenate([data(10, 8), data(10, 8) + 100]), chunk_size=10)
    with pytest.raises(batchjac.InputError, match=r"bad\n  \[where\]"), model_call("where"):
        raise batchjac.InputError("bad")


def test_iter_results_keeps_the_rows_read() -> None:
    from batchjac._bind import prepare
    from batchjac._validate import normalize

    z = data(25, 9)
    spec = normalize((z,), wrt=None, dtype=None, nan_policy="raise")
    bound = prepare(MODEL, spec, "numpy", {})
    kernel = bound.kernel("reverse", 10, True)
    seen = list(iter_results(kernel, spec, [2, 0], keep_rows=True))
    assert [c.index for c, _, _ in seen] == [2, 0]
    (c2, r2, rows2), (_, r0, _) = seen
    assert rows2 is not None
    np.testing.assert_array_equal(rows2[0], z[20:25])  # unpadded
    np.testing.assert_allclose(r2["jacobians"], jac(z[20:25]), rtol=1e-12)
    np.testing.assert_allclose(r0["outputs"], f(z[:10]), rtol=1e-12)
    assert r2["jacobians"].shape[0] == c2.rows == 5
