"""Model fingerprints: equal for the same model rebuilt, different when anything that changes
the output changes (weights, architecture, code, closed-over values)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchjac._fingerprint import computation_fingerprint, file_fingerprint, model_fingerprint


def test_functions_and_closures() -> None:
    def make(scale: float, w: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        def f(x: np.ndarray) -> np.ndarray:
            return np.tanh(x @ w) * scale

        return f

    w = np.random.default_rng(0).normal(size=(3, 2))
    a, b = make(2.0, w), make(2.0, w.copy())
    assert model_fingerprint(a) == model_fingerprint(b)  # equal values, different objects
    assert model_fingerprint(make(3.0, w)) != model_fingerprint(a)
    w2 = w.copy()
    w2[0, 0] += 1e-12
    assert model_fingerprint(make(2.0, w2)) != model_fingerprint(a)

    def g(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.sin(x @ w)

    assert model_fingerprint(functools.partial(g, w=w)) != model_fingerprint(functools.partial(g, w=w2))
    assert model_fingerprint(g) != model_fingerprint(a)


def test_keras_names_do_not_matter_but_weights_do() -> None:
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from batchjac.examples import seed_model

    first = model_fingerprint(seed_model("tensorflow"))
    keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])  # Keras numbers layer names on
    assert model_fingerprint(seed_model("tensorflow")) == first
    changed = seed_model("tensorflow")
    changed.set_weights([w * 1.0001 for w in changed.get_weights()])
    assert model_fingerprint(changed) != first
    assert model_fingerprint(seed_model("tensorflow", dtype="float64")) != first


def test_torch_modules() -> None:
    torch = pytest.importorskip("torch")
    from batchjac.examples import seed_model

    first = model_fingerprint(seed_model("torch"))
    assert model_fingerprint(seed_model("torch")) == first
    changed = seed_model("torch")
    with torch.no_grad():
        changed[0].bias[0] += 1e-4
    assert model_fingerprint(changed) != first


def test_file_fingerprint(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(b"1")
    before = file_fingerprint(tmp_path / "d")
    (tmp_path / "d" / "a.bin").write_bytes(b"2")
    assert file_fingerprint(tmp_path / "d") != before
    assert file_fingerprint(tmp_path / "d" / "a.bin").startswith("sha256:")


# -- computation_fingerprint: the architecture, dtypes and code, not the weights ------------------
# It keys the tuning cache: a decision timed on one model is reused for the same model retrained,
# reloaded or rebuilt around new parameters, and never for another architecture or dtype.


def _closure(w: np.ndarray, scale: float = 2.0) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: np.tanh(x @ w) * scale


def test_computation_fingerprint_of_functions_ignores_values_not_shapes() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 2))
    first = computation_fingerprint(_closure(w))
    assert computation_fingerprint(_closure(rng.normal(size=(3, 2)))) == first  # new weights
    assert computation_fingerprint(_closure(w.copy())) == first  # a new lambda object, same code
    assert computation_fingerprint(_closure(w[:, :1])) != first  # another width
    assert computation_fingerprint(_closure(w.astype(np.float32))) != first  # another dtype
    assert computation_fingerprint(_closure(w, scale=3.0)) != first  # Python scalars count
    assert computation_fingerprint(lambda x: np.sin(x @ w) * 2.0) != first  # other code
    assert computation_fingerprint(_closure(w)) != model_fingerprint(_closure(w))

    def g(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.sin(x @ w)

    assert (computation_fingerprint(functools.partial(g, w=w))
            == computation_fingerprint(functools.partial(g, w=rng.normal(size=(3, 2)))))


def test_computation_fingerprint_of_jax_closures_over_params() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def init(key: Any, hidden: int) -> dict[str, Any]:
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (5, hidden)), "w2": jax.random.normal(k2, (hidden, 4))}

    def build(params: dict[str, Any]) -> Callable[[Any], Any]:
        @jax.jit
        def model(x: Any) -> Any:
            return jnp.tanh(x @ params["w1"]) @ params["w2"]

        return model

    first = computation_fingerprint(build(init(jax.random.PRNGKey(0), 8)))
    assert computation_fingerprint(build(init(jax.random.PRNGKey(1), 8))) == first
    assert computation_fingerprint(build(init(jax.random.PRNGKey(0), 9))) != first
    assert model_fingerprint(build(init(jax.random.PRNGKey(1), 8))) != model_fingerprint(
        build(init(jax.random.PRNGKey(0), 8)))


def test_computation_fingerprint_of_keras_models(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from batchjac.examples import seed_model

    model = seed_model("tensorflow")
    first = computation_fingerprint(model)
    retrained = seed_model("tensorflow")
    retrained.set_weights([w * 1.5 + 0.1 for w in retrained.get_weights()])
    assert computation_fingerprint(retrained) == first
    model.save(tmp_path / "m.keras")
    reloaded = keras.models.load_model(tmp_path / "m.keras")
    assert computation_fingerprint(reloaded) == first
    assert model_fingerprint(reloaded) == model_fingerprint(model)
    assert computation_fingerprint(seed_model("tensorflow", dtype="float64")) != first

    def mlp(width: int, activation: str) -> Any:
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(width, activation=activation),
                                 keras.layers.Dense(1)])

    base = computation_fingerprint(mlp(4, "tanh"))
    assert computation_fingerprint(mlp(4, "tanh")) == base  # fresh random weights, new names
    assert computation_fingerprint(mlp(5, "tanh")) != base
    assert computation_fingerprint(mlp(4, "relu")) != base


def test_computation_fingerprint_sees_keras_dtype_policies() -> None:
    """A model without weights shows its dtype in its config only, in dtype policies whose
    "name" is a dtype: those must not be renamed like layers."""
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")

    def weightless(dtype: str) -> Any:
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(dtype)
        try:
            return keras.Sequential([keras.Input((3,), dtype=dtype), keras.layers.Activation("tanh")])
        finally:
            keras.config.set_dtype_policy(previous)

    assert computation_fingerprint(weightless("float64")) == computation_fingerprint(weightless("float64"))
    assert computation_fingerprint(weightless("float32")) != computation_fingerprint(weightless("float64"))


def test_computation_fingerprint_of_torch_modules() -> None:
    torch = pytest.importorskip("torch")
    from batchjac.examples import seed_model

    first = computation_fingerprint(seed_model("torch"))
    retrained = seed_model("torch")
    with torch.no_grad():
        for p in retrained.parameters():
            p.mul_(-2.0)
    assert computation_fingerprint(retrained) == first
    reloaded = seed_model("torch")
    reloaded.load_state_dict({k: torch.randn_like(v) for k, v in retrained.state_dict().items()})
    assert computation_fingerprint(reloaded) == first

    def mlp(width: int, activation: type) -> Any:
        return torch.nn.Sequential(torch.nn.Linear(3, width), activation(), torch.nn.Linear(width, 1))

    base = computation_fingerprint(mlp(4, torch.nn.Tanh))
    assert computation_fingerprint(mlp(4, torch.nn.Tanh)) == base
    assert computation_fingerprint(mlp(5, torch.nn.Tanh)) != base
    assert computation_fingerprint(mlp(4, torch.nn.ReLU)) != base
    assert computation_fingerprint(mlp(4, torch.nn.Tanh).double()) != base
