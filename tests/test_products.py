"""Products that never form J (issue 38): ``jvp``, ``vjp`` and ``divergence`` in TensorFlow,
PyTorch and JAX, against two independent references each: the product computed from
batchjac's own per-instance Jacobians in float64, and the framework's own composition
(``jax.vmap`` of ``jax.jvp``/``jax.vjp``, ``torch.func``'s, TensorFlow's forward accumulator and
tape); one and several directions per instance, known inputs, ``wrt`` columns, rank-1 outputs;
Hutchinson's divergence unbiased with standard errors that cover the exact value at the stated
rate; bad directions refused by name."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import rng

FRAMEWORKS = ["jax", "torch", "tensorflow"]


def _mlp(framework: str, sizes: tuple[int, ...], seed: int) -> tuple[Any, list[np.ndarray]]:
    """A tanh MLP of the framework (a batch function) and its weights."""
    g = rng(seed)
    ws = [g.normal(size=(a, b)) / np.sqrt(a) for a, b in itertools.pairwise(sizes)]
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy")

        def f(x: Any) -> Any:
            for i, w in enumerate(ws):
                x = x @ jnp.asarray(w, x.dtype)
                x = jnp.tanh(x) if i < len(ws) - 1 else x
            return x
    elif framework == "torch":
        torch = pytest.importorskip("torch")

        def f(x: Any) -> Any:
            for i, w in enumerate(ws):
                x = x @ torch.as_tensor(w, dtype=x.dtype)
                x = torch.tanh(x) if i < len(ws) - 1 else x
            return x
    else:
        tf = pytest.importorskip("tensorflow")

        def f(x: Any) -> Any:
            for i, w in enumerate(ws):
                x = tf.matmul(x, tf.constant(w, x.dtype))
                x = tf.tanh(x) if i < len(ws) - 1 else x
            return x
    return f, ws


def _jacobians(ws: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The float64 closed form of the MLP's per-instance Jacobians, (N, m, k)."""
    a = x.astype(np.float64)
    jac = np.broadcast_to(np.eye(a.shape[1]), (len(a), a.shape[1], a.shape[1]))
    for i, w in enumerate(ws):
        a = a @ w
        jac = np.einsum("nik,ij->njk", jac, w)
        if i < len(ws) - 1:
            jac = jac * (1 - np.tanh(a) ** 2)[:, :, None]
            a = np.tanh(a)
    return jac


def _native_products(framework: str, f: Any, x: np.ndarray, v: np.ndarray, c: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The framework's own per-instance J v and c^T J (one direction each)."""
    if framework == "jax":
        import jax

        one = lambda r: f(r[None])[0]  # noqa: E731
        jv = jax.vmap(lambda r, t: jax.jvp(one, (r,), (t,))[1])(x, v)
        cj = jax.vmap(lambda r, s: jax.vjp(one, r)[1](s)[0])(x, c)
        return np.asarray(jv), np.asarray(cj)
    if framework == "torch":
        import torch

        one = lambda r: f(r[None])[0]  # noqa: E731
        xt, vt, ct = (torch.from_numpy(a) for a in (x, v, c))
        jv = torch.func.vmap(lambda r, t: torch.func.jvp(one, (r,), (t,))[1])(xt, vt)
        cj = torch.func.vmap(lambda r, s: torch.func.vjp(one, r)[1](s)[0])(xt, ct)
        return jv.numpy(), cj.numpy()
    import tensorflow as tf

    xt = tf.constant(x)
    with tf.autodiff.ForwardAccumulator(xt, tf.constant(v)) as acc:
        y = f(xt)
    jv = acc.jvp(y)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = f(xt)
    return jv.numpy(), tape.gradient(y, xt, output_gradients=tf.constant(c)).numpy()


def _close(got: Any, want: np.ndarray, rtol: float = 1e-5) -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = float(np.abs(want).max())
    assert scale > 0
    assert float(np.abs(got - want).max()) <= rtol * scale, float(np.abs(got - want).max()) / scale


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_jvp_and_vjp_equal_both_references(framework: str) -> None:
    f, ws = _mlp(framework, (6, 16, 4), seed=3810)
    g = rng(3811)
    x = g.normal(size=(23, 6)).astype(np.float32)
    v, c = g.normal(size=(23, 6)).astype(np.float32), g.normal(size=(23, 4)).astype(np.float32)
    jac = _jacobians(ws, x)
    jv, cj = batchjac.jvp(f, x, tangents=v), batchjac.vjp(f, x, cotangents=c)
    _close(jv, np.einsum("nmk,nk->nm", jac, v))
    _close(cj, np.einsum("nm,nmk->nk", c, jac))
    native_jv, native_cj = _native_products(framework, f, x, v, c)
    _close(jv, native_jv.astype(np.float64))
    _close(cj, native_cj.astype(np.float64))
    # several directions per instance; the outputs of the same pass; small blocks
    vs, cs = g.normal(size=(23, 3, 6)).astype(np.float32), g.normal(size=(23, 5, 4))
    y, jvs = batchjac.jvp(f, x, tangents=vs, return_outputs=True, chunk_size=7)
    _close(jvs, np.einsum("nmk,ndk->ndm", jac, vs))
    _close(y, np.tanh(x.astype(np.float64) @ ws[0]) @ ws[1])  # (the model's outputs)
    _close(batchjac.vjp(f, x, cotangents=cs.astype(np.float32), chunk_size=5),
           np.einsum("ndm,nmk->ndk", cs, jac))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_known_inputs_wrt_and_a_rank_1_output(framework: str) -> None:
    f, ws = _mlp(framework, (5, 8, 1), seed=3812)
    g = rng(3813)
    x = g.normal(size=(17, 5)).astype(np.float32)
    jac = _jacobians(ws, x)  # (17, 1, 5)
    v = g.normal(size=(17, 3)).astype(np.float32)
    _close(batchjac.jvp(f, x[:, :3], x[:, 3:], tangents=v),
           np.einsum("nmk,nk->nm", jac[:, :, :3], v))
    c = g.normal(size=(17, 1)).astype(np.float32)
    _close(batchjac.vjp(f, x, wrt=[1, 4], cotangents=c),
           np.einsum("nm,nmk->nk", c, jac[:, :, [1, 4]]))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_divergence_exact_and_hutchinson(framework: str) -> None:
    f, ws = _mlp(framework, (6, 32, 6), seed=3814)
    x = rng(3815).normal(size=(40, 6)).astype(np.float32)
    exact = np.trace(_jacobians(ws, x), axis1=1, axis2=2)
    _close(batchjac.divergence(f, x, chunk_size=16), exact)
    est = batchjac.divergence(f, x, estimator="hutchinson", samples=64, seed=7)
    assert isinstance(est, batchjac.TraceEstimate)
    value, stderr = np.asarray(est.value), np.asarray(est.stderr)
    assert value.shape == stderr.shape == (40,)
    assert np.all(stderr > 0)
    # unbiased: the standard errors cover the exact traces at about the normal rate
    z = (value - exact) / stderr
    assert np.mean(np.abs(z) < 2.5) >= 0.85, z
    assert abs(float(np.mean(z))) < 4 / np.sqrt(len(z)), z  # no bias beyond noise
    again = batchjac.divergence(f, x, estimator="hutchinson", samples=64, seed=7, chunk_size=9)
    np.testing.assert_allclose(np.asarray(again.value), value, rtol=1e-5)  # (blocks apart)


def test_directions_of_the_wrong_shape_are_refused_by_name() -> None:
    f, _ = _mlp("jax", (4, 8, 3), seed=3816)
    x = rng(3817).normal(size=(10, 4)).astype(np.float32)
    with pytest.raises(batchjac.InputError, match=r"`tangents` has shape \(10, 3\).*\(10, 4\)"):
        batchjac.jvp(f, x, tangents=np.ones((10, 3)))
    with pytest.raises(batchjac.InputError, match=r"`cotangents` has shape \(9, 3\)"):
        batchjac.vjp(f, x, cotangents=np.ones((9, 3)))
    with pytest.raises(batchjac.InputError, match=r"\(10, 0, 4\).*d >= 1 directions"):
        batchjac.jvp(f, x, tangents=np.ones((10, 0, 4)))
    t = np.ones((10, 4))
    t[2, 1] = np.nan
    with pytest.raises(batchjac.InputError, match=r"`tangents` has a NaN or Inf in row 2"):
        batchjac.jvp(f, x, tangents=t)
    with pytest.raises(batchjac.InputError, match=r"divergence\(\) needs a square Jacobian"):
        batchjac.divergence(f, x)
    with pytest.raises(batchjac.InputError, match=r"`estimator` of divergence\(\) must be None"):
        batchjac.divergence(f, x[:, :3], estimator="hutchpp")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        batchjac.jvp(f, x)  # type: ignore[call-arg]


def test_torch_tensors_in_and_out_and_a_model_without_forward_derivatives() -> None:
    """Tensors in, tensors out; a torch LSTM (no forward derivative on the CPU) pushes its
    tangents through plain autograd's double backward."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(3818)
    cell, head = torch.nn.LSTM(3, 6, batch_first=True), torch.nn.Linear(6, 2)

    def f(x: Any) -> Any:
        out, _ = cell(x.reshape(x.shape[0], 4, 3))
        return head(out[:, -1])

    x = torch.from_numpy(rng(3819).normal(size=(9, 12)).astype(np.float32))
    v = torch.from_numpy(rng(3820).normal(size=(9, 12)).astype(np.float32))
    got = batchjac.jvp(f, x, tangents=v)
    assert isinstance(got, torch.Tensor)
    jac = torch.stack([torch.autograd.functional.jacobian(lambda r: f(r[None])[0], r)
                       for r in x])
    _close(got.numpy(), np.einsum("nmk,nk->nm", jac.double().numpy(), v.double().numpy()))


@pytest.mark.parametrize("suffix", [".npy", ".zarr", ".h5"])
def test_products_into_a_store_resume_byte_identical(tmp_path: Any, suffix: str) -> None:
    """jvp and vjp into a store: killed by a failing chunk, made again, only the others are
    computed, and the store holds what the in-memory call returns, bit for bit."""
    if suffix == ".zarr":
        pytest.importorskip("zarr")
    if suffix == ".h5":
        pytest.importorskip("h5py")
    f, ws = _mlp("jax", (6, 16, 4), seed=3821)
    g = rng(3822)
    x = g.normal(size=(50, 6)).astype(np.float32)
    v = g.normal(size=(50, 2, 6)).astype(np.float32)
    state = {"calls": 0, "fail_at": 3}

    def model(z: Any) -> Any:
        if z.shape[0] == 16:  # a chunk of the store's (not the probes')
            state["calls"] += 1
            if state["calls"] == state["fail_at"]:
                raise RuntimeError("interrupted")
        return f(z)

    path = tmp_path / f"jvps{suffix}"
    store = batchjac.Store(path, model_id="mlp-3821")  # (the closure's counter is not the model)
    with pytest.raises(batchjac.ModelError, match="interrupted"):
        batchjac.jvp(model, x, tangents=v, out=store, chunk_size=16, return_outputs=True)
    assert not path.exists()
    state["fail_at"] = -1
    res = batchjac.jvp(model, x, tangents=v, out=store, chunk_size=16, return_outputs=True)
    assert (res.resumed_chunks, res.computed_chunks) == (2, 2)
    assert res.shape == (50, 2, 4)
    y, want = batchjac.jvp(f, x, tangents=v, chunk_size=16, return_outputs=True)
    assert np.array_equal(np.asarray(res.open()), want)
    assert np.array_equal(np.asarray(res.open("outputs")), y)
    _close(np.asarray(res.open()), np.einsum("nmk,ndk->ndm", _jacobians(ws, x), v))
    again = batchjac.jvp(model, x, tangents=v, out=store, chunk_size=16, return_outputs=True)
    assert again.computed_chunks == 0
    other = v.copy()
    other[40, 0, 0] += 1.0  # other directions: the finished store's rows no longer match
    with pytest.raises(batchjac.StoreError):
        batchjac.jvp(model, x, tangents=other, out=store, chunk_size=16, return_outputs=True)
    c = g.normal(size=(50, 4)).astype(np.float32)
    stored = batchjac.vjp(f, x, cotangents=c, out=str(tmp_path / f"vjps{suffix}"), chunk_size=20)
    assert np.array_equal(np.asarray(stored.open()), batchjac.vjp(f, x, cotangents=c,
                                                                  chunk_size=20))


@pytest.mark.parametrize("estimator", [None, "hutchinson", "hutch++"])
def test_the_divergence_into_a_store_resumes_byte_identical(tmp_path: Any, estimator: Any) -> None:
    """The divergence, exact or estimated, into a store: stopped after two chunks (its
    progress callback raises), made again, only the others computed, the store equal to the
    in-memory call bit for bit (an estimate as (N, 2): each value and its standard error);
    another seed is another job."""
    pytest.importorskip("zarr")
    f, ws = _mlp("jax", (6, 16, 6), seed=3831)
    x = rng(3832).normal(size=(50, 6)).astype(np.float32)
    seen: list[int] = []

    def stop(rows: int) -> None:
        seen.append(rows)
        if len(seen) == 2:
            raise KeyboardInterrupt

    kw: dict[str, Any] = {} if estimator is None else {"estimator": estimator, "samples": 9,
                                                       "seed": 4}
    store = batchjac.Store(tmp_path / "div.zarr", model_id="mlp-3831")
    with pytest.raises(KeyboardInterrupt):
        batchjac.divergence(f, x, out=store, chunk_size=16, progress=stop, **kw)
    res = batchjac.divergence(f, x, out=store, chunk_size=16, **kw)
    assert (res.resumed_chunks, res.computed_chunks) == (2, 2)
    want = batchjac.divergence(f, x, chunk_size=16, **kw)
    got = np.asarray(res.open())
    exact = np.trace(_jacobians(ws, x), axis1=1, axis2=2)
    if estimator is None:
        assert got.shape == (50,)
        assert np.array_equal(got, np.asarray(want))
        _close(got, exact)
    else:
        assert got.shape == (50, 2)
        assert np.array_equal(got[:, 0], np.asarray(want.value))
        assert np.array_equal(got[:, 1], np.asarray(want.stderr))
        with pytest.raises(batchjac.StoreError):
            batchjac.divergence(f, x, out=store, chunk_size=16, **{**kw, "seed": 5})


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_many_directions_go_through_the_jacobians_with_the_same_products(framework: str) -> None:
    """Directions that outnumber min(k, m) FORM_J times: each chunk's Jacobians are formed (in
    the cheaper mode) and multiplied; the products equal the float64 closed form's, as the
    direct ones do, in memory and into a store."""
    from batchjac._products import FORM_J, via_jacobian

    f, ws = _mlp(framework, (6, 12, 3), seed=3841)
    g = rng(3842)
    x = g.normal(size=(30, 6)).astype(np.float32)
    d = FORM_J * 3
    assert via_jacobian("vjp", d, 6, 3) == "reverse"
    assert via_jacobian("jvp", d, 6, 3) == "reverse"
    assert via_jacobian("jvp", d - 1, 6, 3) is None
    jac = _jacobians(ws, x)
    v = g.normal(size=(30, d, 6)).astype(np.float32)
    c = g.normal(size=(30, d, 3)).astype(np.float32)
    _close(batchjac.jvp(f, x, tangents=v, chunk_size=16), np.einsum("nmk,ndk->ndm", jac, v))
    _close(batchjac.vjp(f, x, cotangents=c, chunk_size=16), np.einsum("nmk,ndm->ndk", jac, c))
    few = v[:, :2]  # (directly: below the line)
    _close(batchjac.jvp(f, x, tangents=few), np.einsum("nmk,ndk->ndm", jac, few))


def test_many_directions_into_a_store_record_the_route(tmp_path: Any) -> None:
    """A store's products take the route its plan records (each chunk's Jacobians, then the
    products): the same bytes as the in-memory call, which takes it too."""
    pytest.importorskip("zarr")
    f, ws = _mlp("jax", (6, 12, 3), seed=3843)
    g = rng(3844)
    x = g.normal(size=(30, 6)).astype(np.float32)
    c = g.normal(size=(30, 12, 3)).astype(np.float32)
    res = batchjac.vjp(f, x, cotangents=c, out=str(tmp_path / "v.zarr"), chunk_size=16)
    assert res.mode == "reverse"
    assert np.array_equal(np.asarray(res.open()), batchjac.vjp(f, x, cotangents=c, chunk_size=16))
    _close(np.asarray(res.open()), np.einsum("nmk,ndm->ndk", _jacobians(ws, x), c))


def test_directions_on_disk_are_read_a_chunk_at_a_time(tmp_path: Any) -> None:
    """Tangents in an ``np.memmap`` or a file path stay on disk: the products equal those of the
    same directions in memory, one and several per instance, into memory and into a store; a
    NaN in a later chunk's rows is refused by name and row when that chunk is read; a file of
    the wrong shape is refused before anything is computed."""
    pytest.importorskip("zarr")
    f, ws = _mlp("jax", (5, 12, 3), seed=3851)
    g = rng(3852)
    x = g.normal(size=(40, 5)).astype(np.float32)
    jac = _jacobians(ws, x)
    for shape in [(40, 5), (40, 3, 5)]:
        v = g.normal(size=shape).astype(np.float32)
        np.save(tmp_path / "v.npy", v)
        mm = np.load(tmp_path / "v.npy", mmap_mode="r")
        want = batchjac.jvp(f, x, tangents=v, chunk_size=16)
        assert np.array_equal(batchjac.jvp(f, x, tangents=mm, chunk_size=16), want)
        assert np.array_equal(batchjac.jvp(f, x, tangents=str(tmp_path / "v.npy"), chunk_size=16),
                              want)
        flat = v.reshape(40, -1, 5)
        _close(want.reshape(40, -1, 3), np.einsum("nmk,ndk->ndm", jac, flat))
        stored = batchjac.jvp(f, x, tangents=mm, chunk_size=16,
                              out=str(tmp_path / f"j{len(shape)}.zarr"))
        assert np.array_equal(np.asarray(stored.open()), want)
    c = g.normal(size=(40, 3)).astype(np.float32)
    c[35, 1] = np.nan  # in the third chunk of 16 rows
    np.save(tmp_path / "c.npy", c)
    with pytest.raises(batchjac.InputError, match=r"`cotangents` has a NaN or Inf in row 35"):
        batchjac.vjp(f, x, cotangents=np.load(tmp_path / "c.npy", mmap_mode="r"), chunk_size=16)
    np.save(tmp_path / "bad.npy", c[:, :2])
    with pytest.raises(batchjac.InputError, match=r"`cotangents` has shape \(40, 2\)"):
        batchjac.vjp(f, x, cotangents=str(tmp_path / "bad.npy"))
