"""Randomized traces and diagonals (issue 38): Hutchinson's and Hutch++'s divergence and
Laplacian, and the Hessian's diagonal, in JAX, PyTorch and TensorFlow, against closed forms and
batchjac's exact results: unbiased (the standard errors cover the exact values at about the
normal rate, the mean z-score within noise, fixed seeds), Hutch++ exact where the matrix's rank
fits its sketch, the same estimate in any chunking, bad arguments refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import rng

FRAMEWORKS = ["jax", "torch", "tensorflow"]


def _ops(framework: str) -> Any:
    """(sin, tanh, matmul, sum over the last axis, stack on the last axis, as_const) of the
    framework."""
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return (jnp.sin, jnp.tanh, lambda a, w: a @ jnp.asarray(w, a.dtype),
                lambda a: a.sum(-1), lambda xs: jnp.stack(xs, -1))
    if framework == "torch":
        torch = pytest.importorskip("torch")
        return (torch.sin, torch.tanh, lambda a, w: a @ torch.as_tensor(w, dtype=a.dtype),
                lambda a: a.sum(-1), lambda xs: torch.stack(xs, -1))
    tf = pytest.importorskip("tensorflow")
    return (tf.sin, tf.tanh, lambda a, w: tf.matmul(a, tf.constant(w, a.dtype)),
            lambda a: tf.reduce_sum(a, -1), lambda xs: tf.stack(xs, -1))


def _coverage(value: Any, stderr: Any, exact: np.ndarray) -> None:
    """Unbiased at the stated error: |z| < 2.5 for most instances, the mean z near 0."""
    value, stderr = np.asarray(value, np.float64), np.asarray(stderr, np.float64)
    assert value.shape == stderr.shape == exact.shape
    assert np.all(stderr > 0)
    floor = 1e-5 * np.abs(exact).max()  # (float32 products: where the estimate is near exact)
    z = ((value - exact) / (stderr + floor)).ravel()
    assert np.mean(np.abs(z) < 2.5) >= 0.85, z
    assert abs(float(np.mean(z))) < 4 / np.sqrt(z.size), z


W1 = rng(3900).normal(size=(24, 16)) / 4
W2 = rng(3899).normal(size=(24, 24)) / 4


def _two_outputs(framework: str, k: int = 24) -> Any:
    """x (N, k) -> (sum sin(x W1), sum (x W2)^3 / 3): Hessians W1 diag(-sin s1) W1^T and
    W2 diag(2 s2) W2^T, full (a diagonal Hessian would give Rademacher probes no variance)."""
    sin, _, matmul, total, stack = _ops(framework)
    return lambda x: stack([total(sin(matmul(x, W1[:k]))), total(matmul(x, W2[:k]) ** 3) / 3])


def _closed_forms(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The outputs, the Laplacians (N, 2) and the Hessians' diagonals (N, 2, k) of
    :func:`_two_outputs`, in float64."""
    x = x.astype(np.float64)
    w1, w2 = W1[:x.shape[1]], W2[:x.shape[1]]
    s1, s2 = x @ w1, x @ w2
    diag = np.stack([np.einsum("ij,nj->ni", w1 ** 2, -np.sin(s1)),
                     np.einsum("ij,nj->ni", w2 ** 2, 2 * s2)], 1)
    y = np.stack([np.sin(s1).sum(-1), (s2 ** 3).sum(-1) / 3], -1)
    return y, diag.sum(-1), diag


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_laplacian_and_the_diagonal_estimated_cover_the_closed_forms(framework: str) -> None:
    f = _two_outputs(framework)
    x = rng(3901).normal(size=(40, 24)).astype(np.float32)
    _, lap, diag_exact = _closed_forms(x)
    for estimator in ("hutchinson", "hutch++"):
        est = batchjac.laplacian(f, x, estimator=estimator, samples=30, seed=11)
        assert isinstance(est, batchjac.TraceEstimate)
        assert est.estimator == estimator
        assert est.samples == 30
        assert est.seed == 11
        _coverage(est.value, est.stderr, lap)
    diag = batchjac.hessian(f, x, diagonal=True, estimator="hutchinson", samples=30, seed=12)
    assert isinstance(diag, batchjac.DiagonalEstimate)
    _coverage(diag.value, diag.stderr, diag_exact)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_hutchpp_is_exact_where_the_rank_fits_its_sketch(framework: str) -> None:
    """A rank-3 Hessian (a function of three projections) and a rank-4 Jacobian: Hutch++'s
    sketch spans them, so its estimate is the exact trace (to float32), where Hutchinson's at
    the same number of products is off by its noise."""
    _, tanh, matmul, total, stack = _ops(framework)
    g = rng(3902)
    w = g.normal(size=(30, 3)) / np.sqrt(30)
    x = g.normal(size=(25, 30)).astype(np.float32)

    def scalar(a: Any) -> Any:
        return total(tanh(matmul(a, w)))

    s = np.tanh(x.astype(np.float64) @ w)
    lap = (-2 * s * (1 - s * s) * (w * w).sum(0)).sum(-1)
    est = batchjac.laplacian(scalar, x, estimator="hutch++", samples=12, seed=3)
    np.testing.assert_allclose(np.asarray(est.value), lap, atol=2e-5 * np.abs(lap).max())
    rough = batchjac.laplacian(scalar, x, estimator="hutchinson", samples=12, seed=3)
    assert np.abs(np.asarray(rough.value) - lap).max() > 10 * np.abs(np.asarray(est.value) - lap).max()

    a, b = g.normal(size=(30, 4)) / np.sqrt(30), g.normal(size=(4, 30)) / 2

    def flow(z: Any) -> Any:
        return matmul(tanh(matmul(z, a)), b)

    h = np.tanh(x.astype(np.float64) @ a)
    div = np.einsum("ij,nj,ji->n", a, 1 - h * h, b)
    est = batchjac.divergence(flow, x, estimator="hutch++", samples=15, seed=5)
    np.testing.assert_allclose(np.asarray(est.value), div, atol=2e-5 * np.abs(div).max())
    assert np.asarray(est.stderr).max() <= 1e-4 * np.abs(div).max()
    _ = stack


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_hutchpp_divergence_covers_a_full_rank_jacobian_and_beats_hutchinson(framework: str
                                                                               ) -> None:
    """A square Jacobian with a decaying spectrum (a few large directions and small noise):
    Hutch++ is unbiased and, at the same number of products, closer than Hutchinson's."""
    _, tanh, matmul, _, _ = _ops(framework)
    g = rng(3903)
    k = 32
    big = g.normal(size=(k, 3)) @ g.normal(size=(3, k)) / 2
    small = g.normal(size=(k, k)) * 0.02
    x = g.normal(size=(60, k)).astype(np.float32)

    def flow(z: Any) -> Any:
        return matmul(tanh(z), big + small)

    jac = np.einsum("nj,ji->nij", 1 - np.tanh(x.astype(np.float64)) ** 2, big + small)
    exact = np.trace(jac, axis1=1, axis2=2)
    pp = batchjac.divergence(flow, x, estimator="hutch++", samples=18, seed=8)
    _coverage(pp.value, pp.stderr, exact)
    plain = batchjac.divergence(flow, x, estimator="hutchinson", samples=18, seed=8)
    err_pp = np.sqrt(np.mean((np.asarray(pp.value) - exact) ** 2))
    err_plain = np.sqrt(np.mean((np.asarray(plain.value) - exact) ** 2))
    assert err_pp < err_plain / 3, (err_pp, err_plain)


def test_an_estimate_does_not_depend_on_the_chunks() -> None:
    f = _two_outputs("jax", 10)
    x = rng(3904).normal(size=(37, 10)).astype(np.float32)
    for estimator in ("hutchinson", "hutch++"):
        one = batchjac.laplacian(f, x, estimator=estimator, samples=9, seed=2)
        many = batchjac.laplacian(f, x, estimator=estimator, samples=9, seed=2, chunk_size=8)
        np.testing.assert_allclose(np.asarray(many.value), np.asarray(one.value), rtol=1e-5,
                                   atol=1e-5)
        other = batchjac.laplacian(f, x, estimator=estimator, samples=9, seed=3)
        assert not np.allclose(np.asarray(other.value), np.asarray(one.value))
    y, est = batchjac.laplacian(f, x, estimator="hutchinson", samples=4, return_outputs=True)
    np.testing.assert_allclose(np.asarray(y), _closed_forms(x)[0], rtol=1e-5, atol=1e-6)
    assert np.asarray(est.value).shape == (37, 2)


def test_the_probes_signs_are_balanced_independent_and_the_same_in_any_block() -> None:
    """64 signs a hash: an instance's signs do not depend on the block that draws them, and
    entries (within a hash word and across words), instances and seeds are uncorrelated
    (every pairwise correlation within 6 standard errors of 0 over 10,000 instances)."""
    from batchjac._estimators import rademacher

    n, shape, f32 = 10_000, (3, 173), np.dtype(np.float32)  # (1,038 entries: 17 words)
    a = rademacher(7, 0, n, 2, shape, f32)
    assert a.shape == (n, 2, *shape)
    assert a.dtype == f32
    assert set(np.unique(a)) == {-1.0, 1.0}
    np.testing.assert_array_equal(rademacher(7, 1234, 1301, 2, shape, f32), a[1234:1301])
    flat = a.reshape(n, -1).astype(np.float64)
    bound = 6 / np.sqrt(n)
    assert np.abs(flat.mean(0)).max() < bound
    corr = flat.T @ flat / n - np.eye(flat.shape[1])
    assert np.abs(corr).max() < bound, np.unravel_index(np.abs(corr).argmax(), corr.shape)
    assert np.abs(np.mean(flat[1:] * flat[:-1], axis=0)).max() < bound  # neighbouring instances
    other = rademacher(8, 0, n, 2, shape, f32).reshape(n, -1)
    assert np.abs(np.mean(flat * other, axis=0)).max() < bound
    assert rademacher(0, 5, 9, 1, (), np.dtype(np.float64)).shape == (4, 1)  # scalar unknowns


def test_torch_tensors_come_back_as_tensors() -> None:
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rng(3905).normal(size=(12, 6)))
    est = batchjac.laplacian(lambda z: torch.sin(z).sum(-1), x, estimator="hutch++", samples=8)
    assert isinstance(est.value, torch.Tensor)
    assert isinstance(est.stderr, torch.Tensor)
    assert est.value.shape == (12,)


@pytest.mark.parametrize(("call", "match"), [
    (lambda f, x: batchjac.hessian(f, x, estimator="hutchinson"), "pass laplacian=True"),
    (lambda f, x: batchjac.laplacian(f, x, estimator="exact"), "`estimator`"),
    (lambda f, x: batchjac.laplacian(f, x, estimator="hutch++", samples=3), "`samples`"),
    (lambda f, x: batchjac.laplacian(f, x, estimator="hutchinson", samples=1), "`samples`"),
    (lambda f, x: batchjac.laplacian(f, x, estimator="hutchinson", seed=-1), "`seed`"),
    (lambda f, x: batchjac.hessian(f, x, diagonal=True, estimator="hutch++"), "hutch\\+\\+"),
    (lambda f, x: batchjac.laplacian(f, x, estimator="hutchinson", out=np.empty((5, 4))),
     "out="),
    (lambda f, x: batchjac.laplacian(f, x, estimator="hutchinson", differentiable=True),
     "differentiable"),
    (lambda f, x: batchjac.laplacian(f, x, estimator="hutchinson", return_jacobian=True),
     "return_jacobian"),
    (lambda f, x: batchjac.divergence(f, x, estimator="hutch",  # type: ignore[arg-type]
                                      samples=8), "`estimator`"),
])
def test_bad_estimator_arguments_are_refused_by_name(call: Any, match: str) -> None:
    jnp = pytest.importorskip("jax.numpy")
    x = rng(3906).normal(size=(5, 4)).astype(np.float32)
    with pytest.raises(batchjac.InputError, match=match):
        call(lambda z: jnp.sin(z), x)


@pytest.mark.parametrize(("kind", "estimator"), [("laplacian", "hutch++"),
                                                 ("diagonal", "hutchinson")])
def test_estimates_into_a_store_resume_byte_identical(tmp_path: Any, kind: str,
                                                      estimator: str) -> None:
    """The Laplacian's and the diagonal's estimates into a store, (N, *shape, 2): stopped after
    two chunks, made again, only the others computed, equal to the in-memory estimate bit for
    bit; another seed is another job."""
    pytest.importorskip("zarr")
    f = _two_outputs("jax", 10)
    x = rng(3907).normal(size=(50, 10)).astype(np.float32)
    seen: list[int] = []

    def stop(rows: int) -> None:
        seen.append(rows)
        if len(seen) == 2:
            raise KeyboardInterrupt

    kw: dict[str, Any] = {"estimator": estimator, "samples": 9, "seed": 6, "chunk_size": 16,
                          ("laplacian" if kind == "laplacian" else "diagonal"): True}
    store = batchjac.Store(tmp_path / "est.zarr", model_id="two-outputs")
    with pytest.raises(KeyboardInterrupt):
        batchjac.hessian(f, x, out=store, progress=stop, **kw)
    res = batchjac.hessian(f, x, out=store, **kw)
    assert (res.resumed_chunks, res.computed_chunks) == (2, 2)
    want = batchjac.hessian(f, x, **kw)
    got = np.asarray(res.open())
    assert got.shape == (*np.asarray(want.value).shape, 2)
    assert np.array_equal(got[..., 0], np.asarray(want.value))
    assert np.array_equal(got[..., 1], np.asarray(want.stderr))
    with pytest.raises(batchjac.StoreError):
        batchjac.hessian(f, x, out=store, **{**kw, "seed": 7})


def test_hutchpp_does_not_depend_on_rounding_where_its_sketch_is_degenerate() -> None:
    """Two sketch probes equal up to sign leave A S of rank 1: the second column of Q would
    be decided by rounding alone (it was: the same call gave other estimates on a Dask worker).
    It is dropped, so products that differ by rounding give the same estimate, and it equals
    the estimate with the duplicate probe removed from the sketch."""
    from batchjac._estimators import hutchpp

    g = rng(3908)
    a = g.normal(size=(30, 5, 5))
    v = np.sign(g.normal(size=(30, 5, 5)))
    v[:, 1] = -v[:, 0]  # a degenerate sketch in every row

    def apply(u: Any, ctx: Any, d: np.ndarray, noise: float = 0.0) -> Any:
        out = np.einsum("rij,rdj->rdi", a, d)[:, :, None, :]
        return None, out + noise * g.normal(size=out.shape)

    _, clean = hutchpp(apply, None, (), v, 2)
    _, noisy = hutchpp(lambda u, c, d: apply(u, c, d, 1e-13), None, (), v, 2)
    np.testing.assert_allclose(noisy, clean, rtol=1e-9, atol=1e-9)
    _, single = hutchpp(apply, None, (), v[:, [0, 2, 3, 4]], 1)  # the sketch without the duplicate
    np.testing.assert_allclose(clean, single, rtol=1e-9, atol=1e-9)
