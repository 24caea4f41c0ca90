"""Each private or version-specific TensorFlow and Keras name of the TensorFlow backend
(batchjac._backends.tensorflow.compat: #1-12 of the fragility census in the engine review),
removed, renamed or changed: the numbers stay right, slower at most; where no fallback can
exist, the error names the versions.

References: the closed form of a two-layer tanh network (its Jacobians and Hessians in
float64), and of ``sin``.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import assert_jac_close, race_now, rng

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from batchjac import _keras_compat  # noqa: E402
from batchjac._backends import tensorflow as tf_backend  # noqa: E402
from batchjac._backends.tensorflow import (  # noqa: E402
    builds,
    compat,
    keras as keras_rows,
)
from batchjac._bind import prepare  # noqa: E402
from batchjac._validate import normalize  # noqa: E402

K, H, M = 3, 2, 4  # 3 unknowns + 2 known -> 4 outputs, through 6 tanh units
_r = np.random.default_rng(3412)
# (float32 values: a float32 Keras model and its float64 clone hold exactly these)
W1, B1, W2, B2 = (a.astype(np.float32).astype(np.float64) for a in (
    _r.normal(size=(K + H, 6)) * 0.6, _r.normal(size=(6,)) * 0.1,
    _r.normal(size=(6, M)) * 0.6, _r.normal(size=(M,)) * 0.1))


def closed_form(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(J, H)`` of ``tanh(x W1 + b1) W2 + b2`` over every input column, in float64."""
    x = np.asarray(x, np.float64)
    t = np.tanh(x @ W1 + B1)
    d1 = 1 - t * t
    jac = np.einsum("ho,nh,ih->noi", W2, d1, W1)
    return jac, np.einsum("ho,nh,ih,jh->noij", W2, -2 * t * d1, W1, W1)


def jac_ref(u: np.ndarray, h: np.ndarray) -> np.ndarray:
    return closed_form(np.concatenate([u, h], 1))[0][:, :, :K]


def hess_ref(u: np.ndarray, h: np.ndarray) -> np.ndarray:
    return closed_form(np.concatenate([u, h], 1))[1][:, :, :K, :K]


def keras_mlp() -> Any:
    model = keras.Sequential([keras.Input((K + H,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(M)])
    model.set_weights([a.astype(np.float32) for a in (W1, B1, W2, B2)])
    return model


def tf_mlp(dtype: Any = tf.float64) -> Any:
    w1, b1, w2, b2 = (tf.constant(a, dtype) for a in (W1, B1, W2, B2))

    @tf.function(autograph=False)
    def f(z: Any) -> Any:
        return tf.tanh(z @ w1 + b1) @ w2 + b2

    return f


def inputs(n: int = 12, seed: int = 0, dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
    x = rng(seed).normal(size=(n, K + H)).astype(dtype)
    return x[:, :K], x[:, K:]


def probe_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each call of the probes' forward pass (none where the layers proved the rows apart)."""
    calls: list[str] = []
    original = tf_backend.TFBound.forward
    monkeypatch.setattr(tf_backend.TFBound, "forward",
                        lambda self, *a: calls.append("forward") or original(self, *a))
    return calls


def explained(call: Any) -> tuple[Any, str]:
    """``call()``'s result and what ``explain=True`` wrote."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out = call()
    return out, err.getvalue()


def nested_map_fn(w: np.ndarray) -> Any:
    """x -> sin(x @ w) through a map_fn in a map_fn, which pfor cannot vectorise."""
    wt = tf.constant(w, tf.float32)

    @tf.function(autograph=False)
    def f(x: Any) -> Any:
        return tf.map_fn(lambda r: tf.map_fn(tf.sin, r), x @ wt)

    return f


def test_the_keras_model_here_is_proven_row_by_row_without_a_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The model of #1 and #2 as it is: its layers prove its rows apart and the probes call
    nothing (so the tests below, where they do call, test the fallback)."""
    calls = probe_calls(monkeypatch)
    model = keras_mlp()
    assert keras_rows.output_shape(model) == (M,)
    u, h = inputs()
    assert_jac_close(batchjac.jacobian(model, u, h), jac_ref(u, h), np.float32)
    assert calls == []


# -- 1, 2: the Keras layer walk and the row-wise allowlist -------------------------------------


@pytest.mark.parametrize("how", ["renamed", "another signature"])
def test_1_without_the_keras_layer_walk_the_probes_call_the_model(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = keras_mlp()
    if how == "renamed":
        monkeypatch.setattr(compat, "FLATTEN_LAYERS", "_flatten_layers_renamed")
    else:
        def refuses(*args: Any, **kwargs: Any) -> Any:
            raise TypeError("_flatten_layers() got an unexpected keyword argument 'include_self'")

        monkeypatch.setattr(model, compat.FLATTEN_LAYERS, refuses)
    assert compat.keras_layers(model) is None
    assert keras_rows.output_shape(model) is None
    calls = probe_calls(monkeypatch)
    u, h = inputs(seed=1)
    assert_jac_close(batchjac.jacobian(model, u, h), jac_ref(u, h), np.float32)
    assert calls  # the probes ran with values


def test_1_the_layer_walk_of_the_probes_and_the_fingerprint_renamed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The same Keras name read before a backend is chosen (batchjac._keras_compat: the probes'
    layer list, the computation fingerprint's): renamed, the layers are the public top-level
    ones, the fingerprint still tells two models apart, and the Jacobians stay right."""
    from batchjac import _fingerprint, _keras_compat

    monkeypatch.setattr(_keras_compat, "FLATTEN_LAYERS", "_flatten_layers_renamed")
    monkeypatch.setattr(compat, "FLATTEN_LAYERS", "_flatten_layers_renamed")
    model = keras_mlp()
    assert _keras_compat.flattened(model, include_self=True) is None
    wider = keras.Sequential([keras.Input((K + H,)), keras.layers.Dense(7, activation="tanh"),
                              keras.layers.Dense(M)])
    assert _fingerprint.computation_fingerprint(model) != \
        _fingerprint.computation_fingerprint(wider)
    u, h = inputs(seed=4)
    assert_jac_close(batchjac.jacobian(model, u, h), jac_ref(u, h), np.float32)


def test_2_a_layer_class_keras_no_longer_exports_means_the_probes_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Keras renames or moves Dense: the allowlist's name finds no class, so the model is
    probed with values, never taken as row-wise unseen."""
    exported = compat._exported
    monkeypatch.setattr(compat, "_exported",
                        lambda home, name: None if name == "Dense" else exported(home, name))
    model = keras_mlp()
    assert keras_rows.output_shape(model) is None
    calls = probe_calls(monkeypatch)
    u, h = inputs(seed=2)
    assert_jac_close(batchjac.jacobian(model, u, h), jac_ref(u, h), np.float32)
    assert calls


def test_2_a_class_that_only_looks_like_keras_is_probed() -> None:
    """A Keras-named class of a Keras module that is not the class Keras exports (here a
    subclass of Dense that centres each column over the batch): the probes run and find the
    rows mixed, where the allowlist by name took it for row-wise."""

    class Dense(keras.layers.Dense):
        def call(self, x: Any) -> Any:
            y = super().call(x)
            return y - tf.reduce_mean(y, axis=0, keepdims=True)

    Dense.__module__ = keras.layers.Dense.__module__
    model = keras.Sequential([keras.Input((4,)), Dense(3)])
    assert keras_rows.output_shape(model) is None
    x = rng(3).normal(size=(10, 4)).astype(np.float32)
    with pytest.raises(batchjac.RowInteractionError):
        batchjac.jacobian(model, x)


# -- 3: the flat call of a concrete function ---------------------------------------------------


def _concrete_class() -> Any:
    def double(x: Any) -> Any:
        return 2 * x

    fn = tf.function(double, autograph=False)
    return type(fn.get_concrete_function(tf.TensorSpec((None,), tf.float32)))


@pytest.mark.parametrize("how", ["renamed", "another signature", "refuses the arguments"])
def test_3_without_the_flat_call_the_public_call(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = _concrete_class()
    refused: list[int] = []
    if how == "renamed":
        monkeypatch.setattr(compat, "CALL_FLAT", "_call_flat_renamed")
    elif how == "another signature":
        original = cls._call_flat

        def with_a_third(self: Any, tensor_inputs: Any, captured_inputs: Any,
                         cancellation_manager: Any) -> Any:
            return original(self, tensor_inputs, captured_inputs)

        monkeypatch.setattr(cls, "_call_flat_strict", with_a_third, raising=False)
        monkeypatch.setattr(compat, "CALL_FLAT", "_call_flat_strict")
    else:
        def refuses(self: Any, tensor_inputs: Any, captured_inputs: Any) -> Any:
            refused.append(1)
            raise TypeError("_call_flat() takes a list of TensorSpec-matched arguments")

        monkeypatch.setattr(cls, "_call_flat_strict", refuses, raising=False)
        monkeypatch.setattr(compat, "CALL_FLAT", "_call_flat_strict")
    model = tf_mlp(tf.float32)
    u, h = inputs(24, seed=4)
    for _ in range(2):  # chunks after the first go through the kernel's selected call
        assert_jac_close(batchjac.jacobian(model, u, h, chunk_size=8), jac_ref(u, h), np.float32)
    if how == "refuses the arguments":
        assert refused == [1]  # tried once, then the public call from then on


# -- 4, 5: the GPU's memory --------------------------------------------------------------------


def _fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: ["GPU:0"])


def test_4_without_device_lib_there_is_no_device_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    client = sys.modules.get("tensorflow.python.client")
    if client is not None:
        monkeypatch.delattr(client, "device_lib", raising=False)
    monkeypatch.setitem(sys.modules, "tensorflow.python.client.device_lib", None)
    assert compat.gpu_memory_limit() is None
    monkeypatch.setattr(tf_backend, "_LIMIT", [])
    _fake_gpu(monkeypatch)
    assert tf_backend._gpu_free_bytes() is None  # (the planner then uses the host's budget)
    u, h = inputs(seed=5)
    assert_jac_close(batchjac.jacobian(tf_mlp(tf.float32), u, h), jac_ref(u, h), np.float32)


@pytest.mark.parametrize("how", ["missing", "another result"])
def test_5_without_get_memory_info_there_is_no_device_budget(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(tf_backend, "_LIMIT", [12 * 2**30])
    if how == "missing":
        monkeypatch.delattr(tf.config.experimental, "get_memory_info")
    else:
        monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                            lambda device: {"bytes_in_use": 2 * 2**30})
    assert compat.gpu_memory_used() is None
    assert tf_backend._gpu_free_bytes() is None
    u, h = inputs(seed=6)
    assert_jac_close(batchjac.jacobian(tf_mlp(tf.float32), u, h), jac_ref(u, h), np.float32)


# -- 6: batch_jacobian without its pfor keyword ------------------------------------------------


def test_6_batch_jacobian_without_its_pfor_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    original = tf.GradientTape.batch_jacobian

    def batch_jacobian(self: Any, target: Any, source: Any,
                       unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
                       parallel_iterations: Any = None) -> Any:
        return original(self, target, source, unconnected_gradients=unconnected_gradients,
                        parallel_iterations=parallel_iterations)

    monkeypatch.setattr(tf.GradientTape, "batch_jacobian", batch_jacobian)
    loops: list[int] = []
    looped = builds._looped_reverse
    monkeypatch.setattr(builds, "_looped_reverse", lambda *a: loops.append(1) or looped(*a))
    u, h = inputs(seed=7)
    assert_jac_close(batchjac.jacobian(tf_mlp(tf.float32), u, h, mode="reverse"), jac_ref(u, h),
                     np.float32)
    assert loops == []  # vectorised: batch_jacobian as it is
    w = (np.arange(10.0).reshape(5, 2) * 0.1 - 0.4)
    x = rng(8).normal(size=(9, 5)).astype(np.float32)
    with pytest.warns(batchjac.VectorizationFallbackWarning, match="could not vectorise"):
        jac = batchjac.jacobian(nested_map_fn(w), x, mode="reverse")
    assert loops  # the while loop over the outputs, in public calls
    assert_jac_close(jac, np.cos(x.astype(np.float64) @ w)[:, :, None] * w.T[None], np.float32)


# -- 7: what a tf.function is ------------------------------------------------------------------


def test_7_a_tf_function_is_told_without_polymorphic_function(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own Python function is traced for the forward Laplacian (a tf.function not told
    as one would be wrapped again, and its graph would hold one call, with no rule)."""
    for name in ("PolymorphicFunction", "GenericFunction"):
        monkeypatch.delattr(tf.types.experimental, name, raising=False)
    f = tf_mlp()
    assert compat.is_tf_function(f)
    assert not compat.is_tf_function(lambda z: z)
    x = rng(9).normal(size=(10, K + H))
    lap, err = explained(lambda: batchjac.laplacian(f, x, explain=True))
    assert "forward-laplacian (not timed" in err, err
    np.testing.assert_allclose(lap, np.trace(closed_form(x)[1], axis1=-2, axis2=-1),
                               rtol=1e-10, atol=1e-12)


# -- 8: TensorFlow's noise ---------------------------------------------------------------------


def test_8_without_the_log_filter_and_the_retracing_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """pfor's log records and TensorFlow's retracing warning then show: the numbers do not
    change."""
    monkeypatch.setattr(compat, "PFOR_PATH", "parallel_for_renamed")
    monkeypatch.setattr(compat, "OMIT_RETRACING_WARNING", "_omit_frequent_tracing_warning_renamed")
    w = (np.arange(10.0).reshape(2, 5) * 0.1 - 0.4)
    x = rng(10).normal(size=(9, 2)).astype(np.float32)
    with pytest.warns(batchjac.VectorizationFallbackWarning, match="could not vectorise"):
        jac = batchjac.jacobian(nested_map_fn(w), x)
    assert_jac_close(jac, np.cos(x.astype(np.float64) @ w)[:, :, None] * w.T[None], np.float32)
    for width in range(2, 7):  # the probes' forward pass, retraced for every width
        z = rng(width).normal(size=(6, width)).astype(np.float32)
        jac = batchjac.jacobian(lambda v: tf.sin(v) * 2.0, z, backend="tensorflow")
        assert_jac_close(jac, np.eye(width)[None] * (2 * np.cos(z.astype(np.float64)))[:, :, None],
                         np.float32)


# -- 9: the Keras float64 clone ----------------------------------------------------------------


@pytest.mark.parametrize("missing", ["config's dtype policy", "every dtype policy", "serialisation"])
def test_9_the_float64_clone_without(missing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """float64 inputs into a float32 Keras model: a float64 clone, within float64's tolerance
    of the closed form (a float32 computation is not)."""
    if missing in ("config's dtype policy", "every dtype policy"):
        monkeypatch.delattr(keras.config, "set_dtype_policy")
    if missing == "every dtype policy":
        monkeypatch.delattr(keras.mixed_precision, "set_global_policy")
    if missing == "serialisation":
        def refuses(*args: Any, **kwargs: Any) -> Any:
            raise TypeError("serialize_keras_object() takes another schema")

        monkeypatch.setattr(keras.saving, "serialize_keras_object", refuses)
    u, h = inputs(seed=11, dtype=np.float64)
    jac = batchjac.jacobian(keras_mlp(), u, h)
    assert jac.dtype == np.float64
    assert_jac_close(jac, jac_ref(u, h), np.float64)


def _widen_all_but_inputs(cfg: Any, dtype: str = "float64") -> Any:
    """The widening of a Keras whose Input layers' config it does not know."""
    if isinstance(cfg, dict) and cfg.get("class_name") == "InputLayer":
        return cfg
    if isinstance(cfg, dict):
        out = {k: _widen_all_but_inputs(v, dtype) for k, v in cfg.items()}
        if isinstance(out.get("dtype"), (str, dict)):
            out["dtype"] = dtype
        return out
    if isinstance(cfg, list):
        return [_widen_all_but_inputs(v, dtype) for v in cfg]
    return cfg


def test_9_a_clone_that_would_round_its_inputs_is_refused_naming_the_versions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its float32 Input layer would round float64 inputs before the first layer: an error
    that names the versions, not results off by float32's rounding."""
    monkeypatch.setattr(_keras_compat, "widen_config", _widen_all_but_inputs)
    u, h = inputs(seed=12, dtype=np.float64)
    with pytest.raises(batchjac.InputError, match=r"float32 inputs.*\(TensorFlow [\d.]+, Keras"):
        batchjac.jacobian(keras_mlp(), u, h)


def test_9_a_keras_that_cannot_clone_names_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuses(*args: Any) -> Any:
        raise RuntimeError("this Keras has no config for the model")

    monkeypatch.setattr(_keras_compat, "clone_from_config", refuses)
    model = keras_mlp()
    u, h = inputs(seed=13, dtype=np.float64)
    with pytest.raises(batchjac.InputError,
                       match=r"could not be cloned in float64 \(TensorFlow [\d.]+, Keras [\d.]+\)"):
        batchjac.jacobian(model, u, h)
    u32, h32 = u.astype(np.float32), h.astype(np.float32)  # float32 as it is
    assert_jac_close(batchjac.jacobian(model, u32, h32), jac_ref(u32, h32), np.float32)


# -- 10, 11: re-creating graph operations, and the op-type tables ------------------------------


def _second_order(f: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    (lap, hess), err = explained(lambda: (batchjac.laplacian(f, x, explain=True),
                                          batchjac.hessian(f, x, explain=True)))
    return lap, hess, err


def _check_second_order(lap: np.ndarray, hess: np.ndarray, x: np.ndarray) -> None:
    want = closed_form(x)[1]
    np.testing.assert_allclose(hess, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lap, np.trace(want, axis1=-2, axis2=-1), rtol=1e-10, atol=1e-12)


def test_the_forward_rules_take_the_model_here() -> None:
    """The model of #10 and #11 as it is: the forward Laplacian and the forward Hessian."""
    x = rng(14).normal(size=(10, K + H))
    lap, hess, err = _second_order(tf_mlp(), x)
    assert "a forward Laplacian (one pass)" in err, err
    assert "a forward Hessian (one pass)" in err, err
    _check_second_order(lap, hess, x)


@pytest.mark.parametrize("how", ["renamed", "refuses the arguments"])
def test_10_without_create_op_the_other_builds(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "refuses the arguments":
        def refuses(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise TypeError("create_op() got an unexpected keyword argument 'attrs'")

        monkeypatch.setattr(tf.Graph, "create_op_strict", refuses, raising=False)
        monkeypatch.setattr(compat, "CREATE_OP", "create_op_strict")
    else:
        monkeypatch.setattr(compat, "CREATE_OP", "create_op_renamed")
    x = rng(15).normal(size=(10, K + H))
    lap, hess, err = _second_order(tf_mlp(), x)
    assert "cannot re-create" in err, err
    assert "one pass" not in err, err
    _check_second_order(lap, hess, x)


@pytest.mark.parametrize("op", ["Tanh", "MatMul", "AddV2"])
def test_11_an_op_type_the_tables_do_not_know_takes_the_other_builds(
        op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TensorFlow that renames an operation: no rule and no table entry matches the new
    name, so the forward rules are not used (never a rule by likeness)."""
    op_type = compat.op_type
    monkeypatch.setattr(compat, "op_type",
                        lambda o: f"{op}V9" if op_type(o) == op else op_type(o))
    x = rng(16).normal(size=(10, K + H))
    lap, hess, err = _second_order(tf_mlp(), x)
    assert f"no forward-Laplacian rule for the operation {op}V9" in err, err
    _check_second_order(lap, hess, x)


def test_11_stop_gradient_has_no_rule_and_no_dead_entry() -> None:
    assert not [name for name in compat.AFFINE | compat.MULTILINEAR if "never" in name.lower()]
    x = rng(17).normal(size=(10, 3))
    lap, err = explained(lambda: batchjac.laplacian(
        lambda z: tf.reduce_sum(tf.sin(z) + tf.stop_gradient(z) ** 2, -1), x, backend="tensorflow",
        explain=True))
    assert "no forward-Laplacian rule for the operation StopGradient" in err, err
    np.testing.assert_allclose(lap, -np.sin(x).sum(-1), rtol=1e-10, atol=1e-12)


# -- 12: the inputs of second-order builds, assembled twice-differentiably under XLA -----------


def _hessian_kernel(order: str, u: np.ndarray, h: np.ndarray, build: str) -> tuple[Any, Any]:
    spec = normalize((u, h), wrt=None, dtype=None, nan_policy="raise")
    kernel = prepare(tf_mlp(), spec, "tensorflow", {}).second_kernel(
        "hessian", order, spec.n, True, True)
    kernel.use(build)
    return kernel, spec.chunk(0, spec.n)


@pytest.mark.parametrize("order", ["forward-over-reverse", "forward-over-forward"])
def test_12_the_twice_differentiable_assembly_under_xla(order: str) -> None:
    """Concat and gather as selector products (public operations): the same values, and XLA
    differentiates them twice where it cannot differentiate its own concat's gradient."""
    r = rng(19)
    xs = [tf.constant(r.normal(size=(4, 3))), tf.constant(r.normal(size=(4, 2)))]
    np.testing.assert_array_equal(compat.twice_concat(xs), tf.concat(xs, -1))
    np.testing.assert_array_equal(compat.twice_take(xs[0], (2, 0)), tf.gather(xs[0], [2, 0], axis=-1))
    u, h = inputs(seed=20, dtype=np.float64)
    kernel, (uc, ctx) = _hessian_kernel(order, u, h, "xla")
    out = kernel(uc, ctx)
    assert kernel.variant == "xla"
    np.testing.assert_allclose(out["hessians"], hess_ref(u, h), rtol=1e-10, atol=1e-12)


def test_12_an_xla_gradient_gap_falls_back_to_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TensorFlow whose XLA meets a gradient gap the assembly does not cover: XLA, fixed (as
    a store fixes it) or raced, gives way to the plain graph."""
    from batchjac._backends.tensorflow import second

    built = second.TFSecondKernel._fn

    def gap(self: Any, variant: str) -> Any:
        if variant == "xla":
            raise LookupError("gradient registry has no entry for: XlaDynamicUpdateSlice")
        return built(self, variant)

    monkeypatch.setattr(second.TFSecondKernel, "_fn", gap)
    u, h = inputs(seed=21, dtype=np.float64)
    kernel, (uc, ctx) = _hessian_kernel("forward-over-reverse", u, h, "xla")
    with pytest.warns(batchjac.XLAFallbackWarning, match="XlaDynamicUpdateSlice"):
        out = kernel(uc, ctx)
    assert kernel.variant == "graph"
    np.testing.assert_allclose(out["hessians"], hess_ref(u, h), rtol=1e-10, atol=1e-12)
    race_now(monkeypatch)
    with pytest.warns(batchjac.XLAFallbackWarning):
        hess = batchjac.hessian(tf_mlp(), u, h)
    np.testing.assert_allclose(hess, hess_ref(u, h), rtol=1e-10, atol=1e-12)
