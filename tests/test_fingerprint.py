"""Model fingerprints: equal for the same model rebuilt, different when anything that changes
the output changes (weights, architecture, code, closed-over values)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from batchjac._fingerprint import file_fingerprint, model_fingerprint


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
