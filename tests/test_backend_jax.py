"""JAX backend: the conformance suite plus JAX-specific model kinds, options and errors.

float64 needs JAX's x64 mode. Tests that use it switch it on in a context (thread-local, undone
on exit), so the setting never leaks into other test modules.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, ClassVar

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import batchjac  # noqa: E402
from batchjac import _backends  # noqa: E402
from batchjac._backends._base import made_beside  # noqa: E402
from batchjac._examples import jax as jax_examples  # noqa: E402
from batchjac._tune.races import MODE_RUNS  # noqa: E402
from batchjac.examples import (  # noqa: E402
    mlp_forward,
    mlp_jacobian,
    mlp_weights,
    seed_model,
    workload_inputs,
    workload_model,
)

from .conformance import SEED_SIZES, BackendConformance  # noqa: E402
from .helpers import (  # noqa: E402
    all_compiled,
    assert_jac_close,
    central_differences,
    jax_x64,
    race_now,
    run_in_fresh_process,
)

x64 = jax_x64


def needs_build(build: str) -> None:
    """Skip where this XLA refuses the options of the first-order build ``build``: jaxlib 0.4.36
    knows neither YNNPACK's fusion type ("no-ynnpack") nor the fusion emitters ("quick"), and
    its kernels compile XLA's defaults in their place (tests/test_compat_jax.py checks that)."""
    from importlib.metadata import version

    from batchjac._backends.jax import compat

    if not compat.xla_accepts(compat.BUILDS[build]):  # (the reason: tests/conftest.py EXPECTED_SKIPS)
        pytest.skip(f"this XLA (jaxlib {version('jaxlib')}) refuses the {build!r} build's "
                    f"options {compat.BUILDS[build]}: no such build to test")


def data(shape: tuple[int, ...], seed: int, dtype: str = "float32") -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, shape).astype(dtype)


def bound_of(model: Any, dtype: Any = np.float32) -> Any:
    return next(b for b in _backends._bound[model].values() if b.signature.dtype == dtype)


class TestJaxConformance(BackendConformance):
    backend: ClassVar[str] = "jax"
    # the backend walks the jaxpr of the forward-mode derivative: no path -> NotConnectedError
    detects_disconnected: ClassVar[bool] = True

    def mlp(self, sizes: tuple[int, ...], dtype: str) -> Any:
        return jax_examples.mlp(sizes, dtype=dtype)

    def linear(self, w: np.ndarray, b: np.ndarray, dtype: str) -> Any:
        wj, bj = jnp.asarray(w.astype(dtype)), jnp.asarray(b.astype(dtype))
        return lambda x: x @ wj + bj

    def linear_3d(self, w: np.ndarray, dtype: str, out_shape: tuple[int, int]) -> Any:
        wj = jnp.asarray(w.astype(dtype))
        return lambda x: (x @ wj).reshape(x.shape[0], *out_shape)

    def elementwise(self, dtype: str) -> Any:
        return lambda x: jnp.sin(x) + 0.5 * x**2

    def two_input(self, wx: np.ndarray, wh: np.ndarray, dtype: str, as_dict: bool) -> Any:
        wxj, whj = jnp.asarray(wx.astype(dtype)), jnp.asarray(wh.astype(dtype))

        def f(x: Any, h: Any) -> Any:  # positional or keywords x=, h=: the same function
            return jnp.tanh(x @ wxj + h @ whj)

        return f

    def disconnected(self, dtype: str) -> Any:
        return lambda x: jnp.ones((x.shape[0], 3), x.dtype) * 2.0

    def batch_coupled(self, dtype: str) -> Any:
        return lambda x: x - x.mean(axis=0, keepdims=True)

    def float64(self) -> contextlib.AbstractContextManager[Any]:
        return x64()


# ---- float64 references ---------------------------------------------------------------------


def _smooth(x: Any, w: Any, xp: Any) -> Any:
    """A non-MLP batch function with a (N, 2, 3) output: products, sin, exp."""
    z = xp.sin(x @ w) * x[:, :1] ** 2 + xp.exp(0.3 * x[:, 1:2])
    return z.reshape(x.shape[0], 2, 3)


def _smooth_case(seed: int, rows: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """A new JAX model of :func:`_smooth` (4 inputs, its weights drawn with ``seed``), ``rows``
    inputs (drawn with ``seed + 1``) and its float64 central differences there."""
    w = data((4, 6), seed=seed)
    x = data((rows, 4), seed=seed + 1)

    def model(v: Any) -> Any:
        return _smooth(v, jnp.asarray(w), jnp)

    return model, x, central_differences(lambda v: _smooth(v, w.astype(np.float64), np), x)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_float64_against_finite_differences(mode: str, chunk_size: int | None) -> None:
    w = data((4, 6), seed=1, dtype="float64")
    x = data((30, 4), seed=2, dtype="float64")
    ref = central_differences(lambda v: _smooth(v, w, np), x)
    with x64():
        wj = jnp.asarray(w)
        jac = batchjac.jacobian(lambda v: _smooth(v, wj, jnp), x, mode=mode,
                                chunk_size=chunk_size)
    assert jac.dtype == np.float64
    assert jac.shape == (30, 2, 3, 4)
    assert_jac_close(jac, ref)  # 1e-8


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_both_kernel_builds_agree_with_finite_differences(mode: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's two CPU builds (YNNPACK dots or XLA's own) compute the same Jacobians from
    one trace; the first call times them unless BATCHJAC_AUTOTUNE=off (then "default")."""
    needs_build("no-ynnpack")
    model, x, ref = _smooth_case(5, 40)
    with monkeypatch.context() as patch:
        race_now(patch)  # a job large enough to repay the race
        batchjac.jacobian(model, x, mode=mode)
    bound = bound_of(model)
    kernel = bound.kernel(mode, 40, False)
    assert kernel.variants == ("default", "no-ynnpack")
    assert kernel.variant in kernel.variants
    assert "timed one chunk" in kernel.note
    traces = bound.trace_count
    for variant in kernel.variants:
        kernel.use(variant)
        _, jac = kernel(x, ())
        assert_jac_close(jac, ref)  # 1e-4
    assert bound.trace_count == traces  # both builds compile the one trace
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "off")
    fresh = bound.kernel(mode, 20, False)
    fresh(x[:20], ())
    assert fresh.variant == "default"
    assert "not timed" in fresh.note


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_float32_against_finite_differences(mode: str) -> None:
    w = data((4, 6), seed=3)
    x = data((25, 4), seed=4)
    ref = central_differences(lambda v: _smooth(v, w.astype(np.float64), np), x)
    jac = batchjac.jacobian(lambda v: _smooth(v, jnp.asarray(w), jnp), x, mode=mode,
                            chunk_size=10)
    assert jac.dtype == np.float32
    assert_jac_close(jac, ref)  # 1e-4


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_float64_seed_model_chunked(mode: str) -> None:
    unknown, known = workload_inputs("W1", 1000, seed=5, dtype=np.float64)
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    with x64():
        model = seed_model("jax", dtype="float64")
        y, jac = batchjac.jacobian(model, unknown, known, mode=mode, chunk_size=300,
                                   return_outputs=True)
    assert_jac_close(jac, ref)
    np.testing.assert_allclose(y, mlp_forward(mlp_weights(SEED_SIZES),
                                              np.concatenate([unknown, known], 1)), rtol=1e-12)


def test_float64_without_x64_is_refused_with_the_fix() -> None:
    model = seed_model("jax")
    x = data((5, 8), seed=6, dtype="float64")
    with pytest.raises(batchjac.InputError, match=r'jax.config.update\("jax_enable_x64", True\)'):
        batchjac.jacobian(model, x)
    with pytest.raises(batchjac.InputError, match="x64 mode"):
        batchjac.jacobian(model, x.astype(np.float32), dtype="float64")
    assert batchjac.jacobian(model, x, dtype="float32").dtype == np.float32


def test_x64_state_is_checked_on_every_call() -> None:
    model = seed_model("jax")
    x = data((6, 8), seed=7)
    with x64():
        batchjac.jacobian(model, x.astype(np.float64))  # bound and compiled in x64 mode
        batchjac.jacobian(model, x)
    with pytest.raises(batchjac.InputError, match="x64 mode is off"):
        batchjac.jacobian(model, x.astype(np.float64))  # the cached float64 binding
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), x)
    assert_jac_close(batchjac.jacobian(model, x), ref)  # float32 after leaving x64: retraced


# ---- model kinds and options ----------------------------------------------------------------


def _params_mlp(params: Any, x: Any) -> Any:
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return h


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_params_option(mode: str) -> None:
    layers = mlp_weights(SEED_SIZES, seed=3)
    params = [(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32)) for w, b in layers]
    x = data((40, 8), seed=8)
    jac = batchjac.jacobian(_params_mlp, x, wrt=[0, 3, 7], mode=mode,
                            backend_options={"params": params})
    assert_jac_close(jac, mlp_jacobian(layers, x)[:, :, [0, 3, 7]])
    # new params of the same structure: the new Jacobian, never the cached one
    traces = bound_of(_params_mlp).trace_count
    doubled = jax.tree_util.tree_map(lambda a: 2 * a, params)
    layers2 = [(2 * w, 2 * b) for w, b in layers]
    jac2 = batchjac.jacobian(_params_mlp, x, wrt=[0, 3, 7], mode=mode,
                             backend_options={"params": doubled})
    assert_jac_close(jac2, mlp_jacobian(layers2, x)[:, :, [0, 3, 7]])
    assert bound_of(_params_mlp).trace_count == traces  # params are kernel arguments


def test_float32_params_in_float64() -> None:
    layers = mlp_weights(SEED_SIZES, seed=4)
    params = [(w.astype(np.float32), b.astype(np.float32)) for w, b in layers]  # numpy leaves
    x = data((12, 8), seed=9, dtype="float64")
    layers32 = [(w.astype(np.float64), b.astype(np.float64)) for w, b in params]
    with x64():
        jac = batchjac.jacobian(_params_mlp, x, backend_options={"params": params})
    assert jac.dtype == np.float64
    assert_jac_close(jac, mlp_jacobian(layers32, x))  # float64 on the float32-rounded weights


def _per_instance_mlp(layers: list[tuple[Any, Any]]) -> Any:
    def one(x: Any) -> Any:  # x: (in,) -> (out,), one instance; fails on a batch
        if x.ndim != 1:
            raise ValueError(f"one instance of shape (in,) expected, got shape {x.shape}")
        return _params_mlp(layers, x)

    return one


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_per_instance_option(mode: str) -> None:
    layers = mlp_weights(SEED_SIZES, seed=5)
    one = _per_instance_mlp([(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32))
                             for w, b in layers])
    x = data((33, 8), seed=10)
    y, jac = batchjac.jacobian(one, x[:, :5], x[:, 5:], mode=mode, chunk_size=10,
                               return_outputs=True, backend_options={"per_instance": True})
    assert_jac_close(jac, mlp_jacobian(layers, x)[:, :, :5])
    np.testing.assert_allclose(y, mlp_forward(layers, x), rtol=1e-4, atol=1e-5)
    with pytest.raises(batchjac.ModelError, match=r"'per_instance': True"):
        batchjac.jacobian(one, x[:, :5], x[:, 5:], mode=mode)  # a batch given to it


def _equinox_mlp() -> tuple[Any, list[tuple[np.ndarray, np.ndarray]]]:
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(8, 4, width_size=16, depth=2, activation=jnp.tanh,
                       key=jax.random.PRNGKey(0))
    layers = [(np.asarray(lin.weight, np.float64).T, np.asarray(lin.bias, np.float64))
              for lin in model.layers]
    return model, layers


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_equinox_module_per_instance(mode: str) -> None:
    model, layers = _equinox_mlp()
    x = data((21, 8), seed=11)
    jac = batchjac.jacobian(model, x, wrt=slice(2, 8), mode=mode,
                            backend_options={"per_instance": True})  # backend detected
    assert_jac_close(jac, mlp_jacobian(layers, x)[:, :, 2:])
    with x64():  # float32 module, float64 compute: its weights are cast inside the kernel
        jac64 = batchjac.jacobian(model, x.astype(np.float64), mode=mode,
                                  backend_options={"per_instance": True})
    assert jac64.dtype == np.float64
    assert_jac_close(jac64, mlp_jacobian(layers, x.astype(np.float64)))


def test_equinox_module_is_told_per_instance_without_being_asked() -> None:
    """An Equinox module maps one instance per call (Equinox's convention): detected by its
    shapes, without ``per_instance`` (before: an error that asked for it). A batch function in
    an Equinox module stays a batch function; ``per_instance=False`` is obeyed."""
    eqx = pytest.importorskip("equinox")
    model, _ = _equinox_mlp()
    x = data((6, 8), seed=12)
    jac = batchjac.jacobian(model, x[:, :6], x[:, 6:])  # unknowns, then the known columns
    ref = np.asarray(jax.vmap(jax.jacrev(model))(jnp.asarray(x)))
    assert_jac_close(jac, ref[:, :, :6], np.float32)

    class Batched(eqx.Module):  # its own batch axis: x @ W, rows apart
        w: Any

        def __call__(self, x: Any) -> Any:
            return jnp.tanh(x @ self.w)

    batched = Batched(jnp.asarray(data((8, 3), seed=13)))
    ref = np.asarray(jax.vmap(jax.jacrev(lambda r: batched(r[None])[0]))(jnp.asarray(x)))
    assert_jac_close(batchjac.jacobian(batched, x), ref, np.float32)
    with pytest.raises(batchjac.ModelError, match=r"backend_options=\{'per_instance': True\}"):
        batchjac.jacobian(model, x, backend_options={"per_instance": False})


def _jax_jacobians(f: Any, x: np.ndarray) -> np.ndarray:
    """The framework's own per-instance Jacobians of a batch function ``f``."""
    return np.asarray(jax.vmap(jax.jacrev(lambda r: f(r[None])[0]))(jnp.asarray(x)))


def test_flax_nnx_module_sees_its_weights_changed() -> None:
    """An ``nnx.Module`` as users hold it: detected as JAX, its Jacobians and Hessians equal
    JAX's own; a weight changed in place (``kernel[...] = ...``) or a layer replaced by one
    of the same shapes is seen by the next call (before: the old Jacobians, bit for bit), the
    first without a new trace (its arrays are the kernels' arguments)."""
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Sequential(nnx.Linear(4, 16, rngs=nnx.Rngs(0)), jnp.tanh,
                           nnx.Linear(16, 3, rngs=nnx.Rngs(1)))
    x = data((40, 4), seed=61)
    first = batchjac.jacobian(model, x)
    assert_jac_close(first, _jax_jacobians(model, x))
    bound = next(iter(_backends._bound[model].values()))
    traces = bound.trace_count
    model.layers[0].kernel[...] = model.layers[0].kernel[...] * 0.5
    changed = batchjac.jacobian(model, x)
    assert_jac_close(changed, _jax_jacobians(model, x))
    assert np.abs(changed - first).max() > 0.1 * np.abs(first).max()
    assert bound.trace_count == traces  # new arguments, no new trace
    model.layers[2] = nnx.Linear(16, 3, rngs=nnx.Rngs(7))  # a new layer, the same shapes
    assert_jac_close(batchjac.jacobian(model, x), _jax_jacobians(model, x))
    hess = batchjac.hessian(model, x[:8])
    ref = jax.vmap(jax.hessian(lambda r: model(r[None])[0]))(jnp.asarray(x[:8]))
    assert_jac_close(hess, np.asarray(ref))


def test_flax_linen_module_with_its_variables() -> None:
    """A Flax Linen module with its variables (``backend_options={'params': variables}``) or
    bound to them (``module.bind(variables)``) gives JAX's own Jacobians; without them, an
    error that says how to pass them (before: flax's CallCompactUnboundModuleError)."""
    linen = pytest.importorskip("flax.linen")

    class MLP(linen.Module):
        @linen.compact
        def __call__(self, x: Any) -> Any:
            return linen.Dense(3)(jnp.tanh(linen.Dense(16)(x)))

    module = MLP()
    x = data((30, 5), seed=62)
    variables = module.init(jax.random.PRNGKey(3), jnp.asarray(x[:1]))
    ref = _jax_jacobians(lambda z: module.apply(variables, z), x)
    assert_jac_close(batchjac.jacobian(module, x[:, :2], x[:, 2:],
                                       backend_options={"params": variables}), ref[:, :, :2])
    assert_jac_close(batchjac.jacobian(module.bind(variables), x), ref)
    with pytest.raises(batchjac.InputError, match=r"backend_options=\{'params': variables\}"):
        batchjac.jacobian(MLP(), x)
    with pytest.raises(batchjac.InputError, match="bound to its variables already"):
        batchjac.jacobian(module.bind(variables), x, backend_options={"params": variables})


def test_haiku_transformed_functions_with_their_params() -> None:
    """A Haiku transformed function as users hold it (``hk.transform``, ``without_apply_rng``,
    ``transform_with_state``) with its params (and state): detected as JAX, no ``backend=``,
    Jacobians and Hessians equal JAX's own of its apply; a new params tree of the same
    structure is seen. Its bare ``apply`` (which wants an RNG) gets a hint, not only Haiku's
    error; and the no-RNG apply function alone is detected as JAX (before: "Cannot tell which
    framework")."""
    hk = pytest.importorskip("haiku")

    def net(x: Any) -> Any:
        return hk.nets.MLP([16, 3], activation=jnp.tanh)(x)

    def counting(x: Any) -> Any:  # state beside the output: a call counter
        hk.set_state("calls", hk.get_state("calls", (), jnp.int32, init=jnp.zeros) + 1)
        return net(x) * 2.0

    x = data((20, 5), seed=63)
    plain = hk.transform(net)
    params = plain.init(jax.random.PRNGKey(4), jnp.asarray(x[:1]))
    ref = _jax_jacobians(lambda z: plain.apply(params, None, z), x)
    assert_jac_close(batchjac.jacobian(plain, x, backend_options={"params": params}), ref)
    no_rng = hk.without_apply_rng(plain)
    assert_jac_close(batchjac.jacobian(no_rng, x[:, :3], x[:, 3:],
                                       backend_options={"params": params}), ref[:, :, :3])
    assert_jac_close(batchjac.jacobian(no_rng.apply, x, backend_options={"params": params}), ref)
    other = jax.tree_util.tree_map(lambda a: a * 0.5, params)  # new values, same structure
    assert_jac_close(batchjac.jacobian(plain, x, backend_options={"params": other}),
                     _jax_jacobians(lambda z: plain.apply(other, None, z), x))
    hess = batchjac.hessian(plain, x[:6], backend_options={"params": params})
    href = jax.vmap(jax.hessian(lambda r: plain.apply(params, None, r[None])[0]))(
        jnp.asarray(x[:6]))
    assert_jac_close(hess, np.asarray(href))

    stateful = hk.transform_with_state(counting)
    sparams, state = stateful.init(jax.random.PRNGKey(5), jnp.asarray(x[:1]))
    sref = _jax_jacobians(lambda z: stateful.apply(sparams, state, None, z)[0], x)
    assert_jac_close(batchjac.jacobian(stateful, x, backend_options={
        "params": sparams, "state": state}), sref)
    with pytest.raises(batchjac.InputError, match="needs its state too"):
        batchjac.jacobian(stateful, x, backend_options={"params": sparams})
    with pytest.raises(batchjac.InputError, match=r"backend_options=\{'params': params\}"):
        batchjac.jacobian(plain, x)
    with pytest.raises(batchjac.ModelError, match="pass the transformed function itself"):
        batchjac.jacobian(plain.apply, x, backend_options={"params": params})


def test_jitted_model_and_jax_array_inputs() -> None:
    w = jnp.asarray(data((5, 3), seed=13))
    f = jax.jit(lambda x: jnp.tanh(x @ w))
    x = data((9, 5), seed=14)
    ref = central_differences(lambda v: np.tanh(v @ np.asarray(w, np.float64)), x)
    assert_jac_close(batchjac.jacobian(f, jnp.asarray(x)), ref)


def test_integer_context_input() -> None:
    table = jnp.asarray(data((4, 3), seed=15))

    def f(x: Any, ids: Any) -> Any:  # an embedding lookup by integer id, per row
        return jnp.tanh(x * table[ids])

    x, ids = data((10, 3), seed=16), np.arange(10) % 4
    jac = batchjac.jacobian(f, (x, ids), wrt=0, chunk_size=4)
    d = np.asarray(table, np.float64)[ids]
    ref = np.einsum("ni,ij->nij", (1 - np.tanh(x * d) ** 2) * d, np.eye(3))
    assert_jac_close(jac, ref)


def test_rebound_closure_values_are_not_stale() -> None:
    x = data((8, 3), seed=17)
    scale = jnp.float32(1.0)
    state = {"w": jnp.eye(3, dtype=jnp.float32)}

    def f(v: Any) -> Any:
        return jnp.sin(v) @ state["w"] * scale

    base = np.einsum("ni,ij->nij", np.cos(x.astype(np.float64)), np.eye(3))
    assert_jac_close(batchjac.jacobian(f, x), base)
    scale = jnp.float32(3.0)  # a rebound closure variable
    assert_jac_close(batchjac.jacobian(f, x), 3 * base)
    state["w"] = -state["w"]  # a new array in a dict the function reads
    assert_jac_close(batchjac.jacobian(f, x), -3 * base)


def test_values_past_the_watched_limit_get_one_warning_and_params_are_the_fix() -> None:
    """A function closing over a list of 300 scales: batchjac watches the first 256 for
    changes, so a change to the last one would go unseen (stale Jacobians). The first call
    warns once, naming what it cut (a list of 300 items) and the fix; its results are right;
    the same change passed as ``params`` is seen (a fresh closure over few values: no
    warning, as in every other test of this suite, which turns warnings into errors)."""
    x = data((6, 3), seed=2204)
    scales = [np.float32(1.0 + 0.01 * i) for i in range(300)]

    def f(v: Any) -> Any:
        return jnp.sin(v) * scales[-1]

    def reference(c: float) -> np.ndarray:
        return np.einsum("nj,ij->nji", np.cos(x.astype(np.float64)) * c, np.eye(3))

    with pytest.warns(batchjac.UnwatchedValuesWarning) as caught:
        got = batchjac.jacobian(f, x)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "a list of 300 items (the first 256 are watched)" in text, text
    assert 'backend_options={"params": params}' in text, text
    assert_jac_close(got, reference(float(scales[-1])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per bound model: the next call is quiet
        assert_jac_close(batchjac.jacobian(f, x), reference(float(scales[-1])))

    def g(params: Any, v: Any) -> Any:
        return jnp.sin(v) * params[-1]

    params = jnp.asarray(scales)
    assert_jac_close(batchjac.jacobian(g, x, backend_options={"params": params}),
                     reference(float(scales[-1])))
    params = params.at[-1].set(4.0)
    assert_jac_close(batchjac.jacobian(g, x, backend_options={"params": params}),
                     reference(4.0))


def test_numpy_weights_changed_in_place_are_not_stale() -> None:
    """A numpy array is the same object after ``W *= 3`` or ``W[:] = ...`` (a numpy training
    loop's update), and jax.jit had baked its old values into the kernel: the second call
    returned the first call's Jacobians. Closed over directly, in a dict, and as a model
    object's attribute; an unchanged array is not traced again (the trace counter)."""
    rng = np.random.default_rng(2203)
    x = data((8, 3), seed=2203)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    state = {"b": rng.normal(size=(2,)).astype(np.float32)}

    def f(v: Any) -> Any:
        return jnp.tanh(v @ w + state["b"])

    def reference() -> np.ndarray:  # d tanh(x W + b) / dx = (1 - tanh^2) W^T, in float64
        y = np.tanh(x.astype(np.float64) @ w + state["b"])
        return np.einsum("nj,ij->nji", 1 - y * y, w.astype(np.float64))

    assert_jac_close(batchjac.jacobian(f, x), reference())
    w *= 3.0  # in place: the same object
    assert_jac_close(batchjac.jacobian(f, x), reference())
    state["b"][:] = rng.normal(size=(2,))  # in place, inside a dict
    assert_jac_close(batchjac.jacobian(f, x), reference())

    class Layer:
        def __init__(self) -> None:
            self.w = rng.normal(size=(3, 3)).astype(np.float32)

        def __call__(self, v: Any) -> Any:
            return jnp.sin(v @ self.w)

    layer = Layer()

    def ref() -> np.ndarray:
        return np.einsum("nj,ij->nji", np.cos(x.astype(np.float64) @ layer.w), layer.w)

    assert_jac_close(batchjac.jacobian(layer, x, backend="jax"), ref())
    layer.w[0] = 0.5  # one row, in place
    assert_jac_close(batchjac.jacobian(layer, x, backend="jax"), ref())
    traces = bound_of(layer).trace_count
    assert_jac_close(batchjac.jacobian(layer, x, backend="jax"), ref())
    assert bound_of(layer).trace_count == traces, "an unchanged array must not retrace"
    layer.w *= 2
    assert_jac_close(batchjac.jacobian(layer, x, backend="jax"), ref())
    assert bound_of(layer).trace_count > traces


def test_rebound_globals_attributes_and_grown_lists_are_not_stale() -> None:
    """The cheap per-call check (re-reading where each baked-in value was found) must see
    every change a full walk would: a rebound global, a new attribute value, a longer list."""
    x = data((8, 3), seed=19)
    base = np.einsum("ni,ij->nij", np.cos(x.astype(np.float64)), np.eye(3))
    glb: dict[str, Any] = {"jnp": jnp, "W": jnp.eye(3, dtype=jnp.float32)}
    exec("def f(v):\n    return jnp.sin(v) @ W\n", glb)  # a module-level function
    assert_jac_close(batchjac.jacobian(glb["f"], x), base)
    glb["W"] = 2 * glb["W"]
    assert_jac_close(batchjac.jacobian(glb["f"], x), 2 * base)

    class Scaled:
        def __init__(self) -> None:
            self.w = jnp.eye(3, dtype=jnp.float32)
            self.extra: list[Any] = []

        def __call__(self, v: Any) -> Any:
            out = jnp.sin(v) @ self.w
            for e in self.extra:
                out = out * e
            return out

    g = Scaled()
    assert_jac_close(batchjac.jacobian(g, x, backend="jax"), base)
    g.w = -g.w
    assert_jac_close(batchjac.jacobian(g, x, backend="jax"), -base)
    g.extra.append(jnp.float32(5.0))
    assert_jac_close(batchjac.jacobian(g, x, backend="jax"), -5 * base)


def test_weights_changed_deep_in_nested_params_or_layer_objects_are_not_stale() -> None:
    """A Flax-style nested dict of params (the kernel 4 dicts below the closure) and a model
    object holding a list of layer objects: the walk stopped 3 levels down, and a weight
    replaced there kept its old value baked into the compiled kernel (silently wrong J)."""
    rng = np.random.default_rng(2201)
    x = data((8, 3), seed=2201)
    w1 = jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)
    params = {"params": {"Encoder_0": {"Block_0": {"Dense_0": {"kernel": w1}}}}}

    def f(v: Any) -> Any:
        return jnp.sin(v) @ params["params"]["Encoder_0"]["Block_0"]["Dense_0"]["kernel"]

    def reference(w: Any) -> np.ndarray:  # J[n, j, i] = cos(x[n, i]) w[i, j]
        return np.einsum("ni,ij->nji", np.cos(x.astype(np.float64)), np.asarray(w, np.float64))

    assert_jac_close(batchjac.jacobian(f, x), reference(w1))
    params["params"]["Encoder_0"]["Block_0"]["Dense_0"]["kernel"] = w2
    assert_jac_close(batchjac.jacobian(f, x), reference(w2))

    class Layer:
        def __init__(self, w: Any) -> None:
            self.w = w

    class Net:
        def __init__(self) -> None:
            self.blocks = [[Layer(w1)]]

        def __call__(self, v: Any) -> Any:
            out = jnp.sin(v)
            for block in self.blocks:
                for layer in block:
                    out = out @ layer.w
            return out

    net = Net()
    assert_jac_close(batchjac.jacobian(net, x, backend="jax"), reference(w1))
    net.blocks[0][0].w = w2
    assert_jac_close(batchjac.jacobian(net, x, backend="jax"), reference(w2))


def test_unused_unknowns_get_zero_columns() -> None:
    model = jax_examples.mlp((3, 16, 2))
    x = data((20, 5), seed=18)
    jac = batchjac.jacobian(lambda v: model(v[:, :3]), x, backend="jax")
    np.testing.assert_array_equal(jac[:, :, 3:], 0.0)
    assert_jac_close(jac[:, :, :3], mlp_jacobian(mlp_weights((3, 16, 2)), x[:, :3]))


def test_stop_gradient_is_not_connected() -> None:
    x = data((6, 4), seed=19)
    with pytest.raises(batchjac.NotConnectedError, match="does not depend on the unknowns"):
        batchjac.jacobian(lambda v: jnp.tanh(jax.lax.stop_gradient(v)), x)


# ---- errors ---------------------------------------------------------------------------------


def test_tuple_and_dict_outputs_are_refused() -> None:
    x = data((4, 3), seed=20)
    with pytest.raises(batchjac.ModelError, match=r"returned a tuple of 2 outputs.*one output"):
        batchjac.jacobian(lambda v: (v * 2, v.sum(1)), x, backend="jax")
    with pytest.raises(batchjac.ModelError, match=r"dict with keys \['a'\].*f\(x\)\['a'\]"):
        batchjac.jacobian(lambda v: {"a": v * 2}, x, backend="jax")


def test_integer_output_is_refused() -> None:
    x = data((4, 3), seed=21)
    with pytest.raises(batchjac.ModelError, match="dtype int32; it must be floating"):
        batchjac.jacobian(lambda v: jnp.round(v).astype(jnp.int32), x, backend="jax")


def test_output_computed_outside_jax_is_explained() -> None:
    x = data((4, 3), seed=22)
    with pytest.raises(batchjac.ModelError, match="converts a traced JAX array to numpy"):
        batchjac.jacobian(lambda v: jnp.asarray(np.tanh(np.asarray(v))), x, backend="jax")
    with pytest.raises(batchjac.ModelError, match="not a JAX array"):
        batchjac.jacobian(lambda v: np.ones((4, 2), np.float32), x, backend="jax")


def test_python_control_flow_on_values_is_explained() -> None:
    def f(v: Any) -> Any:
        return v * 2 if v.sum() > 0 else v

    with pytest.raises(batchjac.ModelError, match=r"Python control flow.*jnp\.where"):
        batchjac.jacobian(f, data((4, 3), seed=23), backend="jax")


def test_model_failure_names_params_option() -> None:
    with pytest.raises(batchjac.ModelError, match=r"backend_options=\{'params': params\}"):
        batchjac.jacobian(_params_mlp, data((4, 8), seed=24))


def test_bad_options() -> None:
    model, x = seed_model("jax"), data((4, 8), seed=25)
    with pytest.raises(batchjac.InputError, match=r"Unknown JAX backend option\(s\) \['param'\]"):
        batchjac.jacobian(model, x, backend_options={"param": 1})
    with pytest.raises(batchjac.InputError, match="must be True or False; got 'yes'"):
        batchjac.jacobian(model, x, backend_options={"per_instance": "yes"})
    with pytest.raises(batchjac.InputError, match="must be callable"):
        batchjac.jacobian(jnp.ones(3), x, backend="jax")


# ---- compilation --------------------------------------------------------------------------


def test_100k_rows_compile_once_per_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    model = seed_model("jax")
    unknown, known = workload_inputs("W1", 100_000, seed=26)
    race_now(monkeypatch)  # 100,000 rows: the builds' race is timed on the first call
    counts = {}
    for mode in ("forward", "reverse"):
        before = bound_of(model).trace_count if counts else 0
        jac = batchjac.jacobian(model, unknown, known, mode=mode, chunk_size=16384)
        kernel = bound_of(model).kernel(mode, 16384, False)
        # one trace for the chunk, one more for each block size its first call timed
        blocked = {v.split("/")[1] for v in kernel.variants if "/" in v}
        assert bound_of(model).trace_count - before == 1 + len(blocked)
        counts[mode] = bound_of(model).trace_count
    batchjac.jacobian(model, unknown[:5000], known[:5000], mode="reverse", chunk_size=16384)
    assert bound_of(model).trace_count == counts["reverse"]  # the padded chunk kernel again
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown[-500:], known[-500:]], 1))
    assert_jac_close(jac[-500:], ref[:, :, :5])


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("rows", [256, 290])
def test_kernel_in_blocks_agrees_with_finite_differences(mode: str, rows: int) -> None:
    """A chunk computed in blocks (a lax.map inside the kernel; 290 rows: 3 blocks of 97, the
    last padded) gives the same Jacobians and outputs as the whole chunk, in either build."""
    model, x, ref = _smooth_case(31, rows)
    batchjac.jacobian(model, x[:5], mode=mode)  # bind
    kernel = bound_of(model).kernel(mode, rows, True)
    block = -(-rows // -(-rows // 128))  # 128 evened over the chunk: 128, or 97 (3 blocks)
    blocks = [v for v in kernel.variants if "/" in v]
    assert blocks == [f"default/{block}", f"no-ynnpack/{block}"]
    kernel.use("default")
    y_whole, j_whole = kernel(x, ())
    for variant in blocks:
        kernel.use(variant)
        y, jac = kernel(x, ())
        assert jac.shape == (rows, 2, 3, 4)
        assert y is not None
        assert y.shape == (rows, 2, 3)
        assert_jac_close(jac, ref)  # 1e-4
        np.testing.assert_allclose(jac, j_whole, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y, y_whole, rtol=1e-6, atol=1e-6)
    timed = bound_of(model).kernel(mode, rows, False)
    from batchjac._backends import CallBudget

    # a first call whose job repays the race: it times every variant and keeps one
    _, jac = timed.call(x, (), CallBudget(race=True))
    assert timed.variant in timed.variants
    assert all(f"{v} " in timed.note for v in timed.variants)
    assert_jac_close(jac, ref)


def test_compiled_kernels_per_model_are_bounded() -> None:
    """Calls with ever new chunk sizes (chunk_size=n here; out= arrays of each N, or repeated
    N that earn their own kernel, alike) kept one compiled kernel each: ~1.7 MB apiece for this
    small model, 330 MB after 200 sizes. At most MAX_KERNELS are kept now; the memory of the
    dropped ones is freed."""
    psutil = pytest.importorskip("psutil")
    import gc

    w = jnp.asarray(np.random.default_rng(28).normal(size=(3, 4)).astype(np.float32))

    def model(x: Any) -> Any:
        return jnp.tanh(x @ w)

    def reference(x: np.ndarray) -> np.ndarray:
        return (1 - np.tanh(x @ np.asarray(w, np.float64)) ** 2)[:, :, None] * np.asarray(w).T[None]

    proc = psutil.Process()
    for i, n in enumerate(range(10, 90)):
        x = data((n, 3), seed=n)
        assert_jac_close(batchjac.jacobian(model, x, chunk_size=n), reference(x))
        if i == 20:  # past the warm-up (the first kernels, XLA's own caches)
            gc.collect()
            before = proc.memory_info().rss
    gc.collect()
    bound = bound_of(model)
    n_kernels = len(bound._kernels)
    grown = (proc.memory_info().rss - before) / 2**20
    assert grown < 40, f"{grown:.0f} MiB more after 59 new kernels (~100 MiB when all are kept)"
    assert n_kernels <= 16  # BoundModel.MAX_KERNELS


# ---- the same weights in Keras and JAX -------------------------------------------------------


@pytest.mark.parametrize(("name", "n"), [("W1", 50), ("W4", 6)])
def test_same_jacobians_as_keras(name: str, n: int) -> None:
    pytest.importorskip("tensorflow")
    unknown, known = workload_inputs(name, n, seed=27)
    args = (unknown,) if known is None else (unknown, known)
    keras_model, jax_model = workload_model(name, "tensorflow"), workload_model(name, "jax")
    y_k, jac_k = batchjac.jacobian(keras_model, *args, return_outputs=True)
    y_j, jac_j = batchjac.jacobian(jax_model, *args, return_outputs=True)
    x = unknown if known is None else np.concatenate([unknown, known], 1)
    np.testing.assert_allclose(y_j, keras_model(x, training=False).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_j, y_k, rtol=1e-5, atol=1e-5)
    assert jac_j.shape == jac_k.shape
    assert_jac_close(jac_j, np.asarray(jac_k, np.float64))


# ---- compiled kernels remembered on disk -----------------------------------------------------


def test_a_later_process_loads_the_compiled_kernel_instead_of_compiling(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executable this process compiled is loaded by the next one (no XLA compilation
    there, the same bits); a model of the same code with other weights compiles its own (the
    weights are constants of the module the key hashes) and gets its own Jacobians."""
    import os
    from pathlib import Path

    from batchjac._backends.jax import executables as jax_executables

    monkeypatch.setattr(jax_executables, "MIN_COMPILE_SECONDS", 0.0)  # tiny test kernels
    sizes = (6, 16, 3)
    x = data((50, 6), seed=31)
    got = batchjac.jacobian(jax_examples.mlp(sizes, seed=3), x)
    jax_executables.flush()
    np.testing.assert_allclose(got, mlp_jacobian(mlp_weights(sizes, 3), x), rtol=2e-4, atol=1e-5)
    assert list(Path(os.environ["BATCHJAC_CACHE_DIR"]).rglob("*.bin")), "no executable written"
    np.save(tmp_path / "x.npy", x)
    code = f"""
        import numpy as np, batchjac
        from batchjac import _backends
        from batchjac._examples import jax as jax_examples
        model = jax_examples.mlp({sizes}, seed=3)
        jac = batchjac.jacobian(model, np.load({str(tmp_path / 'x.npy')!r}))
        np.save({str(tmp_path / 'jac.npy')!r}, jac)
        (bound,) = _backends._bound[model].values()
        print("COMPILES", bound.compile_count, "TRACES", bound.trace_count)
    """
    stdout = run_in_fresh_process(code)
    assert "COMPILES 0 TRACES 1" in stdout  # traced (the key), not compiled
    np.testing.assert_array_equal(np.load(tmp_path / "jac.npy"), got)
    other = jax_examples.mlp(sizes, seed=4)  # the same code, other weights
    jac = batchjac.jacobian(other, x)
    jax_executables.compiled_beside()
    assert all_compiled(bound_of(other))
    np.testing.assert_allclose(jac, mlp_jacobian(mlp_weights(sizes, 4), x), rtol=2e-4, atol=1e-5)
    assert np.abs(jac - got).max() > 1e-2  # (the weights do matter)


@pytest.mark.parametrize("blocked", [False, True])
def test_a_warm_process_loads_the_build_an_earlier_race_chose(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, blocked: bool) -> None:
    """A process whose race chose a build (and a mode) leaves that build's executable on disk;
    the next process's first call loads it, no compilation at all, where it compiled its quick
    build first (a full one replacing it later) and, when the race had flipped the mode, a
    quick build of the other mode than the one on disk. A build in blocks ("default/120",
    ``blocked``) is traced in those blocks only: one trace (it traced the whole chunk first as
    well, for a build it then replaced)."""
    from batchjac._backends.jax import executables as jax_executables
    from batchjac._tune import chooser

    monkeypatch.setattr(jax_executables, "MIN_COMPILE_SECONDS", 0.0)  # tiny test kernels
    if blocked:  # every challenger wins: the race takes blocks, whatever the times
        monkeypatch.setattr(chooser, "MARGIN", -1e9)
    race_now(monkeypatch)
    sizes = (6, 16, 3)
    seed = 9 if blocked else 8
    x = data((600, 6), seed=41 if blocked else 37)
    model = jax_examples.mlp(sizes, seed=seed)
    for _ in range(3 + 2 * MODE_RUNS):  # (the modes race on the calls; the last call's is kept)
        got = batchjac.jacobian(model, x)
        made_beside(30)
    jax_executables.flush()
    bound = bound_of(model)
    assert not bound.tuning.mode_races
    (mode, _), = bound.tuned.values()
    (kernel,) = [k for k in bound._kernels.values() if k.mode == mode]  # (the mode kept)
    assert kernel.raced
    assert kernel.variant in kernel.variants
    if blocked:
        assert "/" in kernel.variant, kernel.variant
    np.save(tmp_path / "x.npy", x)
    code = f"""
        import numpy as np, batchjac
        from batchjac import _backends
        from batchjac._examples import jax as jax_examples
        model = jax_examples.mlp({sizes}, seed={seed})
        jac = batchjac.jacobian(model, np.load({str(tmp_path / 'x.npy')!r}))
        np.save({str(tmp_path / 'jac.npy')!r}, jac)
        (bound,) = _backends._bound[model].values()
        kernel = list(bound._kernels.values())[-1]
        print("COMPILES", bound.compile_count, "MODE", kernel.mode, "VARIANT", kernel.variant,
              "TRACES", bound.trace_count)
    """
    stdout = run_in_fresh_process(code)
    assert f"COMPILES 0 MODE {kernel.mode} VARIANT {kernel.variant}" in stdout, stdout
    if blocked:
        assert "TRACES 1\n" in stdout, stdout
    np.testing.assert_allclose(np.load(tmp_path / "jac.npy"), got, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, mlp_jacobian(mlp_weights(sizes, seed), x), rtol=2e-4, atol=1e-5)


def test_a_cache_that_never_held_an_executable_costs_the_call_no_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a directory that never held an executable the lookup is skipped: the key (the
    kernel's text hashed) is made by the writer after the call, which still stores the
    executable, and a later kernel of the same code then finds and loads it."""
    import os
    import threading
    from pathlib import Path

    from batchjac._backends.jax import executables as jax_executables

    monkeypatch.setattr(jax_executables, "MIN_COMPILE_SECONDS", 0.0)
    made: list[str] = []
    original = jax_executables._key
    monkeypatch.setattr(jax_executables, "_key", lambda lowered, options: made.append(
        threading.current_thread().name) or original(lowered, options))
    sizes = (6, 12, 3)
    x = data((40, 6), seed=33)
    got = batchjac.jacobian(jax_examples.mlp(sizes, seed=6), x)
    assert "MainThread" not in made  # nothing looked up during the call
    jax_executables.flush()
    assert made
    assert all(name.startswith("batchjac-executables") for name in made)
    assert list(Path(os.environ["BATCHJAC_CACHE_DIR"]).rglob("*.bin")), "no executable written"
    monkeypatch.setattr(jax_executables, "_SEEN", set())
    model = jax_examples.mlp(sizes, seed=6)  # a new function object of the same code
    jac = batchjac.jacobian(model, x)
    assert "MainThread" in made  # the directory holds executables now: looked up
    jax_executables.compiled_beside()
    assert bound_of(model).compile_count == 0  # and loaded (the steady build's too)
    np.testing.assert_array_equal(jac, got)
    np.testing.assert_allclose(got, mlp_jacobian(mlp_weights(sizes, 6), x), rtol=2e-4, atol=1e-5)


def test_the_executable_writer_thread_exists_before_the_call_has_its_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's thread is made when an executable is queued, not when the call's result
    is there (the thread's stack is mapped memory, and the first call of W2 waited 15-20 ms
    there for XLA's freeing of its temporaries); the executable is still written."""
    import concurrent.futures
    import os
    from pathlib import Path

    from batchjac._backends.jax import executables as jx

    monkeypatch.setattr(jx, "MIN_COMPILE_SECONDS", 0.0)
    writer = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                   thread_name_prefix="batchjac-executables")
    monkeypatch.setattr(jx, "_WRITER", writer)
    threads_at_release: list[int] = []
    original = jx.release

    def release() -> None:
        threads_at_release.append(len(writer._threads))
        original()

    monkeypatch.setattr(jx, "release", release)
    sizes = (6, 10, 3)
    x = data((30, 6), seed=35)
    jac = batchjac.jacobian(jax_examples.mlp(sizes, seed=8), x)
    assert threads_at_release, "release was not called"
    assert threads_at_release[0] == 1, threads_at_release
    jx.flush()
    writer.shutdown()
    assert list(Path(os.environ["BATCHJAC_CACHE_DIR"]).rglob("*.bin")), "no executable written"
    np.testing.assert_allclose(jac, mlp_jacobian(mlp_weights(sizes, 8), x), rtol=2e-4, atol=1e-5)


def test_a_store_of_a_small_job_compiles_its_kernel_once(tmp_path: Any) -> None:
    """A store computes every chunk with the backend's first build ("default", recorded in
    its plan); the kernel made for it compiled the quick build first (a small job), which the
    store then replaced: two XLA compilations where one does."""
    from batchjac._backends.jax import executables as jax_executables

    pytest.importorskip("zarr")  # (zarr 3, the stores' floor, needs Python 3.11)
    sizes = (6, 10, 3)
    model = jax_examples.mlp(sizes, seed=9)
    x = data((40, 6), seed=36)
    compiled: list[dict[str, str]] = []
    original = jax_executables.compile

    def counted(lowered: Any, options: Any = None, **kw: Any) -> Any:
        compiled.append(dict(options or {}))
        return original(lowered, options, **kw) if options is not None else original(lowered, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax_executables, "compile", counted)
        store = batchjac.jacobian(model, x, out=str(tmp_path / "j.zarr"))
    # the default build, once (not the quick one first)
    from batchjac._backends.jax import compat

    assert compiled == [compat.builds(jax.default_backend())["default"]], compiled
    np.testing.assert_allclose(np.asarray(store.open()[:]), mlp_jacobian(mlp_weights(sizes, 9), x),
                               rtol=2e-4, atol=1e-5)


def test_close_widths_are_computed_in_forward_mode() -> None:
    """JAX's forward mode traces and compiles quicker where the widths are close (5 unknowns,
    4 outputs: forward_bias); the Jacobian is the reference's either way."""
    sizes = (8, 16, 4)
    model = jax_examples.mlp(sizes, seed=7)
    x = data((30, 8), seed=34)
    jac = batchjac.jacobian(model, x[:, :5], x[:, 5:])
    kernels = list(bound_of(model)._kernels.values())
    assert [k.computes for k in kernels] == ["forward"]
    np.testing.assert_allclose(jac, mlp_jacobian(mlp_weights(sizes, 7), x)[:, :, :5],
                               rtol=2e-4, atol=1e-5)


def test_an_executable_that_fails_to_load_is_compiled_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchjac._backends.jax import executables as jax_executables

    monkeypatch.setattr(jax_executables, "MIN_COMPILE_SECONDS", 0.0)
    x = data((20, 6), seed=32)
    batchjac.jacobian(jax_examples.mlp((6, 8, 2), seed=5), x)
    jax_executables.flush()
    monkeypatch.setattr(jax_executables, "_load", lambda payload, lowered: None)  # another jaxlib
    monkeypatch.setattr(jax_executables, "_SEEN", set())
    model = jax_examples.mlp((6, 8, 2), seed=5)
    jac = batchjac.jacobian(model, x)
    jax_executables.compiled_beside()
    assert all_compiled(bound_of(model))
    np.testing.assert_allclose(jac, mlp_jacobian(mlp_weights((6, 8, 2), 5), x), rtol=2e-4, atol=1e-5)


# ---- probes proven from the jaxpr -------------------------------------------------------------


@pytest.mark.parametrize("workload", ["W1", "W3", "W4"])
def test_row_independence_is_read_from_the_jaxpr_without_a_forward_pass(
        workload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workloads' models keep their rows apart, which the jaxpr shows: the probes then run
    no forward pass (no compilation of the forward), and the Jacobians are still right."""
    from batchjac._backends.jax import JaxBound

    calls: list[int] = []
    original = JaxBound.forward
    monkeypatch.setattr(JaxBound, "forward", lambda self, u, ctx: calls.append(1) or original(self, u, ctx))
    model = workload_model(workload, "jax")
    unknown, known = workload_inputs(workload, 6, seed=41)
    data_ = (unknown,) if known is None else (unknown, known)
    jac = batchjac.jacobian(model, *data_)
    assert calls == []
    assert bound_of(model).probed
    if workload == "W1":
        layers = mlp_weights((8, 64, 64, 4))
        ref = mlp_jacobian(layers, np.concatenate([unknown, known], 1))[:, :, :5]
        np.testing.assert_allclose(jac, ref, rtol=2e-3, atol=2e-5)
    else:  # against JAX's own per-instance Jacobians
        def one(u: Any, h: Any) -> Any:
            x = u if h is None else jnp.concatenate([u, h], axis=-1)
            return model(x[None])[0]

        ref = jax.vmap(jax.jacrev(one), in_axes=(0, None if known is None else 0))(unknown, known)
        np.testing.assert_allclose(jac, np.asarray(ref), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("name", "fn"), [
    ("mean over rows", lambda x: x - x.mean(axis=0, keepdims=True)),
    ("sort along rows", lambda x: jnp.sort(x, axis=0) * x),
    ("cumulative sum over rows", lambda x: jnp.cumsum(x, axis=0)),
    ("roll of rows", lambda x: jnp.roll(x, 1, axis=0) + x),
    ("row-mixing matrix product", lambda x: x @ (x.T @ x)),
])
def test_rows_that_interact_are_never_proven_apart(name: str, fn: Any) -> None:
    """Whatever mixes rows answers "cannot tell" (or is not proven), and the probes' forward
    passes then find the interaction."""
    from batchjac._backends.jax import rows as jax_rows

    x = data((4, 3), seed=43)
    closed = jax.make_jaxpr(fn)(x)
    assert not jax_rows.rows_apart(closed, [True]), name
    with pytest.raises(batchjac.RowInteractionError):
        batchjac.jacobian(fn, data((10, 3), seed=44), backend="jax")


def test_rows_apart_follows_the_primitives_it_knows() -> None:
    from batchjac._backends.jax import rows as jax_rows

    x = data((4, 3), seed=45)
    w = jnp.asarray(data((3, 5), seed=46))
    images = data((4, 6, 6, 1), seed=47)
    kernel = jnp.asarray(data((3, 3, 1, 2), seed=48))
    apart = {
        "dense": lambda x: jnp.tanh(x @ w + 1.0),
        "softplus and where": lambda x: jnp.where(x > 0, jax.nn.softplus(x), x**2),
        "reductions over features": lambda x: x.sum(axis=1, keepdims=True) * x.max(axis=-1)[:, None],
        "reshape and slices": lambda x: jnp.concatenate([x[:, :2], x[:, 1:]], axis=1).reshape(4, 2, 2),
        "a jitted inner function": jax.jit(lambda x: jnp.sin(x) @ w),
        "arange and eye": lambda x: x @ jnp.eye(3) + jnp.arange(3.0),
        "beside a broadcast constant": lambda x: jnp.concatenate(
            [x, jnp.broadcast_to(jnp.arange(2.0), (x.shape[0], 2))], axis=1),
    }
    for name, fn in apart.items():
        assert jax_rows.rows_apart(jax.make_jaxpr(fn)(x), [True]), name

    def conv(z: Any) -> Any:
        return jax.lax.conv_general_dilated(z, kernel, (1, 1), "VALID",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    assert jax_rows.rows_apart(jax.make_jaxpr(conv)(images), [True])
    # an output that does not depend on the rows, a random draw, a host callback, a constant of
    # one value per row beside the rows: cannot tell
    for fn in (lambda x: jnp.ones((x.shape[0], 3)),
               lambda x: jnp.concatenate([x, jnp.arange(x.shape[0] * 2.0).reshape(-1, 2)], axis=1),
               lambda x: x * jax.random.normal(jax.random.key(0), x.shape),
               lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)):
        assert not jax_rows.rows_apart(jax.make_jaxpr(fn)(x), [True])


# -- the quick first build (XLA at optimization level 0 for a small chunk) ---------------------------

def test_a_small_first_chunk_compiles_the_quick_build_and_a_due_race_replaces_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A first call whose chunk does little elementwise work compiles one build, "quick", and
    runs it untimed; once the work repays a race, the race times the full builds and keeps one
    of them, never "quick"; every build gives the Jacobians finite differences give."""
    needs_build("quick")
    model, x, ref = _smooth_case(41, 64)
    jac = batchjac.jacobian(model, x, mode="reverse")
    assert_jac_close(jac, ref)
    bound = bound_of(model)
    kernel = bound.kernel("reverse", 64, False)
    assert kernel.variant == "quick"
    assert kernel.cheap_first == "quick"
    assert "optimization level 0" in kernel.note
    assert set(kernel._compiled) == {"quick"}  # one compilation, the quick one
    assert kernel.work is not None
    assert 0 < kernel.work.elements <= kernel.QUICK_ELEMENTS
    assert kernel.untimed
    assert "quick" not in kernel.variants
    from batchjac._backends.jax import executables as jax_executables

    with monkeypatch.context() as patch:
        race_now(patch)  # the work seen now repays the race
        ran = []
        for i in range(60):  # it rides on the next calls: each runs a contender, kept
            assert_jac_close(batchjac.jacobian(model, x, mode="reverse"), ref)
            ran.append(kernel.variant)
            if kernel.raced:
                break
            if i == 2:  # (the contenders compile beside the calls: ready now)
                jax_executables.compiled_beside()
    assert kernel.raced, ran
    assert kernel.call_race is None
    assert kernel.variant in kernel.variants
    assert {"default", "no-ynnpack"} <= set(ran)  # both computed the user's calls
    assert "timed one chunk" in kernel.note
    assert not kernel.untimed


def test_the_mode_race_times_full_builds_not_the_quick_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unknowns and outputs of similar count (4 against 6): the first call runs the quick
    build; the mode race, once due, times each mode's full build (the quick one's slow loops
    would favour the mode with fewer), and the Jacobians stay finite differences'."""
    needs_build("quick")
    model, x, ref = _smooth_case(47, 64)
    assert_jac_close(batchjac.jacobian(model, x), ref)
    bound = bound_of(model)
    assert not bound.tuned  # no race yet: the first call's work does not repay one
    (first,) = bound._kernels.values()
    assert set(first._compiled) == {"quick"}
    # priced at what it compiles: the other mode's kernel and this one's full build
    assert bound.mode_race_builds(first.mode, 64, False) == 2
    with monkeypatch.context() as patch:
        race_now(patch)  # (the fast path hands the due race to the full path)
        for _ in range(3 + 2 * MODE_RUNS):  # (the modes race on the calls, in turn)
            assert_jac_close(batchjac.jacobian(model, x), ref)
            made_beside(30)  # (the other mode's kernel, where it is made beside the calls)
    assert (64, False) in bound.tuned  # the modes were timed
    for mode in ("forward", "reverse"):
        kernel = bound.kernel(mode, 64, False)
        assert set(kernel._compiled) - {"quick"}, (mode, set(kernel._compiled))
    # the other mode's kernel, built for the race, compiled no quick build of its own
    other = bound.kernel("reverse" if first.mode == "forward" else "forward", 64, False)
    assert "quick" not in other._compiled, set(other._compiled)
    assert bound.mode_race_builds(first.mode, 64, False) == 1


def test_the_mode_race_makes_the_other_kernel_beside_the_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a core free, the other mode's kernel is traced and compiled on the thread that
    makes builds beside the calls; the calls meanwhile compute in the cost model's mode, untimed,
    and once it is made the modes race on the calls, every result the call's own."""
    from batchjac._backends import _base

    if not _base.idle_core():
        pytest.skip("one core: the race's kernel is made by its first call")
    model, x, ref = _smooth_case(49, 64)
    assert_jac_close(batchjac.jacobian(model, x), ref)
    bound = bound_of(model)
    (first,) = bound._kernels.values()
    made_on, gate = [], threading.Event()
    original = type(bound).build_kernel

    def held(self: Any, *a: Any, **k: Any) -> Any:
        made_on.append(threading.current_thread().name)
        gate.wait(30)  # (the making takes as long as the test's calls below)
        return original(self, *a, **k)

    monkeypatch.setattr(type(bound), "build_kernel", held)
    race_now(monkeypatch)
    for _ in range(4):  # the race starts; its other kernel is held: the prior mode answers
        assert_jac_close(batchjac.jacobian(model, x), ref)
    assert made_on == ["batchjac-tier-up_0"], made_on
    assert bound.tuning.mode_races
    assert not bound.tuned
    assert list(bound._kernels.values()) == [first]  # (the calls computed in its mode)
    (race,) = bound.tuning.mode_races.values()
    assert not race.ready()
    assert not race.made
    assert not any(race.samples.values())
    gate.set()
    made_beside(30)
    for _ in range(1 + 2 * MODE_RUNS):
        assert_jac_close(batchjac.jacobian(model, x), ref)
    assert (64, False) in bound.tuned
    assert not bound.tuning.mode_races
    assert made_on == ["batchjac-tier-up_0"]  # (made once, beside)


def test_the_first_build_follows_the_chunks_work_and_autotune_off_compiles_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, ref = _smooth_case(43, 50)
    from batchjac._backends.jax import JaxKernel

    with monkeypatch.context() as patch:
        patch.setattr(JaxKernel, "QUICK_ELEMENTS", 1.0)  # every chunk is "too large"
        assert_jac_close(batchjac.jacobian(model, x, mode="forward"), ref)
    kernel = bound_of(model).kernel("forward", 50, False)
    assert set(kernel._compiled) == {"default"}
    assert kernel.cheap_first is None
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "off")
    assert_jac_close(batchjac.jacobian(model, x[:30], mode="forward"), ref[:30])
    assert set(bound_of(model).kernel("forward", 30, False)._compiled) == {"default"}


def test_wide_matrix_products_compile_xlas_own_dot_emitter_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk too large for the quick build whose matrix products are wide compiles
    "no-ynnpack" first (XLA's own dot emitter), and only that build."""
    needs_build("no-ynnpack")
    other, x, ref = _smooth_case(43, 50)
    from batchjac._backends.jax import JaxKernel

    with monkeypatch.context() as patch:
        patch.setattr(JaxKernel, "QUICK_ELEMENTS", 1.0)  # every chunk is "too large"
        patch.setattr(JaxKernel, "WIDE_PRODUCTS", 1.0)
        assert_jac_close(batchjac.jacobian(other, x[:40], mode="forward"), ref[:40])
        wide = bound_of(other).kernel("forward", 40, False)
    assert set(wide._compiled) == {"no-ynnpack"}
    assert wide.variant == "no-ynnpack"
    assert wide.cheap_first is None  # (a remembered build is taken at once)


def test_the_flop_count_matches_xlas_cost_analysis() -> None:
    """batchjac._backends.jax_cost counts from the jaxpr what XLA's cost analysis counts from
    the lowered module (within 15%): matrix products, a convolution; and a scan at its trip
    count (XLA counts a loop's body once: 5 trips are 5 times its count)."""
    from batchjac._backends.jax import cost as jax_cost

    rng = np.random.default_rng(45)
    w1, w2 = rng.normal(size=(8, 64)).astype(np.float32), rng.normal(size=(64, 4)).astype(np.float32)
    kernel = rng.normal(size=(3, 3, 2, 5)).astype(np.float32)  # HWIO

    def mlp(x: Any) -> Any:
        return jnp.tanh(x @ w1) @ w2

    def conv(x: Any) -> Any:
        return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def looped(x: Any) -> Any:
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w1[:, :8].T @ w1[:, :8]), None), x,
                            None, length=5)[0]

    for fn, shape, trips in ((jax.vmap(jax.jacrev(mlp)), (100, 8), 1),
                             (conv, (4, 12, 12, 2), 1), (looped, (50, 8), 5)):
        arg = rng.normal(size=shape).astype(np.float32)
        staged = jax.jit(fn).trace(arg)
        ours = jax_cost.flops(staged.jaxpr)
        xla = staged.lower().cost_analysis()["flops"]
        assert ours == pytest.approx(trips * xla, rel=0.15), fn
    # the two kinds of work apart: W1's products against its elementwise maths
    w = jax_cost.work(jax.jit(jax.vmap(jax.jacrev(mlp))).trace(rng.normal(size=(100, 8))
                                                               .astype(np.float32)).jaxpr)
    # the forward pass of 100 rows, the unit cotangents through w2 (not batched: once), and
    # the 4 cotangents of each row back through w1
    products = 2 * 100 * (8 * 64 + 64 * 4) + 2 * 4 * 4 * 64 + 2 * 100 * 4 * 64 * 8
    assert w.products == products
    assert 0 < w.elements < w.products / 4


@pytest.mark.parametrize("workload", ["W1", "W2"])
def test_the_probes_read_one_trace_of_the_forward_derivative(workload: str) -> None:
    """The abstract probes (rows apart, connected, the output shape) read one jaxpr, of the
    model's forward derivative: a first call runs the model's Python three times (the output
    shape and a row's working set for the plan, that jaxpr, the kernel's trace), not five; the
    zero tangent of the
    known inputs concatenated inside W1 is proven to stand beside the rows."""
    inner = workload_model(workload, "jax")
    calls: list[int] = []

    def model(z: Any) -> Any:
        calls.append(1)
        return inner(z)

    unknown, known = workload_inputs(workload, 12, seed=49)
    data_ = (unknown,) if known is None else (unknown, known)
    jac = batchjac.jacobian(model, *data_)
    bound = bound_of(model)
    assert bound.probed
    assert bound.output_shape == (jac.shape[1],)
    assert bound.row_bytes is not None
    assert bound.row_bytes > 0
    assert len(calls) == 3

    def one(u: Any, h: Any) -> Any:
        x = u if h is None else jnp.concatenate([u, h], axis=-1)
        return inner(x[None])[0]

    ref = jax.vmap(jax.jacrev(one), in_axes=(0, None if known is None else 0))(unknown, known)
    np.testing.assert_allclose(jac, np.asarray(ref), rtol=1e-4, atol=1e-6)


def test_the_executable_writer_waits_for_the_kernels_to_be_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer serializes a new executable once no kernel was called for WRITE_DELAY (the
    chunks after a call's first keep it waiting), and no later than MAX_WRITE_WAIT after it
    was queued: on a fake clock, with kernel calls that stop, and ones that never stop."""
    from batchjac._backends.jax import executables as jx

    clock = [100.0]
    calls: list[float] = []  # when the "chunks" call a kernel (fake seconds)

    def sleep(seconds: float) -> None:
        end = clock[0] + seconds
        while calls and calls[0] <= end:  # a chunk launched while the writer sleeps
            clock[0] = calls.pop(0)
            jx.used()
        clock[0] = end

    monkeypatch.setattr(jx.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(jx.time, "sleep", sleep)
    jx.used()
    calls[:] = [100.03, 100.06, 100.09]  # three more chunks, 30 ms apart
    jx._quiet(queued=100.0)
    assert clock[0] == pytest.approx(100.09 + jx.WRITE_DELAY)
    jx.used()
    calls[:] = [clock[0] + 0.01 * i for i in range(1, 1000)]  # a kernel called without end
    start = clock[0]
    jx._quiet(queued=start)
    assert clock[0] == pytest.approx(start + jx.MAX_WRITE_WAIT)


def test_the_steady_build_compiles_beside_the_quick_one_and_takes_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a second core, the build a large chunk would have compiled first ("default") is
    compiled on a thread beside the quick one, and the first call after it is ready runs it
    (the race among the full builds is still to come); with one core it is not, and the quick
    build stays until the race. Every build gives finite differences' Jacobians."""
    needs_build("quick")
    from batchjac._backends.jax import builds, executables as jax_executables

    w = data((4, 6), seed=51)
    x = data((64, 4), seed=52)
    ref = central_differences(lambda v: _smooth(v, w.astype(np.float64), np), x)

    def make() -> Any:
        wj = w.copy()  # (numpy: each model its own, not a twin of the other)
        return lambda v: _smooth(v, jnp.asarray(wj), jnp)

    model = make()
    assert_jac_close(batchjac.jacobian(model, x, mode="reverse"), ref)
    kernel = bound_of(model).kernel("reverse", 64, False)
    assert kernel.variant == "quick"
    assert set(kernel._pending) == {"default"}  # on the tier-up thread
    jax_executables.compiled_beside()
    assert_jac_close(batchjac.jacobian(model, x, mode="reverse"), ref)
    assert kernel.variant == "default"
    assert "compiled beside the quick first build" in kernel.note
    assert kernel.untimed  # the race among the full builds is still to come
    assert not kernel._pending

    monkeypatch.setattr(builds, "idle_core", lambda: False)
    single = make()
    for _ in range(3):
        assert_jac_close(batchjac.jacobian(single, x, mode="reverse"), ref)
    kernel = bound_of(single).kernel("reverse", 64, False)
    assert kernel.variant == "quick"
    assert not kernel._pending
