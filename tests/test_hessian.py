"""Per-instance second derivatives (batchjac.hessian, laplacian, hvp) in every framework.

References, never batchjac against itself: closed forms (a quadratic's Hessian is its matrix
``A + A^T``; ``sum(sin x)`` has Laplacian ``-sum(sin x)``), float64 central differences of the
analytic Jacobian of the seed MLP (``batchjac.examples.mlp_jacobian``, no autodiff), and each
framework's own Hessian (``torch.func.hessian``, ``jax.hessian``, nested TensorFlow tapes) on
the same weights. Fresh seeded random inputs throughout.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac._plan import second_bytes_per_row
from batchjac.examples import mlp_jacobian, mlp_weights

from .helpers import assert_jac_close, central_differences, rng, run_in_fresh_process

BACKENDS = ("torch", "jax", "tensorflow")
ORDERS = ("forward-over-reverse", "forward-over-forward")
SIZES = (8, 64, 64, 4)  # the seed MLP (W1/W6): 5 unknown + 3 known -> 4 outputs
#: second derivatives in float64 against references in float64
TOL = 1e-9


@contextlib.contextmanager
def framework(name: str) -> Iterator[Any]:
    """The framework module, with JAX's x64 mode on for the block (float64 throughout)."""
    mod = pytest.importorskip(name)
    if name == "jax":  # (jax.enable_x64 is JAX >= 0.7's; compat finds older JAX's)
        from batchjac._backends.jax import compat

        with compat.enable_x64(True):
            yield mod
    else:
        yield mod


def mlp(name: str, layers: list[tuple[np.ndarray, np.ndarray]]) -> Callable[[Any], Any]:
    """The MLP of ``layers`` as a batch function of the framework ``name`` (float64)."""
    if name == "torch":
        import torch

        ws = [(torch.tensor(w), torch.tensor(b)) for w, b in layers]
        tanh, matmul = torch.tanh, torch.matmul
    elif name == "jax":
        import jax.numpy as jnp

        ws = [(jnp.asarray(w), jnp.asarray(b)) for w, b in layers]
        tanh, matmul = jnp.tanh, jnp.matmul
    else:
        import tensorflow as tf

        ws = [(tf.constant(w), tf.constant(b)) for w, b in layers]
        tanh, matmul = tf.tanh, tf.matmul

    def f(x: Any) -> Any:
        h = x
        for i, (w, b) in enumerate(ws):
            h = matmul(h, w) + b
            if i < len(ws) - 1:
                h = tanh(h)
        return h

    return f


def native_hessian(name: str, f: Callable[[Any], Any], x: np.ndarray) -> np.ndarray:
    """Each framework's own per-instance Hessian of the batch function ``f``: ``vmap`` of
    ``torch.func.hessian`` / ``jax.hessian``, nested ``batch_jacobian`` tapes in TensorFlow."""
    if name == "torch":
        import torch

        from batchjac._backends.torch.state import _load_forward_ad

        _load_forward_ad()  # (jacfwd's first use: its import's deprecation warning silenced)
        one = torch.func.hessian(lambda z: f(z[None])[0])
        return torch.func.vmap(one)(torch.tensor(x)).detach().numpy()  # type: ignore[no-any-return]
    if name == "jax":
        import jax

        return np.asarray(jax.vmap(jax.hessian(lambda z: f(z[None])[0]))(x))
    import tensorflow as tf

    xt = tf.constant(x)
    with tf.GradientTape() as outer:
        outer.watch(xt)
        with tf.GradientTape() as inner:
            inner.watch(xt)
            y = f(xt)
        jac = inner.batch_jacobian(y, xt)
    return outer.batch_jacobian(jac, xt).numpy()  # type: ignore[no-any-return]


def fd_hessian(layers: list[tuple[np.ndarray, np.ndarray]], unknown: np.ndarray,
               known: np.ndarray) -> np.ndarray:
    """Float64 central differences of the analytic Jacobian with respect to the unknowns."""
    k = unknown.shape[1]

    def jac(u: np.ndarray) -> np.ndarray:
        return mlp_jacobian(layers, np.concatenate([u, known], axis=1))[..., :k]

    return central_differences(jac, unknown)


# -- closed forms ------------------------------------------------------------------------------

def quadratic(name: str, a: np.ndarray, b: np.ndarray) -> Callable[[Any], Any]:
    """``f(x) = x^T A x + b^T x`` per row: a scalar output (rank-1 result ``(N,)``)."""
    with framework(name) as fw:
        if name == "torch":
            at, bt = fw.tensor(a), fw.tensor(b)
            return lambda x: ((x @ at) * x).sum(-1) + x @ bt
        if name == "jax":
            at, bt = fw.numpy.asarray(a), fw.numpy.asarray(b)
            return lambda x: ((x @ at) * x).sum(-1) + x @ bt
        at, bt = fw.constant(a), fw.constant(b)
        return lambda x: fw.reduce_sum(fw.matmul(x, at) * x, -1) + fw.linalg.matvec(x, bt)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
def test_quadratic_hessian_is_its_matrix(name: str, order: str) -> None:
    r = rng(1)
    a, b = r.normal(size=(4, 4)), r.normal(size=4)
    x = r.normal(size=(37, 4))
    with framework(name):
        f = quadratic(name, a, b)
        y, jac, hess = batchjac.hessian(f, x, mode=order, backend=name, return_outputs=True,
                                        return_jacobian=True)
    assert hess.shape == (37, 4, 4)
    assert y.shape == (37,)
    assert jac.shape == (37, 4)
    assert_jac_close(hess, np.broadcast_to(a + a.T, (37, 4, 4)), factor=0.1)
    assert_jac_close(jac, x @ (a + a.T) + b, factor=0.1)  # the gradient, 2 sym(A) x + b
    assert_jac_close(y, np.einsum("ni,ij,nj->n", x, a, x) + x @ b, factor=0.1)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
def test_sum_sin_laplacian_and_diagonal(name: str, order: str) -> None:
    x = rng(2).normal(size=(50, 3)) * 2
    with framework(name) as fw:
        f = (lambda z: fw.sin(z).sum(-1)) if name != "jax" else (lambda z: fw.numpy.sin(z).sum(-1))
        if name == "tensorflow":
            f = lambda z: fw.reduce_sum(fw.sin(z), -1)  # noqa: E731
        lap = batchjac.laplacian(f, x, mode=order, backend=name)
        diag = batchjac.hessian(f, x, diagonal=True, mode=order, backend=name)
    assert lap.shape == (50,)
    assert diag.shape == (50, 3)
    assert_jac_close(lap, -np.sin(x).sum(-1), factor=0.1)
    assert_jac_close(diag, -np.sin(x), factor=0.1)


# -- the seed MLP: finite differences and the frameworks' own Hessians -------------------------

@pytest.mark.parametrize("name", BACKENDS)
def test_mlp_hessian_matches_finite_differences_and_native(name: str) -> None:
    layers = mlp_weights(SIZES, seed=3)
    r = rng(4)
    unknown, known = r.normal(size=(40, 5)), r.normal(size=(40, 3))
    with framework(name):
        f = mlp(name, layers)
        hess = batchjac.hessian(f, unknown, known, backend=name)
        native = native_hessian(name, f, np.concatenate([unknown, known], 1))[..., :5, :5]
    assert hess.shape == (40, 4, 5, 5)
    assert_jac_close(hess, native, factor=0.1)
    # central differences of the analytic Jacobian: truncation error ~1e-10 relative
    err = np.abs(hess - fd_hessian(layers, unknown, known)).max() / np.abs(native).max()
    assert err < 1e-7, err
    assert np.abs(hess - np.swapaxes(hess, -1, -2)).max() < 1e-12  # symmetric, as it must be


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
def test_reductions_and_products_match_the_native_hessian(name: str, order: str) -> None:
    layers = mlp_weights(SIZES, seed=5)
    r = rng(6)
    x, v = r.normal(size=(30, 8)), r.normal(size=(30, 8))
    with framework(name):
        f = mlp(name, layers)
        native = native_hessian(name, f, x)
        full = batchjac.hessian(f, x, mode=order, backend=name)
        diag = batchjac.hessian(f, x, diagonal=True, mode=order, backend=name)
        lap = batchjac.laplacian(f, x, mode=order, backend=name)
        prod = batchjac.hvp(f, x, v=v, mode=order, backend=name)
    want_diag = np.diagonal(native, axis1=-2, axis2=-1)
    assert_jac_close(full, native, factor=0.1)
    assert_jac_close(diag, want_diag, factor=0.1)
    assert_jac_close(lap, want_diag.sum(-1), factor=0.1)
    assert_jac_close(prod, np.einsum("naij,nj->nai", native, v), factor=0.1)


@pytest.mark.parametrize("name", BACKENDS)
def test_wrt_columns_hold_the_known_fixed(name: str) -> None:
    """wrt=[1, 4, 6] (not the leading columns): the block of the full Hessian, and the
    Jacobian of the same pass is jacobian()'s."""
    layers = mlp_weights(SIZES, seed=7)
    x = rng(8).normal(size=(25, 8))
    cols = [1, 4, 6]
    with framework(name):
        f = mlp(name, layers)
        y, jac, hess = batchjac.hessian(f, x, wrt=cols, backend=name, return_outputs=True,
                                        return_jacobian=True)
        native = native_hessian(name, f, x)[..., cols, :][..., cols]
    assert hess.shape == (25, 4, 3, 3)
    assert_jac_close(hess, native, factor=0.1)
    assert_jac_close(jac, mlp_jacobian(layers, x)[..., cols], factor=0.1)
    np.testing.assert_allclose(y, _forward(layers, x), rtol=1e-12, atol=1e-12)


def _forward(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    from batchjac.examples import mlp_forward

    return mlp_forward(layers, x)


@pytest.mark.parametrize("name", BACKENDS)
def test_chunked_equals_one_chunk_and_out_is_filled(name: str) -> None:
    layers = mlp_weights(SIZES, seed=9)
    unknown, known = rng(10).normal(size=(45, 5)), rng(11).normal(size=(45, 3))
    with framework(name):
        f = mlp(name, layers)
        whole = batchjac.hessian(f, unknown, known, backend=name)
        chunked = batchjac.hessian(f, unknown, known, backend=name, chunk_size=8)  # 6 chunks
        out = np.full((45, 4, 5, 5), np.nan)
        got = batchjac.hessian(f, unknown, known, backend=name, chunk_size=16, out=out)
    assert got is out
    np.testing.assert_allclose(chunked, whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-14)


def test_multi_input_model_and_float32() -> None:
    """A dict of inputs with wrt naming one (torch), in float32 against float64 references."""
    torch = pytest.importorskip("torch")
    layers = mlp_weights(SIZES, seed=12)
    f64 = mlp("torch", layers)
    r = rng(13)
    xs, hs = r.normal(size=(20, 5)).astype("f4"), r.normal(size=(20, 3)).astype("f4")

    def model(x: Any, h: Any) -> Any:
        return f64(torch.cat([x, h], -1).double()).float()

    hess = batchjac.hessian(model, {"x": xs, "h": hs}, wrt="x")
    assert hess.dtype == np.float32
    assert hess.shape == (20, 4, 5, 5)
    ref = fd_hessian(layers, xs.astype("f8"), hs.astype("f8"))
    assert_jac_close(hess, ref, dtype=np.float32, factor=10)


# -- planning, options and errors --------------------------------------------------------------

def test_max_memory_chunks_and_explain() -> None:
    pytest.importorskip("torch")
    layers = mlp_weights(SIZES, seed=14)
    x = rng(15).normal(size=(300, 8))
    f = mlp("torch", layers)
    per_row = second_bytes_per_row("hessian", "forward-over-reverse", 8, 4, 8, 8)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        hess = batchjac.hessian(f, x, max_memory=per_row * 100, explain=True)
    text = err.getvalue()
    assert "hessian: forward-over-reverse" in text
    assert "memory budget" in text
    size = int(text.split("chunks of ")[1].split(" rows")[0])
    assert size <= 100
    assert_jac_close(hess, native_hessian("torch", f, x), factor=0.1)


def test_bad_options_are_named() -> None:
    pytest.importorskip("torch")
    f = mlp("torch", mlp_weights(SIZES, seed=16))
    x = rng(17).normal(size=(6, 8))
    with pytest.raises(batchjac.InputError, match="`diagonal=True` and `laplacian=True`"):
        batchjac.hessian(f, x, diagonal=True, laplacian=True)
    with pytest.raises(batchjac.InputError, match=r"`mode` of a second-order call.*'reverse'"):
        batchjac.hessian(f, x, mode="reverse")  # type: ignore[arg-type]
    with pytest.raises(batchjac.InputError, match=r"`v` has shape \(6, 3\).*\(6, 8\)"):
        batchjac.hvp(f, x, v=np.ones((6, 3)))
    with pytest.raises(batchjac.InputError, match="needs the tangents `v`"):
        batchjac.hvp(f, x, v=None)
    with pytest.raises(batchjac.InputError, match=r"`out` has shape \(6, 4, 8\).*\(6, 4, 8, 8\)"):
        batchjac.hessian(f, x, out=np.empty((6, 4, 8)))
    with pytest.raises(batchjac.InputError, match="`chunk_size` must be a positive integer"):
        batchjac.hessian(f, x, chunk_size=0)
    bad = x.copy()
    bad[2, 1] = np.nan
    with pytest.raises(batchjac.InputError, match="non-finite value"):
        batchjac.hvp(f, x, v=bad)


def test_closed_form_models_are_refused_clearly() -> None:
    model = batchjac.ClosedForm(lambda x: x**2, lambda x: np.stack([np.diag(2 * r) for r in x]))
    with pytest.raises(batchjac.InputError, match="does not compute second derivatives"):
        batchjac.hessian(model, rng(18).normal(size=(4, 3)))


def test_no_rows() -> None:
    pytest.importorskip("torch")
    f = mlp("torch", mlp_weights(SIZES, seed=19))
    out = batchjac.hessian(f, np.empty((0, 8)), laplacian=True)
    assert out.shape == (0, 4)


# -- stores ------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".npy", ".zarr", ".h5"])
def test_store_resumes_after_an_interruption(tmp_path: Any, suffix: str) -> None:
    """A call killed by a failing chunk leaves its finished chunks; made again, it computes
    only the others, and the store holds what the in-memory call returns (Hessians,
    Jacobians and outputs), bit for bit."""
    pytest.importorskip("torch")
    if suffix == ".zarr":
        pytest.importorskip("zarr")
    if suffix == ".h5":
        pytest.importorskip("h5py")
    f = mlp("torch", mlp_weights(SIZES, seed=20))
    x = rng(21).normal(size=(300, 8))  # 5 chunks of 64
    state = {"calls": 0, "fail_at": 3}

    def model(z: Any) -> Any:
        if z.shape[0] == 64:
            state["calls"] += 1
            if state["calls"] == state["fail_at"]:
                raise RuntimeError("interrupted")
        return f(z)

    store = batchjac.Store(tmp_path / f"hess{suffix}", model_id="mlp-20")
    kw: dict[str, Any] = {"wrt": [0, 3, 5], "chunk_size": 64, "return_outputs": True,
                          "return_jacobian": True}
    with pytest.raises(batchjac.ModelError, match="interrupted"):
        batchjac.hessian(model, x, out=store, **kw)
    assert not (tmp_path / f"hess{suffix}").exists()
    state["fail_at"] = -1
    result = batchjac.hessian(model, x, out=store, **kw)
    assert (result.resumed_chunks, result.computed_chunks) == (2, 3)
    assert result.shape == (300, 4, 3, 3)
    assert result.mode == "forward-over-forward"  # 3 unknowns < 4 outputs
    y, jac, hess = batchjac.hessian(f, x, **kw)
    assert np.array_equal(np.asarray(result.open()), hess)
    assert np.array_equal(np.asarray(result.open("jacobians")), jac)
    assert np.array_equal(np.asarray(result.open("outputs")), y)
    again = batchjac.hessian(model, x, out=store, **kw)  # finished: nothing computed
    assert again.computed_chunks == 0
    with pytest.raises(batchjac.StoreExistsError):  # another kind of result, same path: refused
        batchjac.laplacian(model, x, out=store, wrt=[0, 3, 5], chunk_size=64)


def test_hvp_store_hashes_the_tangents(tmp_path: Any) -> None:
    pytest.importorskip("torch")
    f = mlp("torch", mlp_weights(SIZES, seed=22))
    r = rng(23)
    x, v = r.normal(size=(40, 8)), r.normal(size=(40, 8))
    store = batchjac.Store(tmp_path / "hvp.zarr", model_id="mlp-22")
    pytest.importorskip("zarr")
    result = batchjac.hvp(f, x, v=v, out=store, chunk_size=16)
    want = np.einsum("naij,nj->nai", native_hessian("torch", f, x), v)
    assert_jac_close(np.asarray(result.open()), want, factor=0.1)
    with pytest.raises(batchjac.StoreMismatchError, match="input rows differ"):
        batchjac.hvp(f, x, v=v * 2, out=store, chunk_size=16)


# -- check_hessian -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
def test_check_hessian_passes_and_catches_a_wrong_hessian(name: str, monkeypatch: Any) -> None:
    layers = mlp_weights(SIZES, seed=24)
    r = rng(25)
    unknown, known = r.normal(size=(30, 5)).astype("f4"), r.normal(size=(30, 3)).astype("f4")
    with framework(name):
        f = mlp(name, layers)
        if name == "torch":

            model: Any = lambda z: f(z.double()).float()  # noqa: E731
        elif name == "jax":
            model = lambda z: f(z.astype("float64")).astype("float32")  # noqa: E731
        else:
            import tensorflow as tf

            model = lambda z: tf.cast(f(tf.cast(z, tf.float64)), tf.float32)  # noqa: E731
        report = batchjac.check_hessian(model, unknown, known, sample=12, backend=name)
        assert report.passed, str(report)
        assert report.max_rel_error.shape == (12,)
        assert report.compute_dtype == "float32"
        assert 0 < report.max_error < report.rtol
        # a Hessian off by 1% in one entry of one instance fails that instance only
        import batchjac._check_hessian as ch

        real = ch._compute

        def wrong(*args: Any, **kwargs: Any) -> np.ndarray:
            h = np.array(real(*args, **kwargs))
            h[3, 0, 1, 2] += 0.01 * np.abs(h[3]).max()
            return h

        monkeypatch.setattr(ch, "_compute", wrong)
        bad = batchjac.check_hessian(model, unknown, known, sample=12, backend=name)
    assert not bad.passed
    assert list(bad.failed) == [int(bad.instances[3])]
    assert "FAILED" in str(bad)


def test_dask_arrays_give_a_lazy_result() -> None:
    pytest.importorskip("torch")
    da = pytest.importorskip("dask.array")
    f = mlp("torch", mlp_weights(SIZES, seed=26))
    x = rng(27).normal(size=(50, 8))
    lazy = batchjac.hessian(f, da.from_array(x, chunks=20), wrt=[0, 1, 2], return_outputs=True)
    y, hess = lazy
    assert hess.chunks[0] == (20, 20, 10)
    want_y, want = batchjac.hessian(f, x, wrt=[0, 1, 2], return_outputs=True)
    np.testing.assert_allclose(hess.compute(), want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(y.compute(), want_y, rtol=1e-12, atol=1e-14)
    lap = batchjac.laplacian(f, da.from_array(x, chunks=25))
    np.testing.assert_allclose(lap.compute(), batchjac.laplacian(f, x), rtol=1e-12, atol=1e-14)
    y, jac, hess = batchjac.hessian(f, da.from_array(x, chunks=25), wrt=[0, 1, 2],
                                    return_outputs=True, return_jacobian=True)  # lazy, all three
    want_y, want_j, want = batchjac.hessian(f, x, wrt=[0, 1, 2], return_outputs=True,
                                            return_jacobian=True)
    assert jac.chunks[0] == (25, 25)
    for got, ref in ((y, want_y), (jac, want_j), (hess, want)):
        np.testing.assert_allclose(got.compute(), ref, rtol=1e-12, atol=1e-14)
    with pytest.raises(batchjac.InputError, match="an `out=` array is not supported there"):
        batchjac.hessian(f, da.from_array(x, chunks=25), out=np.empty((50, 4, 8, 8)))


@pytest.mark.parametrize(("sizes", "first_build"), [
    ((8, 64, 64, 4), "a forward Hessian (one pass)"),  # 8 unknowns, 4 outputs: k <= 8 m
    ((12, 16, 1), "nested batch_jacobian tapes"),  # 12 unknowns, one output: k > 8 m
    ((40, 16, 3), "graph ("),  # 40 unknowns, 3 outputs: k > 8 m, the tiled graph
])
def test_tensorflow_builds_race_only_when_the_work_repays_it(
        monkeypatch: Any, sizes: tuple[int, ...], first_build: str) -> None:
    """A first small call runs one build untimed, the cost model's: the forward Hessian for
    at most 8 unknowns an output, else the tapes (one output) or the tiled graph; once the
    tuning policy says a race pays, every build is timed and the fastest kept, with the same
    values, which are float64 central differences of the closed-form Jacobian."""
    pytest.importorskip("tensorflow")
    from batchjac import _backends
    from batchjac._backends.tensorflow import TFSecondKernel

    from .helpers import race_now

    w = mlp_weights(sizes, seed=28)
    f = mlp("tensorflow", w)
    x = rng(29).normal(size=(20, sizes[0]))
    first = batchjac.hessian(f, x, backend="tensorflow")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        batchjac.hessian(f, x, backend="tensorflow", explain=True, chunk_size=24)
    assert first_build in err.getvalue(), err.getvalue()
    assert "not timed" in err.getvalue()
    k, m = sizes[0], sizes[-1]
    (bound,) = _backends._bound[f].values()
    assert TFSecondKernel.forward_hessian_first(bound) == (k <= 8 * m)
    race_now(monkeypatch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        raced = batchjac.hessian(f, x, backend="tensorflow", explain=True, chunk_size=28)
    assert "timed one chunk: graph" in err.getvalue()
    assert "forward-hessian" in err.getvalue()
    np.testing.assert_allclose(raced, first, rtol=1e-10, atol=1e-12)
    ref = central_differences(lambda z: mlp_jacobian(w, z), x)
    np.testing.assert_allclose(first, ref, rtol=1e-6, atol=1e-8)


def test_a_later_process_loads_the_compiled_jax_hessian_kernel(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second-order JAX kernel's executable is remembered on disk as the first-order
    one's: a later process traces it and loads it (no XLA compilation) and gets the same
    Hessians, which match float64 central differences of the closed-form Jacobian."""

    pytest.importorskip("jax")
    from batchjac._backends.jax import executables as jax_executables
    from batchjac._examples import jax as jax_examples

    monkeypatch.setenv("BATCHJAC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jax_executables, "MIN_COMPILE_SECONDS", 0.0)
    sizes = (4, 9, 2)
    x = rng(43).standard_normal((30, 4)).astype("float32")
    got = np.asarray(batchjac.hessian(jax_examples.mlp(sizes, seed=8), x))
    jax_executables.flush()
    w = mlp_weights(sizes, 8)
    ref = central_differences(lambda z: mlp_jacobian(w, z), x.astype(np.float64))
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-4)
    np.save(tmp_path / "x.npy", x)
    code = f"""
        import numpy as np, batchjac
        from batchjac import _backends
        from batchjac._examples import jax as jax_examples
        model = jax_examples.mlp({sizes}, seed=8)
        h = batchjac.hessian(model, np.load({str(tmp_path / 'x.npy')!r}))
        np.save({str(tmp_path / 'h.npy')!r}, h)
        (bound,) = _backends._bound[model].values()
        print("COMPILES", bound.compile_count)
    """
    stdout = run_in_fresh_process(code)
    assert "COMPILES 0" in stdout
    np.testing.assert_array_equal(np.load(tmp_path / "h.npy"), got)


def test_tensorflow_one_output_takes_the_forward_hessian_then_the_nested_tapes(
        monkeypatch: Any) -> None:
    """One output (a PINN's u): the untimed first call computes the Hessian by the forward
    Hessian (one pass of the rule set), and where it cannot by nested ``batch_jacobian`` tapes
    (the tiled builds repeat the forward and reverse pass once per unknown there), the
    diagonal by the tapes; the Hessian, its diagonal and the Laplacian equal float64 central
    differences of the analytic Jacobian; where neither can be built (no rule, pfor fails)
    the tiled graph gives the same values and says why; a race times all four builds."""
    pytest.importorskip("tensorflow")
    from batchjac._backends import tensorflow as tfb

    from .helpers import race_now

    layers = mlp_weights((3, 16, 16, 1), seed=31)
    x = rng(32).normal(size=(23, 3))
    want = central_differences(lambda u: mlp_jacobian(layers, u), x)  # (23, 1, 3, 3)
    want_diag = np.diagonal(want, axis1=-2, axis2=-1)

    def computed(f: Any, **options: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            hess = batchjac.hessian(f, x, backend="tensorflow", explain=True, **options)
            diag = batchjac.hessian(f, x, diagonal=True, backend="tensorflow", **options)
            lap = batchjac.laplacian(f, x, backend="tensorflow", **options)
        return hess, diag, lap, err.getvalue()

    def close(hess: np.ndarray, diag: np.ndarray, lap: np.ndarray) -> None:
        scale = np.abs(want).max()
        assert np.abs(hess - want).max() / scale < 1e-7
        assert np.abs(diag - want_diag).max() / scale < 1e-7
        assert np.abs(lap - want_diag.sum(-1)).max() / scale < 1e-7

    f = mlp("tensorflow", layers)
    hess, diag, lap, said = computed(f)
    assert hess.shape == (23, 1, 3, 3)
    assert "forward-hessian (" in said, said
    assert "a forward Hessian (one pass)" in said, said
    close(hess, diag, lap)

    def no_rule(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("no forward-Laplacian rule for the operation FakeOp")

    with monkeypatch.context() as patched:
        patched.setattr(tfb.TFSecondKernel, "_forward_rules", no_rule)
        hess, diag, lap, said = computed(f, chunk_size=26)  # a new kernel
    assert "tapes (" in said, said
    assert "nested batch_jacobian tapes" in said, said
    assert "forward Hessian failed: no forward-Laplacian rule for the operation FakeOp" in said
    close(hess, diag, lap)

    def no_pfor(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("pfor could not vectorize the op FakeOp")

    with monkeypatch.context() as patched:
        patched.setattr(tfb.TFSecondKernel, "_nested_tapes", no_pfor)
        patched.setattr(tfb.TFSecondKernel, "_forward_rules", no_rule)
        hess, diag, lap, said = computed(f, chunk_size=25)  # a new kernel
    assert "graph (" in said, said
    assert "nested tapes failed: pfor could not vectorize" in said, said
    close(hess, diag, lap)

    race_now(monkeypatch)
    hess, diag, lap, said = computed(f, chunk_size=24)
    assert "timed one chunk: graph" in said, said
    assert "xla" in said, said
    assert "tapes " in said, said
    assert "forward-hessian " in said, said
    close(hess, diag, lap)


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_chunk_sizes_are_timed_where_the_work_repays_it(name: str, monkeypatch: Any) -> None:
    """The Jacobian's ladder of chunk sizes, on this call's second-order kernels: untimed on
    a first call, raced on the next calls (the sizes in the plan's reason) once the tuning
    policy says it pays, with the closed form's values on every call; never with an explicit
    chunk_size."""
    from .helpers import race_now

    x = rng(33).normal(size=(2048, 3)) * 2
    want = -np.sin(x).sum(-1)
    with framework(name) as fw:
        sin = fw.sin if name == "torch" else fw.numpy.sin
        f = lambda z: sin(z).sum(-1)  # noqa: E731
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            first = batchjac.laplacian(f, x, backend=name, explain=True)
        assert "rows (timed per row" not in err.getvalue()
        assert "kept after timing" not in err.getvalue()
        race_now(monkeypatch)
        said, laps = [], [first]
        for _ in range(30):  # the ladder races on the calls: each one's result is kept
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                laps.append(batchjac.laplacian(f, x, backend=name, explain=True))
            said.append(err.getvalue().splitlines()[0])
            if "racing chunk sizes" not in said[-1] and any("racing" in line for line in said):
                break  # (it starts once the planned size's kernel has settled its build)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            laps.append(batchjac.laplacian(f, x, backend=name, explain=True, chunk_size=2048))
        fixed = err.getvalue()
    assert "racing chunk sizes" in said[-2], said
    assert "chunks of 512 rows" in "".join(said), said
    timed = ("rows (timed per row: 2048 rows", "; kept after timing 2048 rows")
    assert any(t in said[-1] for t in timed), said
    assert not any(t in fixed for t in timed), fixed
    assert "racing" not in fixed, fixed
    for lap in laps:
        assert_jac_close(lap, want, factor=0.1)


def test_hvp_without_a_cluster_computes_locally() -> None:
    """client=None and scheduler=None are the local path (the Dask path: tests/test_dask.py);
    rows_per_task alone changes nothing, as for jacobian."""
    torch = pytest.importorskip("torch")
    x = rng(47).standard_normal((6, 3))
    v = rng(48).standard_normal((6, 3))
    got = batchjac.hvp(lambda z: torch.sin(z).sum(-1), x, v=v, client=None, scheduler=None,
                       rows_per_task=2)
    np.testing.assert_allclose(got, -np.sin(x) * v, rtol=1e-10, atol=1e-12)


def test_jax_probes_run_beside_the_first_hessian_kernel_and_still_refuse_a_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A JAX Hessian's first call probes the model in the probes' thread while its kernel
    compiles (as jacobian's does: W6's first call waited 10 ms of 250 for them before); what
    they find still refuses the model: rows that interact raise, and no result comes back."""
    import threading

    jnp = pytest.importorskip("jax.numpy")
    from batchjac import _bind

    where: list[str] = []
    original = _bind.run_probes
    monkeypatch.setattr(_bind, "run_probes", lambda *a, **k: where.append(
        threading.current_thread().name) or original(*a, **k))
    a = rng(1610).normal(size=(3, 4)).astype(np.float32)
    x = rng(1611).normal(size=(7, 3)).astype(np.float32)
    hess = batchjac.hessian(lambda z: jnp.sin(z @ jnp.asarray(a)), x)
    assert len(where) == 1, where
    assert where[0].startswith("batchjac-probes"), where
    s = np.sin(x @ a)  # d2 sin(x a)_o / dx_i dx_j = -sin(.)_o a_io a_jo
    np.testing.assert_allclose(hess, -s[:, :, None, None] * np.einsum("io,jo->oij", a, a)[None],
                               rtol=2e-4, atol=1e-5)
    with pytest.raises(batchjac.RowInteractionError):
        batchjac.hessian(lambda z: jnp.sin((z - z.mean(0)) @ jnp.asarray(a)), x)
    assert len(where) == 2, where
    assert where[1].startswith("batchjac-probes"), where
