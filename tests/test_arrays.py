"""Results in the caller's array kind and device (batchjac._arrays), and the device's memory
budget. No GPU here: the device plumbing is tested on the CPU device, named explicitly
(torch ``device="cpu"``, JAX arrays committed to ``jax.devices("cpu")[0]``, TensorFlow tensors
placed with ``tf.device("/CPU:0")``), and the budget selection with the device query
monkeypatched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac import _backends
from batchjac._arrays import kind_of
from batchjac._config import MIN_DEVICE_BUDGET, default_max_memory, device_budget
from batchjac.examples import WORKLOADS, mlp_forward, mlp_jacobian, mlp_weights, workload_model

from .helpers import assert_jac_close

FRAMEWORKS = ("torch", "jax", "tensorflow")
W1 = WORKLOADS["W1"]


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(seed).normal(size=(n, 8)).astype(np.float32)
    return x[:, :5].copy(), x[:, 5:].copy()


def _reference(u: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The W1 model's outputs and Jacobians in closed form (float64), from its own weights."""
    layers = mlp_weights(W1.sizes)
    x = np.concatenate([u, h], -1)
    return mlp_forward(layers, x), mlp_jacobian(layers, x)[..., :5]


def _on_cpu(fw: str) -> tuple[Callable[[np.ndarray], Any], Any, Callable[[Any], Any]]:
    """(numpy -> that framework's array on the explicit CPU device, the device, device of)"""
    if fw == "torch":
        torch = pytest.importorskip("torch")
        dev = torch.device("cpu")
        return (lambda a: torch.from_numpy(a).to(dev)), dev, (lambda t: t.device)
    if fw == "jax":
        jax = pytest.importorskip("jax")
        dev = jax.devices("cpu")[0]
        return (lambda a: jax.device_put(a, dev)), dev, \
            (lambda t: next(iter(t.devices())) if t.committed else None)
    tf = pytest.importorskip("tensorflow")
    dev = "/job:localhost/replica:0/task:0/device:CPU:0"

    def put(a: np.ndarray) -> Any:
        with tf.device("/CPU:0"):
            return tf.identity(tf.constant(a))

    return put, dev, (lambda t: t.device)


def _array_type(fw: str) -> type:
    if fw == "torch":
        import torch

        return torch.Tensor
    if fw == "jax":
        import jax

        return jax.Array
    import tensorflow as tf

    return tf.Tensor


def _host(a: Any) -> np.ndarray:
    return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("chunk_size", [None, 300])  # one chunk, and 4 chunks with padding
def test_native_in_native_out_on_the_input_device(fw: str, chunk_size: int | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # one build for both calls: a race between them (due sooner on a loaded machine, whose
    # slow calls look like more work) may choose another build, equal to ~1e-7, not bitwise
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "off")
    put, dev, device_of = _on_cpu(fw)
    model = workload_model("W1", fw)
    u, h = _data(1000, seed=11)
    y_ref, j_ref = _reference(u, h)
    y_np, j_np = batchjac.jacobian(model, u, h, return_outputs=True, chunk_size=chunk_size)
    y, jac = batchjac.jacobian(model, put(u), put(h), return_outputs=True, chunk_size=chunk_size)
    for a in (y, jac):
        assert isinstance(a, _array_type(fw)), type(a)
        assert device_of(a) == dev
        assert kind_of(a) == fw
    assert tuple(jac.shape) == (1000, 4, 5)
    assert tuple(y.shape) == (1000, 4)
    np.testing.assert_array_equal(_host(jac), j_np)  # the numpy path's numbers, exactly
    np.testing.assert_array_equal(_host(y), y_np)
    assert_jac_close(_host(jac), j_ref)
    assert_jac_close(_host(y), y_ref)
    jac_only = batchjac.jacobian(model, put(u), put(h), chunk_size=chunk_size)
    assert isinstance(jac_only, _array_type(fw))
    assert device_of(jac_only) == dev
    np.testing.assert_array_equal(_host(jac_only), j_np)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_native_columns_and_output_numpy(fw: str) -> None:
    put, _, _ = _on_cpu(fw)
    model = workload_model("W1", fw)
    u, h = _data(200, seed=12)
    x = np.concatenate([u, h], -1)
    cols = [6, 0, 3, 1, 7]  # unknowns anywhere in the row, out of order: a gather on the device
    full = mlp_jacobian(mlp_weights(W1.sizes), x)
    jac = batchjac.jacobian(model, put(x), wrt=cols, chunk_size=64)
    assert isinstance(jac, _array_type(fw))
    assert_jac_close(_host(jac), full[..., cols])
    forced = batchjac.jacobian(model, put(u), put(h), output="numpy")
    assert type(forced) is np.ndarray
    assert_jac_close(forced, _reference(u, h)[1])


@pytest.mark.parametrize(("given", "model_fw"), [("torch", "jax"), ("jax", "torch"),
                                                 ("tensorflow", "torch"), ("torch", "tensorflow")])
def test_mixed_kinds_come_back_in_the_input_kind(given: str, model_fw: str) -> None:
    put, dev, device_of = _on_cpu(given)
    model = workload_model("W1", model_fw)
    u, h = _data(300, seed=13)
    y, jac = batchjac.jacobian(model, put(u), put(h), return_outputs=True)
    for a in (y, jac):
        assert isinstance(a, _array_type(given)), type(a)
        assert device_of(a) == dev
    y_ref, j_ref = _reference(u, h)
    assert_jac_close(_host(jac), j_ref)
    assert_jac_close(_host(y), y_ref)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_output_names_a_kind(fw: str) -> None:
    model = workload_model("W1", "jax" if fw != "jax" else "torch")
    u, h = _data(50, seed=14)
    jac = batchjac.jacobian(model, u, h, output=fw)  # numpy in, that kind out
    assert isinstance(jac, _array_type(fw))
    assert_jac_close(_host(jac), _reference(u, h)[1])
    # numpy in, the model's own kind out: computed natively (kept on the framework's side)
    own = batchjac.jacobian(workload_model("W1", fw), u, h, output=fw)
    assert isinstance(own, _array_type(fw))
    assert_jac_close(_host(own), _reference(u, h)[1])


def test_bad_output_and_mixed_frameworks_are_refused() -> None:
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    model = workload_model("W1", "torch")
    u, h = _data(10, seed=15)
    with pytest.raises(batchjac.InputError, match=r"`output` must be one of .*got 'cupy'"):
        batchjac.jacobian(model, u, h, output="cupy")
    with pytest.raises(batchjac.InputError, match=r"output='torch'.* cannot be combined with `out=`"):
        batchjac.jacobian(model, u, h, output="torch", out=np.empty((10, 4, 5), np.float32))
    with pytest.raises(batchjac.InputError, match=r"mix arrays of \['jax', 'torch'\]"):
        batchjac.jacobian(model, torch.from_numpy(u), jnp.asarray(h))


def test_out_takes_host_chunks_from_tensors() -> None:
    torch = pytest.importorskip("torch")
    model = workload_model("W1", "torch")
    u, h = _data(100, seed=16)
    out = np.empty((100, 4, 5), np.float32)
    got = batchjac.jacobian(model, torch.from_numpy(u), torch.from_numpy(h), out=out, chunk_size=32)
    assert got is out
    assert_jac_close(out, _reference(u, h)[1])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_nan_is_found_on_the_device(fw: str) -> None:
    put, _, _ = _on_cpu(fw)
    model = workload_model("W1", fw)
    u, h = _data(30, seed=17)
    h[21, 1] = np.nan
    with pytest.raises(batchjac.InputError, match=r"`known` has a non-finite value \(nan\) in row 21"):
        batchjac.jacobian(model, put(u), put(h))
    jac = _host(batchjac.jacobian(model, put(u), put(h), nan_policy="propagate"))
    assert np.isnan(jac[21]).all()
    assert np.isfinite(np.delete(jac, 21, axis=0)).all()


def test_zero_jacobians_are_found_on_the_device() -> None:
    tf = pytest.importorskip("tensorflow")
    u, h = _data(40, seed=18)

    @tf.function
    def reads_known_only(x: Any) -> Any:  # gradients flow, but only zeros reach the unknowns
        return tf.tanh(x[:, 5:] * 2.0) + 0.0 * x[:, :1]

    with pytest.warns(batchjac.ZeroJacobianWarning, match="Every Jacobian entry"):
        jac = batchjac.jacobian(reads_known_only, tf.constant(u), tf.constant(h), chunk_size=16)
    assert isinstance(jac, tf.Tensor)
    assert not np.any(jac.numpy())


class _HostCopies:
    """Counts conversions of framework arrays (more than one element) to numpy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fw: str) -> None:
        self.calls: list[str] = []
        native = _array_type(fw)
        for name in ("asarray", "array", "ascontiguousarray"):
            real = getattr(np, name)

            def spy(a: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                if isinstance(a, native) and int(np.prod(a.shape)) > 1:
                    self.calls.append(f"np.{_name}")
                return _real(a, *args, **kw)

            monkeypatch.setattr(np, name, spy)
        ops = _backends.array_ops(fw)
        real_to_numpy = ops.to_numpy

        def to_numpy(a: Any) -> np.ndarray:
            self.calls.append(f"{fw} ops.to_numpy")
            return real_to_numpy(a)

        monkeypatch.setattr(ops, "to_numpy", to_numpy)
        if fw == "torch":
            import torch

            for method in ("numpy", "cpu"):
                real_method = getattr(torch.Tensor, method)

                def spy_method(t: Any, *args: Any, _real: Any = real_method, _m: str = method,
                               **kw: Any) -> Any:
                    self.calls.append(f"Tensor.{_m}")
                    return _real(t, *args, **kw)

                monkeypatch.setattr(torch.Tensor, method, spy_method)
        if fw == "tensorflow":
            from tensorflow.python.framework import ops as tf_ops

            real_numpy = tf_ops._EagerTensorBase.numpy

            def spy_numpy(t: Any) -> Any:
                self.calls.append("EagerTensor.numpy")
                return real_numpy(t)

            monkeypatch.setattr(tf_ops._EagerTensorBase, "numpy", spy_numpy)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("chunk_size", [None, 128])
def test_native_path_makes_no_host_copy(fw: str, chunk_size: int | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    put, _, _ = _on_cpu(fw)
    model = workload_model("W1", fw)
    u, h = _data(500, seed=19)
    tu, th = put(u), put(h)
    # first calls: the probes read rows on the host; a new kernel's first call may time it
    batchjac.jacobian(model, tu, th, chunk_size=chunk_size, return_outputs=True)
    copies = _HostCopies(monkeypatch, fw)
    # the spy sees what it should: the numpy path converts the kernel's results
    batchjac.jacobian(model, tu, th, chunk_size=chunk_size, return_outputs=True, output="numpy")
    assert copies.calls, "the spy saw no conversion on the numpy path: it cannot fail"
    copies.calls.clear()
    _y, jac = batchjac.jacobian(model, tu, th, chunk_size=chunk_size, return_outputs=True)
    assert copies.calls == []
    monkeypatch.undo()
    assert_jac_close(_host(jac), _reference(u, h)[1])


# -- the device --------------------------------------------------------------------------------

def test_torch_explicit_cpu_device_and_parameterless_functions() -> None:
    torch = pytest.importorskip("torch")
    model = workload_model("W1", "torch")
    u, h = _data(64, seed=20)
    jac = batchjac.jacobian(model, torch.from_numpy(u), torch.from_numpy(h),
                            backend_options={"device": "cpu"})
    assert jac.device == torch.device("cpu")
    assert_jac_close(jac.numpy(), _reference(u, h)[1])
    be = _backends.get_backend("torch")
    cuda = torch.device("cuda:0")  # (only named: nothing runs on it)
    assert be.device_options(lambda x: x, cuda, {}) == {"device": cuda}
    assert be.device_options(model, cuda, {}) == {}  # a module computes where its weights are
    assert be.device_options(lambda x: x, cuda, {"device": "cpu"}) == {"device": "cpu"}


def test_device_budget_rounds_half_the_free_memory_down() -> None:
    assert device_budget(80 * 2**30) == 32 * 2**30
    assert device_budget(80 * 2**30 + 12345) == 32 * 2**30  # stable as free memory drifts
    assert device_budget(64 * 2**30) == 32 * 2**30
    assert device_budget(1000) == MIN_DEVICE_BUDGET


def test_device_budget_yields_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHJAC_MAX_MEMORY", "300MB")
    assert default_max_memory(80 * 2**30) == 300 * 10**6
    monkeypatch.delenv("BATCHJAC_MAX_MEMORY")
    assert default_max_memory(80 * 2**30) == 32 * 2**30
    assert default_max_memory(None) == default_max_memory()  # the host's


def _plan_budget(bound: Any, spec: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    """The memory budget plan_for gives the planner for this bound model."""
    from batchjac import _bind

    seen: list[int] = []
    real = _bind.make_plan

    def spy(**kw: Any) -> Any:
        seen.append(kw["max_memory"])
        return real(**kw)

    monkeypatch.setattr(_bind, "make_plan", spy)
    bound.output_shape = (4,)
    _bind.plan_for(spec, bound, mode="auto", chunk_size=None, max_memory=None)
    monkeypatch.setattr(_bind, "make_plan", real)
    return seen[-1]


def _spec() -> Any:
    from batchjac._validate import normalize

    u, h = _data(10, seed=21)
    return normalize((u, h), wrt=None, dtype=None, nan_policy="raise")


def _signature(spec: Any) -> Any:
    return _backends.Signature(layout=spec.layout, dtype=spec.dtype,
                               unknown_shape=spec.unknown_shape, ctx=spec.ctx_specs())


def test_torch_budget_from_cuda_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from batchjac._backends.torch import TorchBound

    monkeypatch.delenv("BATCHJAC_MAX_MEMORY", raising=False)
    spec = _spec()
    asked: list[Any] = []

    def mem_get_info(device: Any) -> tuple[int, int]:
        asked.append(device)
        return 6 * 2**30 + 777, 16 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    on_gpu = TorchBound(lambda x: x, _signature(spec), device="cuda:0")
    assert _plan_budget(on_gpu, spec, monkeypatch) == 2 * 2**30  # half of 6 GiB, rounded down
    assert asked == [torch.device("cuda:0")]
    on_cpu = TorchBound(lambda x: x, _signature(spec), device="cpu")
    assert _plan_budget(on_cpu, spec, monkeypatch) == default_max_memory()  # the host's
    assert len(asked) == 1  # the CPU is never asked


class _FakeGpu:
    platform = "gpu"

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": 40 * 2**30, "bytes_in_use": 7 * 2**30}


def test_jax_budget_from_the_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("jax")
    from batchjac._backends import jax as jax_backend

    monkeypatch.delenv("BATCHJAC_MAX_MEMORY", raising=False)
    spec = _spec()
    bound = jax_backend.JaxBound(lambda x: x, _signature(spec))
    assert bound.device_free_memory() is None  # the CPU: the host's budget
    assert _plan_budget(bound, spec, monkeypatch) == default_max_memory()
    monkeypatch.setattr(jax_backend, "_default_device", lambda: _FakeGpu())
    assert bound.device_free_memory() == 33 * 2**30
    assert _plan_budget(bound, spec, monkeypatch) == 16 * 2**30


def test_tensorflow_budget_from_the_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    tf = pytest.importorskip("tensorflow")
    from batchjac._backends import tensorflow as tf_backend

    monkeypatch.delenv("BATCHJAC_MAX_MEMORY", raising=False)
    assert tf_backend._gpu_free_bytes() is None  # no GPU visible here
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: ["GPU:0"])
    monkeypatch.setattr(tf_backend, "_LIMIT", [12 * 2**30])
    monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                        lambda name: {"current": 2 * 2**30, "peak": 3 * 2**30})
    assert tf_backend._gpu_free_bytes() == 10 * 2**30
    spec = _spec()
    bound = tf_backend.TFBound(lambda x: x, _signature(spec))
    assert _plan_budget(bound, spec, monkeypatch) == 4 * 2**30


_TWO_DEVICES = """
import numpy as np, jax, batchjac
from batchjac.examples import workload_model
d1 = jax.devices()[1]
x = np.random.default_rng(22).normal(size=(100, 8)).astype(np.float32)
u, h = x[:, :5], x[:, 5:]
model = workload_model("W1", "jax")
ref = batchjac.jacobian(model, u, h)
for chunk_size in (None, 30):
    y, jac = batchjac.jacobian(model, jax.device_put(u, d1), jax.device_put(h, d1),
                               return_outputs=True, chunk_size=chunk_size)
    assert jac.devices() == {d1} and jac.committed and y.devices() == {d1}, jac.devices()
    # (close, not bitwise: a build compiled beside the first one may take over between chunks)
    assert np.abs(np.asarray(jac) - ref).max() <= 1e-5 * np.abs(ref).max(), chunk_size
    hess = batchjac.hessian(model, jax.device_put(u, d1), jax.device_put(h, d1),
                            chunk_size=chunk_size)
    assert hess.devices() == {d1} and hess.committed, hess.devices()
    assert np.allclose(np.asarray(hess), batchjac.hessian(model, u, h), rtol=1e-6, atol=1e-7)
print("ok")
"""


def test_jax_arrays_on_another_device_are_computed_there() -> None:
    """Two CPU devices (XLA's host platform split in a fresh process): arrays committed to the
    second one are computed with kernels compiled for it and come back committed to it."""
    pytest.importorskip("jax")
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _TWO_DEVICES], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_numpy_known_beside_native_unknown(fw: str) -> None:
    """A numpy `known` beside the framework's `unknown`: converted once, the result native."""
    put, dev, device_of = _on_cpu(fw)
    u, h = _data(90, seed=23)
    jac = batchjac.jacobian(workload_model("W1", fw), put(u), h, chunk_size=40)
    assert isinstance(jac, _array_type(fw))
    assert device_of(jac) == dev
    assert_jac_close(_host(jac), _reference(u, h)[1])


# -- second order: hessian, its diagonal, laplacian, hvp ---------------------------------------

def _hessian_reference(u: np.ndarray, h: np.ndarray) -> np.ndarray:
    """The W1 model's Hessians with respect to the unknowns: float64 central differences of
    its closed-form Jacobian (truncation error ~1e-10 relative)."""
    from batchjac._finite_diff import central_differences

    layers = mlp_weights(W1.sizes)
    return central_differences(
        lambda a: mlp_jacobian(layers, np.concatenate([a, h], -1))[..., :5], u)


def _assert_same(got: Any, want: np.ndarray, rtol: float = 1e-6) -> None:
    """The native path's numbers are the numpy path's (the same kernels, the same rows)."""
    np.testing.assert_allclose(_host(got), want, rtol=rtol, atol=rtol / 10 * float(np.abs(want).max()))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("chunk_size", [None, 48])  # one chunk, and 3 chunks with padding
def test_second_order_native_in_native_out_on_the_input_device(fw: str, chunk_size: int | None
                                                               ) -> None:
    put, dev, device_of = _on_cpu(fw)
    model = workload_model("W1", fw)
    u, h = _data(120, seed=31)
    v = np.random.default_rng(32).normal(size=u.shape).astype(np.float32)
    ref = _hessian_reference(u, h)
    y_ref, j_ref = _reference(u, h)
    calls: dict[str, Callable[..., Any]] = {
        "hessian": lambda *a, **kw: batchjac.hessian(model, *a, **kw),
        "diagonal": lambda *a, **kw: batchjac.hessian(model, *a, diagonal=True, **kw),
        "laplacian": lambda *a, **kw: batchjac.laplacian(model, *a, **kw),
        "hvp": lambda *a, v=v, **kw: batchjac.hvp(model, *a, v=v, **kw),
    }
    want = {"hessian": ref, "diagonal": np.diagonal(ref, axis1=-2, axis2=-1),
            "laplacian": np.trace(ref, axis1=-2, axis2=-1),
            "hvp": np.einsum("naij,nj->nai", ref, v)}
    for kind, fn in calls.items():
        extra = {"v": put(v)} if kind == "hvp" else {}
        y_np, j_np, r_np = fn(u, h, chunk_size=chunk_size, return_outputs=True,
                              return_jacobian=True)
        got = fn(put(u), put(h), chunk_size=chunk_size, return_outputs=True,
                 return_jacobian=True, **extra)
        assert len(got) == 3
        for a in got:
            assert isinstance(a, _array_type(fw)), (kind, type(a))
            assert device_of(a) == dev, kind
        y, jac, res = got
        assert tuple(res.shape) == want[kind].shape, kind
        for a, a_np in zip(got, (y_np, j_np, r_np)):
            _assert_same(a, a_np)
        assert_jac_close(_host(res), want[kind], factor=10.0)  # float32 against float64 FD
        assert_jac_close(_host(jac), j_ref)
        assert_jac_close(_host(y), y_ref)
        alone = fn(put(u), put(h), chunk_size=chunk_size, **extra)  # the result alone
        assert isinstance(alone, _array_type(fw)), kind
        assert device_of(alone) == dev, kind
        # another kernel (no Jacobian asked): it may be another build (PyTorch's forward
        # Laplacian), whose float32 sums round otherwise (measured: 1.1e-5 relative)
        _assert_same(alone, r_np, rtol=5e-5)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_second_order_output_numpy_and_mixed_kinds(fw: str) -> None:
    put, dev, device_of = _on_cpu(fw)
    u, h = _data(40, seed=33)
    ref = _hessian_reference(u, h)
    own = workload_model("W1", fw)
    forced = batchjac.hessian(own, put(u), put(h), output="numpy")
    assert type(forced) is np.ndarray
    assert_jac_close(forced, ref, factor=10.0)
    other = workload_model("W1", "torch" if fw != "torch" else "jax")
    lap = batchjac.laplacian(other, put(u), put(h))  # converted once each way
    assert isinstance(lap, _array_type(fw))
    assert device_of(lap) == dev
    assert_jac_close(_host(lap), np.trace(ref, axis1=-2, axis2=-1), factor=10.0)
    asked = batchjac.hessian(other, u, h, diagonal=True, output=fw)  # numpy in, that kind out
    assert isinstance(asked, _array_type(fw))
    assert_jac_close(_host(asked), np.diagonal(ref, axis1=-2, axis2=-1), factor=10.0)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_hvp_tangents_are_checked_on_the_device(fw: str) -> None:
    put, _, _ = _on_cpu(fw)
    model = workload_model("W1", fw)
    u, h = _data(20, seed=34)
    v = np.random.default_rng(35).normal(size=u.shape).astype(np.float32)
    v[7, 2] = np.inf
    with pytest.raises(batchjac.InputError, match=r"`v` has a non-finite value \(inf\) in row 7"):
        batchjac.hvp(model, put(u), put(h), v=put(v))
    v[7, 2] = 0.5
    mixed = batchjac.hvp(model, put(u), put(h), v=v)  # a numpy v beside native inputs
    assert isinstance(mixed, _array_type(fw))
    _assert_same(mixed, batchjac.hvp(model, u, h, v=v))
    with pytest.raises(batchjac.InputError, match=r"`v` has shape \(20, 4\), but the unknowns "
                                                  r"have shape \(20, 5\)"):
        batchjac.hvp(model, put(u), put(h), v=put(v[:, :4].copy()))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("chunk_size", [None, 64])
def test_second_order_native_path_makes_no_host_copy(fw: str, chunk_size: int | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    put, _, _ = _on_cpu(fw)
    model = workload_model("W1", fw)
    u, h = _data(200, seed=36)
    tu, th = put(u), put(h)
    batchjac.hessian(model, tu, th, chunk_size=chunk_size, return_outputs=True)  # probes, races
    copies = _HostCopies(monkeypatch, fw)
    batchjac.hessian(model, tu, th, chunk_size=chunk_size, return_outputs=True, output="numpy")
    assert copies.calls, "the spy saw no conversion on the numpy path: it cannot fail"
    copies.calls.clear()
    _y, hess = batchjac.hessian(model, tu, th, chunk_size=chunk_size, return_outputs=True)
    assert copies.calls == []
    monkeypatch.undo()
    assert_jac_close(_host(hess), _hessian_reference(u, h), factor=10.0)


# -- the verbs built on Jacobians: solution arrays in the inputs' kind, reports in numpy --------

def _assert_delivered(got: Any, want: np.ndarray) -> None:
    """``got`` holds the host result ``want``: the same numbers (to float32 rounding), in the
    same dtype, except
    float64 into JAX without x64 mode, which holds no float64 (float32 there, as jnp.asarray
    makes it: rounding far below the float32 computation's own)."""
    host = _host(got)
    if host.dtype != want.dtype:
        import jax

        assert kind_of(got) == "jax", (host.dtype, want.dtype)
        assert not jax.config.jax_enable_x64
        assert (host.dtype, want.dtype) == (np.float32, np.float64)
    # to float32 rounding, not bitwise: two calls of one model may run different builds of
    # its kernel (JAX's quick first build, then the steady one, then a race's winner)
    finite = np.abs(want[np.isfinite(want)])
    scale = float(finite.max()) if finite.size else 0.0
    np.testing.assert_allclose(host, want, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_solve_gives_the_solution_in_the_inputs_kind(fw: str) -> None:
    put, dev, device_of = _on_cpu(fw)
    w3 = WORKLOADS["W3"]  # 4 unknowns + 4 known -> 512 outputs: identifiable
    layers = mlp_weights(w3.sizes)
    r = np.random.default_rng(37)
    x_true = r.uniform(-1, 1, (30, 4)).astype(np.float32)
    known = r.normal(size=(30, 4)).astype(np.float32)
    targets = mlp_forward(layers, np.concatenate([x_true, known], -1)).astype(np.float32)
    model = workload_model("W3", fw)
    kw = {"return_jacobian": True, "return_covariance": True}
    ref = batchjac.solve(model, targets, known, x0=np.zeros_like(x_true), **kw)
    got = batchjac.solve(model, put(targets), put(known), x0=put(np.zeros_like(x_true)), **kw)
    for a in (got.x, got.jacobian, got.covariance):
        assert isinstance(a, _array_type(fw)), type(a)
        assert device_of(a) == dev
    for a in (got.status, got.success, got.residual, got.cost):  # the diagnostics: a report
        assert type(a) is np.ndarray
    assert got.success.all()
    _assert_delivered(got.x, ref.x)  # the same host iterations
    _assert_delivered(got.jacobian, ref.jacobian)
    # (the covariance of a fit without residual is rounding: s^2 ~ 1e-30 times (J^T J)^-1; two
    # builds of the kernel give two roundings. Its kind and place are checked above)
    assert _host(got.covariance).shape == ref.covariance.shape
    np.testing.assert_array_equal(got.status, ref.status)
    np.testing.assert_allclose(_host(got.x), x_true, atol=2e-3)  # the unknowns that made them
    assert "n=30" in repr(got)
    forced = batchjac.solve(model, put(targets), put(known), x0=put(np.zeros_like(x_true)),
                            output="numpy")
    assert type(forced.x) is np.ndarray
    _assert_delivered(forced.x, ref.x)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_propagate_gives_mean_and_cov_in_the_inputs_kind(fw: str) -> None:
    put, dev, device_of = _on_cpu(fw)
    u, h = _data(60, seed=38)
    std = np.array([0.1, 0.02, 0.3, 0.05, 0.2])
    y_ref, j_ref = _reference(u, h)
    cov_ref = np.einsum("nak,k,nbk->nab", j_ref, std**2, j_ref)  # J diag(s^2) J^T
    model = workload_model("W1", fw)
    ref = batchjac.propagate(model, u, h, std=std)
    got = batchjac.propagate(model, put(u), put(h), std=std)
    for a in (got.mean, got.cov, got.std):
        assert isinstance(a, _array_type(fw)), type(a)
        assert device_of(a) == dev
    _assert_delivered(got.mean, ref.mean)
    _assert_delivered(got.cov, ref.cov)
    _assert_delivered(got.std, ref.std)
    assert_jac_close(_host(got.mean), y_ref, dtype=np.float32)  # (float64 of float32 outputs)
    np.testing.assert_allclose(_host(got.cov), cov_ref, rtol=1e-4,
                               atol=1e-6 * float(np.abs(cov_ref).max()))
    second = batchjac.propagate(model, put(u), put(h), std=std, order=2)
    assert isinstance(second.mean, _array_type(fw))
    assert device_of(second.cov) == dev
    forced = batchjac.propagate(model, put(u), put(h), std=std, output="numpy")
    assert type(forced.mean) is np.ndarray
    assert type(forced.std) is np.ndarray


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_reports_read_native_arrays_and_stay_numpy(fw: str) -> None:
    """check and sensitivity take the framework's arrays (jacobian's native result) and give
    the report the numpy inputs give; elasticities, per-instance arrays, keep jac's kind."""
    put, dev, device_of = _on_cpu(fw)
    model = workload_model("W1", fw)
    u, h = _data(80, seed=39)
    y, jac = batchjac.jacobian(model, put(u), put(h), return_outputs=True)
    y_np, j_np = _host(y), _host(jac)
    s_native = batchjac.sensitivity(jac, put(u), y)
    s_numpy = batchjac.sensitivity(j_np, u, y_np)
    for name in ("mean_abs", "mean", "elasticity", "scaled"):
        got = getattr(s_native, name)
        assert type(got) is np.ndarray, name
        np.testing.assert_array_equal(got, getattr(s_numpy, name))
    assert_jac_close(s_native.mean_abs, np.abs(_reference(u, h)[1]).mean(0), dtype=np.float32)
    e = batchjac.elasticities(jac, put(u), y)
    assert isinstance(e, _array_type(fw))
    assert device_of(e) == dev
    _assert_delivered(e, batchjac.elasticities(j_np, u, y_np))
    rep_native = batchjac.check(model, put(u), put(h), sample=10)
    rep_numpy = batchjac.check(model, u, h, sample=10)
    assert rep_native.passed
    assert type(rep_native.max_rel_error) is np.ndarray
    np.testing.assert_array_equal(rep_native.instances, rep_numpy.instances)
    # (to 1e-6 absolute: a build compiled beside the first may compute one of the two calls,
    # which moves float32 Jacobians by an ulp, and these errors by as much)
    np.testing.assert_allclose(rep_native.max_rel_error, rep_numpy.max_rel_error, rtol=0, atol=1e-6)
    hess_native = batchjac.check_hessian(model, put(u), put(h), sample=5)
    hess_numpy = batchjac.check_hessian(model, u, h, sample=5)
    assert hess_native.passed
    # (the Hessians' finite differences amplify those ulps: the errors agree in size only)
    np.testing.assert_allclose(hess_native.max_rel_error, hess_numpy.max_rel_error, rtol=0,
                               atol=2e-4)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_all_finite_on_the_device_is_exact(fw: str) -> None:
    """The NaN/Inf check of native inputs (one sum, entry by entry only when the sum is not
    finite): every kind of non-finite entry is found, and finite entries whose sum overflows
    are finite."""
    put, _, _ = _on_cpu(fw)
    ops = _backends.array_ops(fw)
    r = np.random.default_rng(44)
    a = r.normal(size=(300, 7)).astype(np.float32)
    assert ops.all_finite(put(a))
    for bad in ([np.nan], [np.inf], [-np.inf], [np.inf, -np.inf]):
        b = a.copy()
        for v in bad:
            b[tuple(r.integers(0, s) for s in b.shape)] = v
        assert not ops.all_finite(put(b)), bad
    huge = np.full((4, 3), 3e38, np.float32)  # finite, but their sum overflows float32
    assert ops.all_finite(put(huge))
    huge[2, 1] = np.nan
    assert not ops.all_finite(put(huge))
    assert ops.all_finite(put(np.arange(12, dtype=np.int32).reshape(4, 3)))


# -- chunk results written into one result on the device (ArrayOps.buffer) ----------------------
def _native_reference(fw: str, model: Any, x: np.ndarray) -> np.ndarray:
    """The framework's own per-instance Jacobians: ``jax.vmap(jax.jacrev)`` or torch.func's
    ``vmap(jacrev)`` of the model on one row, in float64 where the framework can."""
    if fw == "jax":
        import jax

        return np.asarray(jax.vmap(jax.jacrev(lambda r: model(r[None])[0]))(x))
    import torch
    from torch.func import jacrev, vmap

    with torch.no_grad():
        return vmap(jacrev(lambda r: model(r[None])[0]))(torch.from_numpy(x)).numpy()


class _Seen:
    """What a native call did with its chunk results: the buffers it asked for (and the memory
    each one's result took), and the joins."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fw: str) -> None:
        self.buffers: list[Any] = []
        self.memory: list[int] = []
        self.joins = 0
        ops = type(_backends.array_ops(fw))
        buffer, sealed, concat = ops.buffer, ops.sealed, ops.concat

        def spy_buffer(xp: Any, like: Any, shape: tuple[int, ...], host: Any) -> Any:
            made = buffer(xp, like, shape, host)
            self.buffers.append(made)
            return made

        def spy_sealed(xp: Any, made: Any) -> Any:
            self.memory.append(made.array.ctypes.data if fw == "jax" else made.data_ptr())
            return sealed(xp, made)

        def spy_concat(xp: Any, parts: list[Any]) -> Any:
            self.joins += 1
            return concat(xp, parts)

        monkeypatch.setattr(ops, "buffer", spy_buffer)
        monkeypatch.setattr(ops, "sealed", spy_sealed)
        monkeypatch.setattr(ops, "concat", spy_concat)


def _memory_of(fw: str, a: Any) -> int:
    return a.unsafe_buffer_pointer() if fw == "jax" else a.data_ptr()


@pytest.mark.parametrize("fw", ["jax", "torch"])
@pytest.mark.parametrize("chunk_size", [None, 96])  # one chunk; 11 chunks, the last one padded
def test_native_chunks_are_written_into_one_result(fw: str, chunk_size: int | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Several chunks: each is written into one result as it comes (a torch tensor; on the
    CPU, host memory that becomes the JAX array without a copy), never kept and joined; one
    chunk: the kernel's own array. Values against the framework's own vmap(jacrev)."""
    import gc

    put, dev, device_of = _on_cpu(fw)
    model = workload_model("W1", fw)
    x = np.random.default_rng(31).normal(size=(1000, 8)).astype(np.float32)
    ref = _native_reference(fw, model, x)
    seen = _Seen(monkeypatch, fw)
    y, jac = batchjac.jacobian(model, put(x), chunk_size=chunk_size, return_outputs=True)
    assert seen.joins == 0
    for a in (y, jac):
        assert isinstance(a, _array_type(fw))
        assert device_of(a) == dev
    if chunk_size is None:
        assert seen.buffers == []  # (1,000 rows fit one chunk, below the ladder's 1,024)
    else:
        assert len(seen.buffers) == 2  # the outputs' and the Jacobians'
        assert all(b is not None for b in seen.buffers)
        # the result IS the buffer written into: no copy when it was handed out
        assert sorted(seen.memory) == sorted(_memory_of(fw, a) for a in (y, jac))
    gc.collect()  # (the JAX array keeps the host memory it took alive)
    assert tuple(jac.shape) == (1000, 4, 8)
    assert_jac_close(_host(jac), ref)
    np.testing.assert_allclose(_host(y), mlp_forward(mlp_weights(W1.sizes), x), rtol=1e-5,
                               atol=1e-6)


def test_a_kind_without_a_buffer_is_joined_once() -> None:
    """Where a kind cannot be written in place (TensorFlow's tensors, JAX off the CPU), the
    chunks are kept and joined with one concat per result; a chunk of all the rows is
    returned as it is, not copied."""
    from batchjac._arrays import ChunkSink
    from batchjac._xp import NumpyOps

    class Immutable(NumpyOps):
        kind = "immutable"

        def __init__(self) -> None:
            self.joins = 0

        def buffer(self, like: Any, shape: tuple[int, ...], host: Any) -> Any:
            return None

        def concat(self, parts: list[Any]) -> Any:
            self.joins += 1
            return super().concat(parts)

    rng = np.random.default_rng(5)
    whole = rng.normal(size=(10, 3))
    xp = Immutable()
    sink = ChunkSink(xp, {"jacobians": (10, 3)})
    for lo in range(0, 10, 4):
        sink.write(lo, min(lo + 4, 10), {"jacobians": whole[lo:lo + 4]})
    np.testing.assert_array_equal(sink.finish("jacobians"), whole)
    assert xp.joins == 1
    one = ChunkSink(xp, {"jacobians": (10, 3)})
    one.write(0, 10, {"jacobians": whole})
    assert one.finish("jacobians") is whole
    assert xp.joins == 1
    written = ChunkSink(NumpyOps(), {"jacobians": (10, 3)})  # a kind with a buffer: filled
    for lo in range(0, 10, 4):
        written.write(lo, min(lo + 4, 10), {"jacobians": whole[lo:lo + 4]})
    assert written.buffers["jacobians"] is not None
    np.testing.assert_array_equal(written.finish("jacobians"), whole)


def _misaligned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A host allocation 16 bytes off the buffer's alignment."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 256, np.uint8)
    start = (-raw.ctypes.data % 128) + 16
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@pytest.mark.parametrize("alloc", ["empty", "mapping", "misaligned"])
def test_jax_host_buffer_is_aligned_and_taken_without_a_copy(
        alloc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host memory a CPU JAX result is written into becomes the JAX array without a copy,
    whichever way it was allocated: np.empty, a populated mapping (``new_result`` of a large
    result), or an allocation off the alignment (allocated again, aligned)."""
    jax = pytest.importorskip("jax")
    from batchjac import _sinks
    from batchjac._backends.jax import OPS

    if alloc == "mapping":
        monkeypatch.setattr(_sinks, "POPULATE_BYTES", 0)  # (every result a mapping)
    host = _misaligned if alloc == "misaligned" else _sinks.new_result
    dev = jax.devices("cpu")[0]
    like = jax.device_put(np.zeros((2, 3), np.float32), dev)
    made = OPS.buffer(like, (7, 3), host)
    assert made.array.ctypes.data % made.ALIGN == 0
    data = np.random.default_rng(8).normal(size=(7, 3)).astype(np.float32)
    OPS.write(made, 0, jax.device_put(data[:4], dev))
    OPS.write(made, 4, jax.device_put(data[4:], dev))
    where = made.array.ctypes.data
    out = OPS.sealed(made)
    assert out.unsafe_buffer_pointer() == where
    assert out.committed
    assert out.devices() == {dev}
    del made
    import gc

    gc.collect()
    np.testing.assert_array_equal(np.asarray(out), data)
