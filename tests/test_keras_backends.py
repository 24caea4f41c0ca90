"""Keras 3 models on the JAX and PyTorch Keras backends, passed as they are: detected as JAX or
PyTorch, computed there, equal to that framework's own Jacobians, weight changes seen. Each
case runs in a fresh process (KERAS_BACKEND is read once, when Keras is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import keras
    import batchjac
    from batchjac import _backends

    keras.utils.set_random_seed(4)
    inp = keras.Input((5,))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(16, activation="tanh")(inp)))
    x = np.random.default_rng(5).normal(size=(40, 5)).astype("float32")

    if keras.config.backend() == "jax":
        import jax

        def native():  # JAX's own per-instance Jacobians of the model
            return np.asarray(jax.vmap(jax.jacrev(lambda r: model(r[None])[0]))(x))
    else:
        import torch

        def native():  # torch's own, row by row
            return np.stack([torch.autograd.functional.jacobian(
                lambda r: model(r[None])[0], torch.from_numpy(x[i])).numpy() for i in range(len(x))])

    def err(j, ref):
        return float(np.abs(np.asarray(j) - ref).max() / np.abs(ref).max())

    out = {"detected": _backends.detect(model)}
    ref = native()
    out["first"] = err(batchjac.jacobian(model, x[:, :3], x[:, 3:]), ref[:, :, :3])
    dense = model.layers[1]
    dense.kernel.assign(dense.kernel * 0.5)
    moved = native()
    out["moved"] = err(moved, ref)
    out["after"] = err(batchjac.jacobian(model, x), moved)
    try:
        batchjac.jacobian(model, x, backend="tensorflow")
    except batchjac.InputError as e:
        out["asked_tf"] = str(e)
    print(json.dumps(out))
""")


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_keras_model_on_another_keras_backend(backend: str) -> None:
    pytest.importorskip("keras")
    pytest.importorskip(backend)
    env = {**os.environ, "KERAS_BACKEND": backend}
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["detected"] == backend
    assert out["first"] < 1e-5, out
    assert out["moved"] > 0.05, out  # (the weights changed the Jacobians)
    assert out["after"] < 1e-5, out  # ... and the next call saw it
    assert f"backend={backend!r}" in out.get("asked_tf", ""), out
