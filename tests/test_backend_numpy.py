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


def test_kernels_per_model_are_bounded_least_recently_used_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """200 calls, each with a chunk size of its own: at most MAX_KERNELS kernels are kept (a
    compiled one holds its executable), the least recently used dropped first, never the one
    in use; a dropped size is built again when it comes back, with the right values. (No
    tuning: a race of the modes on the calls would make kernels of the other mode too.)"""
    from batchjac import _backends

    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "off")
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


# -- the runner's checks, on fake kernels whose results the test chooses ----------------------------
class _Kernel:
    """A kernel as the runner sees one: ``chunk_size`` rows a call, the bound model it belongs
    to (``_bound``), results ``(y, J)``; J zero when ``zero``; ``make`` builds the arrays (numpy
    or a framework's)."""

    def __init__(self, bound: object, chunk_size: int, *, zero: bool, k: int = D, m: int = M,
                 make: Any = np.asarray) -> None:
        self._bound, self.chunk_size, self.zero, self.k, self.m, self.make = (
            bound, chunk_size, zero, k, m, make)
        self.seen: list[Any] = []

    def __call__(self, u: Any, ctx: tuple[Any, ...]) -> tuple[Any, Any]:
        self.seen.append((u, ctx))
        rows = u.shape[0]
        jac = (np.zeros((rows, self.m, self.k)) if self.zero
               else data(rows * self.m, 11)[:, : self.k].reshape(rows, self.m, self.k))
        return self.make(data(rows, 12)[:, : self.m]), self.make(jac)


def _bound() -> Any:
    import types

    return types.SimpleNamespace()


def test_all_zero_jacobians_warn_once_per_bound_model_naming_the_chunk() -> None:
    import warnings

    from batchjac._runner import Chunk, call

    u = data(4, 13)
    bound = _bound()
    with pytest.warns(batchjac.ZeroJacobianWarning, match=r"^Every Jacobian entry of chunk 0 \(rows "
                      r"0:4\) is zero: the model's output does not seem to depend") as got:
        out = call(_Kernel(bound, 4, zero=True), u, (), Chunk(0, 0, 4), rows=4)
    assert len(got) == 1
    assert not np.any(out["jacobians"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the same bound model again, through another of its kernels: checked once only
        call(_Kernel(bound, 8, zero=True), u, (), Chunk(1, 4, 8), rows=4)
        # a kernel's Jacobians that are not all zero, a call that skips the check, and a
        # wrapper that is not a kernel (no chunk_size) never warn
        call(_Kernel(_bound(), 4, zero=False), u, (), "rows 0:4")
        fresh = _bound()
        call(_Kernel(fresh, 4, zero=True), u, (), "rows 0:4", zero_check=False)

        def wrapper(u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[None, np.ndarray]:
            return None, np.zeros((u.shape[0], M, D))

        call(wrapper, u, (), "rows 0:4")
        call(_Kernel(_bound(), 4, zero=True), u[:0], (), "rows 0:0")  # no entries: nothing to say
    # the check skipped above is still owed on the first checked call
    with pytest.warns(batchjac.ZeroJacobianWarning, match=r"Every Jacobian entry of rows 0:4 is zero"):
        call(_Kernel(fresh, 4, zero=True), u, (), "rows 0:4")
    # a single zero entry (one row, one output, one unknown) is all zero too
    with pytest.warns(batchjac.ZeroJacobianWarning):
        call(_Kernel(_bound(), 1, zero=True, k=1, m=1), u[:1, :1], (), "rows 0:1")


def test_all_zero_framework_jacobians_are_found_where_they_live() -> None:
    import warnings

    from batchjac._runner import call

    torch = pytest.importorskip("torch")
    u = torch.as_tensor(data(4, 14))
    with pytest.warns(batchjac.ZeroJacobianWarning):
        call(_Kernel(_bound(), 4, zero=True, make=torch.as_tensor), u, (), "rows 0:4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(_Kernel(_bound(), 4, zero=False, make=torch.as_tensor), u, (), "rows 0:4")


def test_run_single_gives_every_row_once_cut_to_the_rows() -> None:
    from batchjac._bind import prepare
    from batchjac._runner import run_single
    from batchjac._validate import normalize

    z = data(5, 15)
    spec = normalize((z,), wrt=None, dtype=None, nan_policy="raise")
    kernel = prepare(MODEL, spec, "numpy", {}).kernel("reverse", 8, True)  # 3 rows of padding
    out = run_single(kernel, spec)
    np.testing.assert_allclose(out["outputs"], f(z), rtol=1e-12)
    np.testing.assert_allclose(out["jacobians"], jac(z), rtol=1e-12)

    class Broken:
        chunk_size = 8

        def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> Any:
            raise FloatingPointError("overflow in the model")

    with pytest.raises(batchjac.ModelError, match=r"^The model failed on rows 0:5: "
                       r"FloatingPointError: overflow in the model$"):
        run_single(Broken(), spec)


def test_iter_results_gives_no_rows_unless_asked_and_names_the_chunk_it_cannot_read() -> None:
    from batchjac._runner import iter_results
    from batchjac._xp import NUMPY

    z = data(10, 16)
    kernel = _Kernel(_bound(), 4, zero=False)

    class Unreadable:
        """Inputs read by rows (a file), whose rows 4: cannot be read."""

        n, xp = 10, NUMPY

        def chunk(self, lo: int, hi: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
            if lo >= 4:
                raise batchjac.InputError("rows cannot be read")
            return z[lo:hi], ()

    results = iter_results(kernel, Unreadable())  # type: ignore[arg-type]
    chunk, _, rows = next(results)
    assert (chunk.lo, chunk.hi, rows) == (0, 4, None)
    np.testing.assert_array_equal(kernel.seen[0][0], z[:4])
    with pytest.raises(batchjac.InputError, match=r"^rows cannot be read\n  \[chunk 1 \(rows 4:8\)\]$"):
        next(results)


def test_the_runner_pads_framework_arrays_with_their_own_ops() -> None:
    """Inputs that are a framework's arrays are read, padded and passed as that framework's
    arrays (the last row repeated), in the chunk loop and the one-chunk path alike."""
    from batchjac._arrays import ops_of
    from batchjac._runner import iter_results, run_single
    from batchjac._validate import normalize

    torch = pytest.importorskip("torch")
    u, h = data(6, 17)[:, :4], data(6, 18)[:, :2]
    ut, ht = torch.as_tensor(u), torch.as_tensor(h)
    spec = normalize((ut, ht), wrt=None, dtype=None, nan_policy="raise", xp=ops_of(ut))
    kernel = _Kernel(_bound(), 4, zero=False, k=4, make=torch.as_tensor)
    list(iter_results(kernel, spec))
    run_single(_Kernel(_bound(), 8, zero=False, k=4, make=torch.as_tensor), spec)
    assert len(kernel.seen) == 2
    last_u, last_ctx = kernel.seen[1]  # rows 4:6, padded to 4
    assert isinstance(last_u, torch.Tensor)
    assert all(isinstance(c, torch.Tensor) for c in last_ctx)
    np.testing.assert_array_equal(last_u.numpy(), u[[4, 5, 5, 5]])
    np.testing.assert_array_equal(last_ctx[0].numpy(), h[[4, 5, 5, 5]])


def test_the_zero_check_reads_every_block_of_rows() -> None:
    """The all-zero check reduces blocks of rows (2**16 entries each): a single nonzero entry
    is found in the first row, the last row and between blocks; 0-d and 1-D results too."""
    from batchjac._runner import _any_nonzero

    rng = np.random.default_rng(62)
    for shape in ((200, 1024), (2000, 64), (7,), (3, 5, 2)):
        zeros = np.zeros(shape, np.float32)
        assert not _any_nonzero(zeros)
        for row in (0, shape[0] - 1, int(rng.integers(shape[0]))):
            one = zeros.copy()
            rest = tuple(int(rng.integers(d)) for d in shape[1:])
            one[(row, *rest)] = 1.0 + rng.random()
            assert _any_nonzero(one), (shape, row)
    assert not _any_nonzero(np.array(0.0))
    assert _any_nonzero(np.array(2.5))
