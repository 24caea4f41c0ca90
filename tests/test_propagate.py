"""batchjac.propagate: closed forms on linear models, linear vs Monte Carlo on a near-linear
model, unscented vs linear on a strongly nonlinear one, streaming, and bad covariances."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchjac

tf = pytest.importorskip("tensorflow")

RNG = np.random.default_rng(0)
W = RNG.normal(size=(3, 4))  # 3 unknowns -> 4 outputs
B = RNG.normal(size=4)
H = RNG.normal(size=(2, 4))  # 2 known inputs


def linear(x: Any) -> Any:
    return tf.matmul(x, tf.constant(W, x.dtype)) + tf.constant(B, x.dtype)


def linear_concat(x: Any) -> Any:  # takes concat([unknown (3), known (2)], -1)
    return tf.matmul(x, tf.constant(np.vstack([W, H]), x.dtype))


def spd(k: int, seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).normal(size=(k, k))
    return a @ a.T + 0.1 * np.eye(k)


def variances(res: batchjac.Propagation) -> np.ndarray:
    return np.diagonal(res.cov, axis1=1, axis2=2)


# -- closed forms ----------------------------------------------------------------------------------


def test_linear_model_shared_cov_is_w_sigma_wt() -> None:
    mu = RNG.normal(size=(6, 3))
    sigma = spd(3, 1)
    res = batchjac.propagate(linear, mu, cov=sigma)
    assert res.mean.shape == (6, 4)
    assert res.cov.shape == (6, 4, 4)
    np.testing.assert_allclose(res.mean, mu @ W + B, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(res.cov, np.broadcast_to(W.T @ sigma @ W, (6, 4, 4)),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(res.std, np.sqrt(np.diag(W.T @ sigma @ W))[None].repeat(6, 0))
    assert res.method == "linear"
    assert res.output_shape == (4,)


def test_linear_model_per_instance_cov_and_std() -> None:
    mu = RNG.normal(size=(5, 3))
    stack = np.stack([spd(3, s) for s in range(5)])
    res = batchjac.propagate(linear, mu, cov=stack)
    np.testing.assert_allclose(res.cov, np.einsum("ko,nkl,lp->nop", W, stack, W), rtol=1e-12)
    std = np.abs(RNG.normal(size=(5, 3)))
    res = batchjac.propagate(linear, mu, std=std)
    expect = np.einsum("ko,nk,kp->nop", W, std**2, W)
    np.testing.assert_allclose(res.cov, expect, rtol=1e-12)
    shared = batchjac.propagate(linear, mu, std=std[0])
    np.testing.assert_allclose(shared.cov[0], expect[0], rtol=1e-12)
    scalar = batchjac.propagate(linear, mu, std=0.5)
    np.testing.assert_allclose(scalar.cov[0], 0.25 * W.T @ W, rtol=1e-12)


def test_known_inputs_are_exact() -> None:
    mu, known = RNG.normal(size=(4, 3)), RNG.normal(size=(4, 2))
    sigma = spd(3, 2)
    res = batchjac.propagate(linear_concat, mu, known, cov=sigma)
    np.testing.assert_allclose(res.mean, mu @ W + known @ H, rtol=1e-12)
    np.testing.assert_allclose(res.cov[2], W.T @ sigma @ W, rtol=1e-12)


def test_wrt_columns_and_float32() -> None:
    x = RNG.normal(size=(4, 5)).astype("f4")  # columns 1 and 3 are uncertain
    res = batchjac.propagate(linear_concat, x, wrt=[1, 3], std=[0.1, 0.2])
    full = np.vstack([W, H])
    jac = full[[1, 3]].T  # (4 outputs, 2 unknowns)
    np.testing.assert_allclose(res.cov[0], jac @ np.diag([0.01, 0.04]) @ jac.T, rtol=1e-5)
    assert res.cov.dtype == np.float64


@pytest.mark.parametrize("method", ["unscented", "monte_carlo"])
def test_other_methods_on_a_linear_model(method: str) -> None:
    mu = RNG.normal(size=(3, 3))
    sigma = spd(3, 3)
    res = batchjac.propagate(linear, mu, cov=sigma, method=method, n_samples=20_000)
    exact = W.T @ sigma @ W
    tol = 1e-10 if method == "unscented" else 0.05  # the sigma points are exact for linear f
    np.testing.assert_allclose(res.cov, np.broadcast_to(exact, res.cov.shape),
                               rtol=tol, atol=tol * np.abs(exact).max())
    np.testing.assert_allclose(res.mean, mu @ W + B, atol=0.05 if tol > 1e-3 else 1e-10)


def test_singular_covariance_is_fine() -> None:
    v = np.array([1.0, 2.0, -1.0])
    sigma = np.outer(v, v)  # rank 1: PSD, not positive definite
    mu = RNG.normal(size=(2, 3))
    for method in ("linear", "unscented"):
        res = batchjac.propagate(linear, mu, cov=sigma, method=method)
        np.testing.assert_allclose(res.cov[0], W.T @ sigma @ W, rtol=1e-9, atol=1e-12)


def test_multi_axis_outputs_are_flattened() -> None:
    def model(x: Any) -> Any:
        return tf.reshape(linear(x)[:, :4], (-1, 2, 2))

    mu = np.random.default_rng(41).normal(size=(3, 3))
    sigma = spd(3, seed=42)
    res = batchjac.propagate(model, mu, cov=sigma)
    assert res.mean.shape == (3, 2, 2)
    assert res.cov.shape == (3, 4, 4)
    assert res.std.shape == (3, 2, 2)
    # closed form: outputs (x W + B)[:4] in row-major order, covariance W[:, :4]^T S W[:, :4]
    np.testing.assert_allclose(res.mean, (mu @ W + B)[:, :4].reshape(3, 2, 2), rtol=1e-10, atol=1e-12)
    exact = W[:, :4].T @ sigma @ W[:, :4]
    for i in range(3):
        np.testing.assert_allclose(res.cov[i], exact, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(res.std, np.broadcast_to(np.sqrt(np.diag(exact)).reshape(2, 2), (3, 2, 2)),
                               rtol=1e-10)


# -- accuracy of the methods -------------------------------------------------------------------------

W1 = RNG.normal(size=(3, 8)) * 0.5
W2 = RNG.normal(size=(8, 3))


def near_linear(x: Any) -> Any:
    """A tanh MLP; with input standard deviations of a few percent it is nearly linear."""
    return tf.matmul(tf.tanh(tf.matmul(x, tf.constant(W1, x.dtype))), tf.constant(W2, x.dtype))


def strongly_nonlinear(x: Any) -> Any:
    return tf.stack([x[:, 0] ** 2 + x[:, 1], x[:, 0] * x[:, 1] + x[:, 2] ** 3, tf.exp(x[:, 2])],
                    axis=1)


def test_linear_agrees_with_monte_carlo_on_a_near_linear_model() -> None:
    mu = RNG.normal(size=(4, 3)).astype("f4")
    sigma = np.diag([0.05, 0.03, 0.04]) ** 2
    lin = batchjac.propagate(near_linear, mu, cov=sigma)
    mc = batchjac.propagate(near_linear, mu, cov=sigma, method="monte_carlo", n_samples=100_000)
    assert mc.n_samples == 100_000
    rel = np.abs(variances(lin) / variances(mc) - 1)
    assert rel.max() < 0.02, rel  # measured: 1.25% at worst, 0.3% typical (MC error ~0.45%)


def test_unscented_beats_linear_on_a_strongly_nonlinear_model() -> None:
    mu = np.array([[0.3, -0.5, 0.2], [1.0, 0.5, -0.4], [-0.7, 0.2, 0.6]], "f4")
    res = {m: batchjac.propagate(strongly_nonlinear, mu, std=0.5, method=m, n_samples=100_000)
           for m in ("linear", "unscented", "monte_carlo")}
    ref = variances(res["monte_carlo"])
    err_lin = np.abs(variances(res["linear"]) / ref - 1)
    err_ut = np.abs(variances(res["unscented"]) / ref - 1)
    # measured: linear 8%..82% off, unscented 0.3%..33% off (the x0 * x1 term has no sigma
    # point off the axes); unscented is closer on every output variance of every instance
    assert np.all(err_ut < err_lin), (err_ut, err_lin)
    assert err_lin.max() > 0.5
    assert err_ut[:, [0, 2]].max() < 0.05
    # the unscented mean is exact for the quadratic output 0: E[x0^2] = mu0^2 + sigma^2
    np.testing.assert_allclose(res["unscented"].mean[:, 0], mu[:, 0] ** 2 + 0.25 + mu[:, 1],
                               rtol=1e-5)


def sum_of_squares(x: Any) -> Any:  # 5 unknowns -> [sum x^2, x0]
    return tf.stack([tf.reduce_sum(x**2, axis=-1), x[:, 0]], axis=-1)


def test_unscented_covariance_with_negative_centre_weight_is_projected_to_psd() -> None:
    # k=5 and the defaults (kappa = 3 - k): centre weight -2/3, side weights 1/6, points at
    # +-sqrt(3) sigma. For sum x^2 the raw transform gives a variance of
    # -2/3 (0 - 5)^2 + 10/6 (3 - 5)^2 = -10 sigma^4 around mu = 0 (the truth is 10 sigma^4).
    mu = np.zeros((3, 5))
    mu[1:] = RNG.normal(size=(2, 5)) * [[0.01], [3.0]]  # near 0 (clipped); far out (fine)
    with pytest.warns(batchjac.CovarianceClippedWarning, match="negative eigenvalues"):
        res = batchjac.propagate(sum_of_squares, mu, std=1.0, method="unscented")
    assert res.clipped == 2
    # the raw unscented covariance, from its definition
    k, c = 5, 3.0
    pts = np.concatenate([mu[:, None], mu[:, None] + np.sqrt(c) * np.eye(k),
                          mu[:, None] - np.sqrt(c) * np.eye(k)], axis=1)  # (3, 11, 5)
    y = np.stack([(pts**2).sum(-1), pts[..., 0]], axis=-1)
    w = np.full(2 * k + 1, 1 / (2 * c))
    w[0] = (c - k) / c
    d = y - np.einsum("p,rpm->rm", w, y)[:, None]
    raw = np.einsum("p,rpm,rpn->rmn", w, d, d)
    np.testing.assert_allclose(raw[0], [[-10.0, 0.0], [0.0, 1.0]], atol=1e-9)
    # clipped instances: the nearest PSD matrix (negative eigenvalues set to zero)
    for i in (0, 1):
        lam, vec = np.linalg.eigh(raw[i])
        assert lam.min() < 0
        np.testing.assert_allclose(res.cov[i], (vec * np.clip(lam, 0, None)) @ vec.T, atol=1e-9)
    # far from 0 the linear term dominates: already PSD, returned unchanged
    assert np.linalg.eigvalsh(raw[2]).min() > 0
    np.testing.assert_allclose(res.cov[2], raw[2], rtol=1e-9)
    assert np.linalg.eigvalsh(res.cov).min() > -1e-9
    # nonnegative weights (alpha=1, kappa=0): a sum of outer products, no projection needed
    ok = batchjac.propagate(sum_of_squares, mu, std=1.0, method="unscented", kappa=0.0)
    assert ok.clipped == 0


def test_monte_carlo_is_seeded_and_independent_of_chunking() -> None:
    mu = RNG.normal(size=(5, 3)).astype("f4")
    a = batchjac.propagate(near_linear, mu, std=0.1, method="monte_carlo", n_samples=3000, seed=7)
    b = batchjac.propagate(near_linear, mu, std=0.1, method="monte_carlo", n_samples=3000, seed=7,
                           chunk_size=2, max_memory="2MB")
    # the same draws; only float32 rounding of differently sized forward batches may differ
    np.testing.assert_allclose(a.cov, b.cov, rtol=1e-5, atol=1e-6 * np.abs(a.cov).max())
    c = batchjac.propagate(near_linear, mu, std=0.1, method="monte_carlo", n_samples=3000, seed=8)
    assert not np.allclose(a.cov, c.cov, rtol=1e-3)


@pytest.mark.parametrize("method", ["linear", "unscented", "monte_carlo"])
def test_streams_into_memmaps(tmp_path: Any, method: str) -> None:
    mu = RNG.normal(size=(7, 3)).astype("f4")
    mean_out = np.lib.format.open_memmap(tmp_path / "mean.npy", mode="w+", dtype="f8", shape=(7, 3))
    cov_out = np.lib.format.open_memmap(tmp_path / "cov.npy", mode="w+", dtype="f8",
                                        shape=(7, 3, 3))
    kw = {"std": 0.1, "method": method, "n_samples": 500}
    res = batchjac.propagate(near_linear, mu, out=(mean_out, cov_out), chunk_size=3, **kw)
    assert res.mean is mean_out
    assert res.cov is cov_out
    ref = batchjac.propagate(near_linear, mu, **kw)
    # float32 model: other chunk shapes may round differently (and pick another mode)
    np.testing.assert_allclose(np.load(tmp_path / "cov.npy"), ref.cov, rtol=1e-5,
                               atol=1e-6 * np.abs(ref.cov).max())
    np.testing.assert_allclose(np.load(tmp_path / "mean.npy"), ref.mean, rtol=1e-5, atol=1e-6)


# -- bad input ---------------------------------------------------------------------------------------


def test_asymmetric_cov_names_the_instance() -> None:
    stack = np.stack([spd(3, s) for s in range(6)])
    stack[4, 0, 2] += 0.5
    with pytest.raises(batchjac.InputError, match=r"`cov\[4\]` \(instance 4\) is not symmetric"):
        batchjac.propagate(linear, RNG.normal(size=(6, 3)), cov=stack)


def test_indefinite_cov_names_the_instance() -> None:
    stack = np.stack([spd(3, s) for s in range(6)])
    stack[2] = np.diag([1.0, -0.5, 2.0])
    with pytest.raises(batchjac.InputError,
                       match=r"`cov\[2\]` \(instance 2\) is not positive semi-definite: its "
                             r"smallest eigenvalue is -0.5"):
        batchjac.propagate(linear, RNG.normal(size=(6, 3)), cov=stack)
    with pytest.raises(batchjac.InputError, match=r"^`cov` is not positive semi-definite"):
        batchjac.propagate(linear, RNG.normal(size=(6, 3)), cov=np.diag([1.0, -0.5, 2.0]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cov": np.eye(4)}, r"`cov` has shape \(4, 4\), which does not match the 3 unknowns"),
        ({"cov": np.ones(3)}, r"For standard deviations use `std=`"),
        ({"cov": np.eye(3)[None].repeat(5, 0)}, r"\(6, 3, 3\) per instance"),
        ({"std": np.ones((6, 4))}, r"`std` has shape \(6, 4\)"),
        ({"std": [0.1, -0.2, 0.1]}, "invalid value -0.2"),
        ({"std": np.full((6, 3), 0.1) * np.array([[1], [1], [np.nan], [1], [1], [1]])},
         "for instance 2"),
        ({"cov": np.full((3, 3), np.inf)}, "NaN or Inf"),
        ({"cov": np.eye(3), "std": 0.1}, "exactly one of `cov`"),
        ({}, "got neither"),
        ({"std": 0.1, "method": "taylor"}, "`method` must be one of"),
        ({"std": 0.1, "method": "monte_carlo", "n_samples": 1}, "`n_samples` must be"),
        ({"std": 0.1, "method": "unscented", "alpha": 0.0}, "alpha > 0"),
        ({"std": 0.1, "out": np.empty((6, 4))}, "tuple"),
        ({"std": 0.1, "out": (np.empty((6, 4)), np.empty((6, 3, 3)))}, r"`out` cov has shape"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(batchjac.InputError, match=match):
        batchjac.propagate(linear, RNG.normal(size=(6, 3)), **kwargs)


def test_mean_and_known_rows_must_match() -> None:
    with pytest.raises(batchjac.InputError, match="has 5 rows but `unknown` has 6"):
        batchjac.propagate(linear_concat, RNG.normal(size=(6, 3)), RNG.normal(size=(5, 2)), std=0.1)


# -- other frameworks ------------------------------------------------------------------------------


def _torch_linear() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("batchjac._backends.torch")
    layer = torch.nn.Linear(3, 4).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(W.T))
        layer.bias.copy_(torch.tensor(B))
    return layer


def _jax_linear() -> Any:
    jax = pytest.importorskip("jax")
    pytest.importorskip("batchjac._backends.jax")
    w, b = np.asarray(W, "f4"), np.asarray(B, "f4")
    return lambda x: x @ jax.numpy.asarray(w) + jax.numpy.asarray(b)


@pytest.mark.parametrize("make", [_torch_linear, _jax_linear], ids=["torch", "jax"])
@pytest.mark.parametrize("method", ["linear", "unscented", "monte_carlo"])
def test_other_frameworks(make: Any, method: str) -> None:
    model = make()
    mu = RNG.normal(size=(4, 3)).astype("f4")
    sigma = spd(3, 4)
    res = batchjac.propagate(model, mu, cov=sigma, method=method, n_samples=20_000)
    exact = W.T @ sigma @ W
    tol = 0.05 if method == "monte_carlo" else 1e-5
    np.testing.assert_allclose(res.cov, np.broadcast_to(exact, res.cov.shape), rtol=tol,
                               atol=tol * np.abs(exact).max())
