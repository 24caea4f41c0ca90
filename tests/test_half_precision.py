"""Half-precision models and inputs (issue 37): a model with bfloat16 or float16 weights, or a
Keras model under a mixed-precision policy, is differentiated in float32 (its weights and
layers widened, which is exact), so its Jacobians equal the float64 Jacobians of the same
weights to float32's accuracy; float16 and bfloat16 inputs are computed in float32, a tensor
of the same kind returned (tests/test_input_kinds.py for every framework)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import rng

TOL = 1e-5  # float32's accuracy, relative to the largest entry


def _tanh_mlp_jacobians(w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, x: np.ndarray
                        ) -> np.ndarray:
    """The exact Jacobians of x -> tanh(x w1 + b1) w2 (+ b2), in float64."""
    s = 1.0 - np.tanh(x.astype(np.float64) @ w1 + b1) ** 2
    return np.einsum("ho,nh,ih->noi", w2, s, w1)


def _err(jac: Any, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(jac, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_a_half_precision_torch_module(half: str) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3)).to(getattr(torch, half))
    x = rng(31).normal(size=(12, 5)).astype(np.float32)
    with torch.no_grad():
        w1, b1 = model[0].weight.double().T.numpy(), model[0].bias.double().numpy()
        w2 = model[2].weight.double().T.numpy()
    ref = _tanh_mlp_jacobians(w1, b1, w2, x)
    jac = batchjac.jacobian(model, x)
    assert jac.dtype == np.float32
    assert _err(jac, ref) < TOL
    # half-precision tensors in: float32 tensors out, at the rounded values
    given = torch.from_numpy(x).to(getattr(torch, half))
    got = batchjac.jacobian(model, given)
    assert got.dtype == torch.float32
    ref_half = _tanh_mlp_jacobians(w1, b1, w2, given.double().numpy())
    assert _err(got.numpy(), ref_half) < TOL


def test_a_jax_function_of_bfloat16_params() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    g = rng(32)
    params = {"w1": jnp.asarray(g.normal(size=(5, 16)), jnp.bfloat16),
              "b1": jnp.asarray(g.normal(size=16), jnp.bfloat16),
              "w2": jnp.asarray(g.normal(size=(16, 3)), jnp.bfloat16)}

    def f(p: Any, x: Any) -> Any:
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

    x = g.normal(size=(12, 5)).astype(np.float32)
    wide = {k: np.asarray(v, np.float64) for k, v in params.items()}
    jac = batchjac.jacobian(f, x, backend_options={"params": params})
    assert jac.dtype == np.float32
    assert _err(jac, _tanh_mlp_jacobians(wide["w1"], wide["b1"], wide["w2"], x)) < TOL


def test_a_keras_model_under_a_mixed_precision_policy() -> None:
    """Keras's "mixed_bfloat16" layers compute in bfloat16: batchjac differentiates a float32
    clone that follows the model's weights (before: bfloat16 layers, ~5e-3 off)."""
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    inp = keras.Input((5,))
    first = keras.layers.Dense(16, activation="tanh", dtype="mixed_bfloat16")
    model = keras.Model(inp, keras.layers.Dense(3, dtype="mixed_bfloat16")(first(inp)))
    x = rng(33).normal(size=(12, 5)).astype(np.float32)

    def exact() -> np.ndarray:
        w = [np.asarray(v, np.float64) for v in model.get_weights()]
        return _tanh_mlp_jacobians(w[0], w[1], w[2], x)

    assert _err(batchjac.jacobian(model, x), exact()) < TOL
    first.kernel.assign(first.kernel * 0.5)  # the clone follows the model's weights
    assert _err(batchjac.jacobian(model, x), exact()) < TOL
