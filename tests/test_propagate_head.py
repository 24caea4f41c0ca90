"""``propagate(method="linear")`` through a model's linear head (issue 38): where the unknowns
first meet a product with weights that are the same for every instance (``z = x W``, narrower
than ``x``), ``J Sigma J^T = J_z (W^T Sigma W) J_z^T`` with ``J_z = dy/dz``: the covariances
equal the dense reference ``J Sigma J^T`` from batchjac's own float64 Jacobians, the route
is named in ``sigma_form``, and every model where the rule would not hold keeps the plain
route (a nonlinearity first, the unknowns read twice, a product with an instance's own
values, a wider first layer, a mode asked for, a diagonal Sigma)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import jax_x64, rng

jax = pytest.importorskip("jax")
jnp = jax.numpy

FOLDED = "folded through the model's linear head"


def _weights(seed: int, *sizes: int) -> list[Any]:
    g = rng(seed)
    return [jnp.asarray(g.normal(size=(a, b)) / np.sqrt(a)) for a, b in itertools.pairwise(sizes)]


def _reference(f: Any, inputs: Any, sigma: np.ndarray, **kw: Any) -> np.ndarray:
    jac = np.asarray(batchjac.jacobian(f, inputs, mode="reverse", **kw), np.float64)
    return np.einsum("nak,kl,nbl->nab", jac, sigma, jac)


def _sigma(seed: int, k: int) -> np.ndarray:
    a = rng(seed).normal(size=(k, k))
    return a @ a.T / k + 0.1 * np.eye(k)


def test_a_first_dense_layer_folds_sigma_and_gives_the_dense_covariances() -> None:
    with jax_x64():
        w1, w2, w3 = _weights(3861, 12, 5, 7, 3)
        b1 = jnp.asarray(rng(3862).normal(size=5))

        def f(x: Any) -> Any:
            return jnp.tanh(jnp.tanh(x @ w1 + b1) @ w2) @ w3

        x = rng(3863).normal(size=(40, 12))
        sigma = _sigma(3864, 12)
        got = batchjac.propagate(f, x, cov=sigma)
        assert FOLDED in got.sigma_form
        assert "(5 of 12 values)" in got.sigma_form
        want = _reference(f, x, sigma)
        np.testing.assert_allclose(got.cov, want, rtol=1e-10, atol=1e-12 * np.abs(want).max())
        np.testing.assert_allclose(got.mean, np.asarray(f(x)), rtol=1e-12)
        # chunked: the last block padded, the same covariances
        again = batchjac.propagate(f, x, cov=sigma, chunk_size=16)
        np.testing.assert_allclose(again.cov, got.cov, rtol=1e-12, atol=1e-14)
        # float32: within float32's rounding of the float64 reference
        got32 = batchjac.propagate(f, x.astype(np.float32), cov=sigma.astype(np.float32))
        assert FOLDED in got32.sigma_form
        np.testing.assert_allclose(got32.cov, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())


def test_known_inputs_after_the_head_fold_and_before_it_do_not() -> None:
    """``(x W) * h``: the head is ``x W`` and the known inputs act after it (folded, right);
    ``(x * h) W`` and a product with an instance's own matrix are not linear heads."""
    with jax_x64():
        w1, w2 = _weights(3871, 10, 4, 2)
        x = rng(3872).normal(size=(30, 10))
        h = rng(3873).normal(size=(30, 4))
        sigma = _sigma(3874, 10)

        def after(x: Any, h: Any) -> Any:
            return jnp.sin((x @ w1) * h) @ w2

        got = batchjac.propagate(after, (x, h), wrt=0, cov=sigma)
        assert FOLDED in got.sigma_form
        want = _reference(after, (x, h), sigma, wrt=0)
        np.testing.assert_allclose(got.cov, want, rtol=1e-10, atol=1e-12 * np.abs(want).max())

        def before(x: Any, h: Any) -> Any:
            return jnp.sin((x * jnp.tile(h, (1, 3))[:, :10]) @ w1) @ w2

        plain = batchjac.propagate(before, (x, h), wrt=0, cov=sigma)
        assert FOLDED not in plain.sigma_form
        want = _reference(before, (x, h), sigma, wrt=0)
        np.testing.assert_allclose(plain.cov, want, rtol=1e-10, atol=1e-12 * np.abs(want).max())

        hm = rng(3875).normal(size=(30, 10 * 4))

        def own(x: Any, hm: Any) -> Any:  # each instance's own matrix: not the same for all
            return jnp.sin(jnp.einsum("nk,nkw->nw", x, hm.reshape(-1, 10, 4))) @ w2

        plain = batchjac.propagate(own, (x, hm), wrt=0, cov=sigma)
        assert FOLDED not in plain.sigma_form
        want = _reference(own, (x, hm), sigma, wrt=0)
        np.testing.assert_allclose(plain.cov, want, rtol=1e-10, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("case", ["nonlinear first", "read twice", "wider", "mode asked",
                                  "diagonal"])
def test_models_without_a_narrow_linear_head_keep_the_plain_route(case: str) -> None:
    with jax_x64():
        w1, w2 = _weights(3881, 8, 3, 2)
        wide = _weights(3882, 8, 16, 2)
        x = rng(3883).normal(size=(25, 8))
        sigma = _sigma(3884, 8)
        kw: dict[str, Any] = {"cov": sigma}
        if case == "nonlinear first":
            def f(x: Any) -> Any:
                return jnp.tanh(jnp.tanh(x) @ w1) @ w2
        elif case == "read twice":
            def f(x: Any) -> Any:
                return jnp.tanh(x @ w1) @ w2 + x[:, :2]
        elif case == "wider":
            def f(x: Any) -> Any:
                return jnp.tanh(x @ wide[0]) @ wide[1]
        else:
            def f(x: Any) -> Any:
                return jnp.tanh(x @ w1) @ w2
            if case == "mode asked":
                kw["mode"] = "reverse"
            else:
                kw = {"cov": np.diag(np.diag(sigma))}
        got = batchjac.propagate(f, x, **kw)
        assert FOLDED not in got.sigma_form
        want = _reference(f, x, kw["cov"])
        np.testing.assert_allclose(got.cov, want, rtol=1e-10, atol=1e-12 * np.abs(want).max())


def _torch_model(case: str, seed: int) -> Any:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    first = torch.nn.Linear(12, 5 if case != "wider" else 20).double()
    rest = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(first.out_features, 7),
                               torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    with torch.no_grad():
        for p in [*first.parameters(), *rest.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / 2)
    if case == "read twice":
        return lambda x: rest(first(x)) + x[:, :3]
    if case == "function":  # (read from a recording of one row, not from the modules)
        return lambda x: rest(first(x))
    return torch.nn.Sequential(first, rest).eval()


def _keras_model(case: str, seed: int) -> Any:
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    keras.utils.set_random_seed(seed)
    width = 20 if case == "wider" else 5
    inp = keras.Input((12,), dtype="float64")
    if case == "activation first":
        h = keras.layers.Dense(width, activation="tanh", dtype="float64")(
            keras.layers.Activation("sigmoid", dtype="float64")(inp))
    else:
        h = keras.layers.Dense(width, activation="tanh", dtype="float64")(inp)
    h = keras.layers.Dense(7, activation="tanh", dtype="float64")(h)
    out = keras.layers.Dense(3, dtype="float64")(h)
    if case == "sequential":
        return keras.Sequential([inp, *[keras.layers.Dense(u, activation=a, dtype="float64")
                                        for u, a in ((5, "tanh"), (7, "tanh"), (3, None))]])
    return keras.Model(inp, out)


@pytest.mark.parametrize(("framework", "case", "folds"), [
    ("torch", "module", True), ("torch", "function", True), ("torch", "read twice", False),
    ("torch", "wider", False),
    ("tensorflow", "functional", True), ("tensorflow", "sequential", True),
    ("tensorflow", "activation first", False), ("tensorflow", "wider", False)])
def test_torch_and_keras_models_fold_through_their_first_dense_layer(framework: str, case: str,
                                                                      folds: bool) -> None:
    """A PyTorch ``Linear`` or a Keras ``Dense`` first (the unknowns read by it alone, narrower):
    folded, the covariances of the dense reference; otherwise the plain route, the same."""
    model = (_torch_model if framework == "torch" else _keras_model)(case, 3891)
    x = rng(3892).normal(size=(30, 12))
    sigma = _sigma(3893, 12)
    got = batchjac.propagate(model, x, cov=sigma, chunk_size=16)
    assert (FOLDED in got.sigma_form) is folds
    want = _reference(model, x, sigma)
    np.testing.assert_allclose(got.cov, want, rtol=1e-9, atol=1e-11 * np.abs(want).max())
