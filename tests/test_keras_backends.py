"""Keras 3 models on the JAX and PyTorch Keras backends, passed as they are: detected as JAX or
PyTorch, computed there (JAX: through the model's stateless call, its variables' values the
kernel's arguments), equal to that framework's own Jacobians, Hessians and Laplacians; weight
changes seen (JAX: without a new trace); models of several inputs, by position and by name;
float64 computed where Keras keeps it and refused where Keras demotes it; a ``.keras`` file
saved under one backend computed under another by the command line (Jacobians, Hessians,
Laplacians). Each case runs in a fresh
process (KERAS_BACKEND is read once, when Keras is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import keras
    if keras.config.backend() == "jax":
        import jax
        jax.config.update("jax_enable_x64", True)  # (float64 below; float32 stays float32)
    import batchjac
    from batchjac import _backends

    keras.utils.set_random_seed(4)
    inp = keras.Input((5,))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(16, activation="tanh")(inp)))
    rng = np.random.default_rng(5)
    x = rng.normal(size=(40, 5)).astype("float32")

    if keras.config.backend() == "jax":
        import jax

        def native(f, x, order=1):  # JAX's own per-instance derivatives of a batch function
            if order == 1:
                return np.asarray(jax.vmap(jax.jacrev(lambda r: f(r[None])[0]))(x))
            return np.asarray(jax.vmap(jax.hessian(lambda r: f(r[None])[0, 0]))(x))
    else:
        import torch

        def native(f, x, order=1):  # torch's own, row by row
            d = torch.autograd.functional.jacobian if order == 1 else torch.autograd.functional.hessian
            one = (lambda r: f(r[None])[0]) if order == 1 else (lambda r: f(r[None])[0, 0])
            return np.stack([d(one, torch.from_numpy(np.asarray(x[i]))).numpy()
                             for i in range(len(x))])

    def err(j, ref):
        return float(np.abs(np.asarray(j, np.float64) - ref).max() / np.abs(ref).max())

    out = {"detected": _backends.detect(model)}
    tf_before = "tensorflow" in sys.modules
    ref = native(model, x)
    out["first"] = err(batchjac.jacobian(model, x[:, :3], x[:, 3:]), ref[:, :, :3])
    bound = next(iter(_backends._bound[model].values()))
    traces = getattr(bound, "trace_count", None)
    dense = model.layers[1]
    dense.kernel.assign(dense.kernel * 0.5)
    moved = native(model, x)
    out["moved"] = err(moved, ref)
    out["after"] = err(batchjac.jacobian(model, x[:, :3], x[:, 3:]), moved[:, :, :3])
    out["again"] = err(batchjac.jacobian(model, x[:, :3], x[:, 3:]), moved[:, :, :3])
    if traces is not None:
        out["new_traces"] = bound.trace_count - traces
    first_out = keras.Model(inp, model(inp)[:, :1])  # one output: the Hessian of it
    hess = native(first_out, x[:8], order=2)
    out["hessian"] = err(batchjac.hessian(first_out, x[:8])[:, 0], hess)
    out["laplacian"] = err(batchjac.laplacian(first_out, x[:8])[:, 0],
                           np.trace(hess, axis1=1, axis2=2))

    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    two = keras.Model([a, b], keras.layers.Dense(4, activation="tanh")(
        keras.layers.Concatenate()([a, b])))
    full = keras.Model(inp, two([inp[:, :3], inp[:, 3:]]))
    ref2 = native(full, x)
    out["tuple"] = err(batchjac.jacobian(two, (x[:, :3], x[:, 3:]), wrt=0), ref2[:, :, :3])
    out["dict"] = err(batchjac.jacobian(two, {"a": x[:, :3], "b": x[:, 3:]}, wrt="b"),
                      ref2[:, :, 3:])

    x64 = x.astype("float64")
    try:
        batchjac.jacobian(model, x64)
        out["tanh64"] = "computed"
    except (batchjac.InputError, batchjac.ModelError) as e:
        out["tanh64"] = str(e)
    soft = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(16, activation="softplus")(inp)))
    w = [np.asarray(v, np.float64) for v in soft.get_weights()]
    s = 1.0 / (1.0 + np.exp(-(x64 @ w[0] + w[1])))
    exact = np.einsum("ho,nh,ih->noi", w[2], s, w[0])
    try:
        out["softplus64"] = err(batchjac.jacobian(soft, x64), exact)
    except (batchjac.InputError, batchjac.ModelError) as e:
        out["softplus64"] = str(e)
    mixed = keras.Model(inp, keras.layers.Dense(3, dtype="mixed_bfloat16")(
        keras.layers.Dense(16, activation="tanh", dtype="mixed_bfloat16")(inp)))
    def mixed_exact():
        w = [np.asarray(v, np.float64) for v in mixed.get_weights()]
        return np.einsum("ho,nh,ih->noi", w[2], 1 - np.tanh(x @ w[0] + w[1]) ** 2, w[0])

    out["mixed"] = err(batchjac.jacobian(mixed, x), mixed_exact())
    mixed.layers[1].kernel.assign(mixed.layers[1].kernel * 0.5)  # (the clone follows it)
    out["mixed_after"] = err(batchjac.jacobian(mixed, x), mixed_exact())
    try:
        batchjac.jacobian(model, x, backend="tensorflow")
    except batchjac.InputError as e:
        out["asked_tf"] = str(e)
    out["imported_tf"] = "tensorflow" in sys.modules and not tf_before
    if len(sys.argv) > 1:  # the model saved, for the other backend to load
        model.save(sys.argv[1])
        np.save(sys.argv[1] + ".x.npy", x)
        np.save(sys.argv[1] + ".jac.npy", np.asarray(batchjac.jacobian(model, x), np.float64))
        np.save(sys.argv[1] + ".hess.npy", np.asarray(batchjac.hessian(model, x[:8]), np.float64))
        np.save(sys.argv[1] + ".x8.npy", x[:8])
    print(json.dumps(out))
""")


def _child(backend: str, *args: str, code: str = CHILD) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KERAS_BACKEND": backend}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_keras_model_on_another_keras_backend(backend: str, tmp_path: Path) -> None:
    pytest.importorskip("keras")
    pytest.importorskip(backend)
    saved = tmp_path / f"saved-under-{backend}.keras"
    run = _child(backend, str(saved))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["detected"] == backend
    assert out["first"] < 1e-5, out
    assert out["moved"] > 0.05, out  # (the weights changed the Jacobians)
    assert out["after"] < 1e-5, out  # ... and the next calls saw it
    assert out["again"] < 1e-5, out
    if backend == "jax":
        assert out["new_traces"] == 0, out  # new kernel arguments, not a new trace
    for case in ("hessian", "laplacian", "tuple", "dict"):
        assert out[case] < 1e-5, (case, out)
    # Keras demotes float64 results to float32 outside TensorFlow (its tanh among them):
    # refused, naming the way out, not float64 in name only
    assert "keras.backend.result_type" in out["tanh64"], out
    assert "KERAS_BACKEND=tensorflow" in out["tanh64"], out
    if backend == "jax":  # a model whose every step stays float64 is computed in float64
        assert isinstance(out["softplus64"], float), out
        assert out["softplus64"] < 1e-12, out
    assert f"backend={backend!r}" in out.get("asked_tf", ""), out
    # a mixed-precision model: differentiated as a float32 clone that reads the model's
    # weights (before: bfloat16 layers on PyTorch, about 5e-3 off)
    assert out["mixed"] < 1e-5, out
    assert out["mixed_after"] < 1e-5, out
    assert not out["imported_tf"], out  # (batchjac did not import TensorFlow for it)

    # the file saved under this backend, computed by the command line under the other one
    other = "torch" if backend == "jax" else "jax"
    pytest.importorskip(other)
    jac = tmp_path / "jac.npy"
    cli = textwrap.dedent("""
        import sys
        from batchjac.cli import main
        sys.argv = ["batchjac", *sys.argv[1:]]
        try:
            main()
        finally:  # computed by Keras on the configured backend: TensorFlow never imported
            print("TF-IMPORTED", "tensorflow" in sys.modules)
    """)
    run = _child(other, "compute", str(saved), "-i", f"{saved}.x.npy", "-o", str(jac), code=cli)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TF-IMPORTED False" in run.stdout, (run.stdout, run.stderr[-2000:])
    got, want = np.load(jac), np.load(f"{saved}.jac.npy")
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # its Hessians and Laplacians by the command line too, against the saving backend's
    hess = np.load(f"{saved}.hess.npy")  # (8, 3, 5, 5)
    for flag, want2 in (("--mode=auto", hess), ("--laplacian", np.trace(hess, axis1=-2, axis2=-1))):
        path = tmp_path / f"second{flag.replace('=', '-')}.npy"
        run = _child(other, "hessian", str(saved), "-i", f"{saved}.x8.npy", "-o", str(path), flag,
                     code=cli)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "TF-IMPORTED False" in run.stdout, (run.stdout, run.stderr[-2000:])
        got2 = np.load(path)
        assert got2.shape == want2.shape, (flag, got2.shape)
        assert np.abs(got2 - want2).max() <= 1e-5 * np.abs(want2).max(), flag
