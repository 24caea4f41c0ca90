"""TensorFlow/Keras backend: the conformance suite plus Keras-specific model kinds."""

from __future__ import annotations

import os
import warnings
from typing import Any, ClassVar

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import batchjac  # noqa: E402
from batchjac._backends.tensorflow import XLAFallbackWarning  # noqa: E402
from batchjac._examples import keras as keras_examples  # noqa: E402
from batchjac.examples import mlp_jacobian, mlp_weights, seed_model, workload_inputs  # noqa: E402

from .conformance import SEED_SIZES, BackendConformance  # noqa: E402
from .helpers import assert_jac_close, central_differences, race_now  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class ScaleModel(keras.Model):
    """A subclassed Keras model: y = tanh(x @ w) * s, with a float64-clonable config."""

    def __init__(self, units: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.units = units
        self.dense = keras.layers.Dense(units, activation="tanh")
        self.scale = self.add_weight(shape=(units,), initializer="ones", name="scale")

    def call(self, x: Any) -> Any:
        return self.dense(x) * self.scale

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "units": self.units}


class ConstantModel(keras.Model):
    """Output ignores the input: the original question's `None` pitfall."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.w = self.add_weight(shape=(3,), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        return tf.ones((tf.shape(x)[0], 3), dtype=self.w.dtype) * self.w


class TestTensorFlowConformance(BackendConformance):
    backend: ClassVar[str] = "tensorflow"

    def mlp(self, sizes: tuple[int, ...], dtype: str) -> Any:
        return keras_examples.mlp(sizes, dtype=dtype)

    def linear(self, w: np.ndarray, b: np.ndarray, dtype: str) -> Any:
        model = keras.Sequential([keras.Input((w.shape[0],)), keras.layers.Dense(w.shape[1])])
        model.set_weights([w.astype(dtype), b.astype(dtype)])
        return model

    def linear_3d(self, w: np.ndarray, dtype: str, out_shape: tuple[int, int]) -> Any:
        inp = keras.Input((w.shape[0],))
        dense = keras.layers.Dense(w.shape[1], use_bias=False)
        model = keras.Model(inp, keras.layers.Reshape(out_shape)(dense(inp)))
        dense.set_weights([w.astype(dtype)])
        return model

    def elementwise(self, dtype: str) -> Any:
        @tf.function
        def f(x: Any) -> Any:
            return tf.sin(x) + 0.5 * x**2

        return f

    def two_input(self, wx: np.ndarray, wh: np.ndarray, dtype: str, as_dict: bool) -> Any:
        x_in, h_in = keras.Input((wx.shape[0],), name="x"), keras.Input((wh.shape[0],), name="h")
        dx = keras.layers.Dense(wx.shape[1], use_bias=False)
        dh = keras.layers.Dense(wh.shape[1], use_bias=False)
        out = keras.layers.Activation("tanh")(keras.layers.Add()([dx(x_in), dh(h_in)]))
        inputs: Any = {"x": x_in, "h": h_in} if as_dict else [x_in, h_in]
        model = keras.Model(inputs, out)
        dx.set_weights([wx.astype(dtype)])
        dh.set_weights([wh.astype(dtype)])
        return model

    def disconnected(self, dtype: str) -> Any:
        model = ConstantModel()
        model(np.zeros((1, 4), dtype))
        return model

    def batch_coupled(self, dtype: str) -> Any:
        return lambda x: x - tf.reduce_mean(x, axis=0, keepdims=True)


# ---- Keras model kinds --------------------------------------------------------------------


def _float64_twin(model: Any, width: int) -> Any:
    """A float64 forward of a Keras model (same config, float64 weights), for FD references."""
    twin = batchjac._backends.tensorflow._float64_copy(model, lambda c: c(np.ones((1, width))))
    return lambda x: twin(tf.constant(x), training=False).numpy()


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_subclassed_model_against_fd(mode: str) -> None:
    model = ScaleModel(units=3)
    x = np.random.default_rng(1).normal(size=(40, 6)).astype("float32")
    model(x[:1])
    jac = batchjac.jacobian(model, x, wrt=[0, 2, 5], mode=mode)
    f64 = _float64_twin(model, 6)
    x64 = x.astype(np.float64)

    def sub(u: np.ndarray) -> np.ndarray:
        full = x64.copy()
        full[:, [0, 2, 5]] = u
        return f64(full)

    assert_jac_close(jac, central_differences(sub, x64[:, [0, 2, 5]]))
    jac64 = batchjac.jacobian(model, x.astype(np.float64), wrt=[0, 2, 5], mode=mode)
    assert jac64.dtype == np.float64
    assert_jac_close(jac64, central_differences(sub, x64[:, [0, 2, 5]]), dtype=np.float64, factor=100)


def test_batchnorm_and_dropout_run_in_inference_mode() -> None:
    rng = np.random.default_rng(2)
    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(2),
    ])
    bn = model.layers[1]
    bn.set_weights([rng.uniform(0.5, 2, 8), rng.normal(size=8), rng.normal(size=8), rng.uniform(0.5, 2, 8)])
    x = rng.normal(size=(64, 5)).astype("float32")
    jac = batchjac.jacobian(model, x)
    ref = central_differences(_float64_twin(model, 5), x.astype(np.float64))
    assert_jac_close(jac, ref)
    # deterministic: dropout off, moving statistics used
    np.testing.assert_array_equal(jac, batchjac.jacobian(model, x))


def test_plain_tf_function_with_variables() -> None:
    w = tf.Variable(np.random.default_rng(3).normal(size=(4, 2)).astype("float32"))

    @tf.function
    def f(x: Any) -> Any:
        return tf.tanh(x @ w) ** 2

    x = np.random.default_rng(4).normal(size=(30, 4)).astype("float32")
    w64 = w.numpy().astype(np.float64)
    ref = central_differences(lambda u: np.tanh(u @ w64) ** 2, x.astype(np.float64))
    assert_jac_close(batchjac.jacobian(f, x), ref)
    # the variable is read at run time: a new value gives a new Jacobian, no stale cache
    w.assign(w * 2)
    jac2 = batchjac.jacobian(f, x)
    # doubled weights saturate tanh on some rows, where float32's 1 - tanh**2 keeps few digits
    # (row 18: 22% off the float64 value, 1e-5 of the largest entry): the reference there is
    # TensorFlow's own float32 Jacobian, and float64 differences hold where float32 can
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = f(xt)
    np.testing.assert_allclose(jac2, tape.batch_jacobian(y, xt).numpy(), rtol=1e-5, atol=1e-7)
    ref2 = central_differences(lambda u: np.tanh(u @ (2 * w64)) ** 2, x.astype(np.float64))
    np.testing.assert_allclose(jac2, ref2, rtol=1e-4, atol=1e-5 * np.abs(ref2).max())
    assert not np.allclose(jac2, ref, rtol=1e-2), "the Jacobian of the old weights came back"


def test_float64_copy_follows_weight_updates() -> None:
    model = keras_examples.mlp(SEED_SIZES)
    x = np.random.default_rng(5).normal(size=(10, 8))  # float64 inputs -> float64 compute
    batchjac.jacobian(model, x)
    new = [w * 1.5 for w in model.get_weights()]
    model.set_weights(new)
    layers = [(new[i].astype(np.float64), new[i + 1].astype(np.float64)) for i in range(0, len(new), 2)]
    assert_jac_close(batchjac.jacobian(model, x), mlp_jacobian(layers, x), dtype=np.float64)


def test_unused_unknowns_get_zero_columns() -> None:
    model = keras_examples.mlp((3, 16, 2))

    def f(x: Any) -> Any:
        return model(x[:, :3], training=False)  # columns 3 and 4 are never read

    x = np.random.default_rng(6).normal(size=(20, 5)).astype("float32")
    jac = batchjac.jacobian(f, x, backend="tensorflow")
    assert jac.shape == (20, 2, 5)
    np.testing.assert_array_equal(jac[:, :, 3:], 0.0)
    assert_jac_close(jac[:, :, :3], mlp_jacobian(mlp_weights((3, 16, 2)), x[:, :3]))


def test_output_computed_outside_tensorflow_is_explained() -> None:
    model = keras_examples.mlp((3, 16, 2))

    def leaky(x: Any) -> Any:
        return tf.constant(np.tanh(x.numpy()))  # leaves TensorFlow: no gradient path

    x = np.random.default_rng(7).normal(size=(5, 3)).astype("float32")
    with pytest.raises(batchjac.ModelError, match="leaves TensorFlow"):
        batchjac.jacobian(leaky, x, backend="tensorflow")

    def predict_inside(x: Any) -> Any:
        return tf.constant(model.predict(x, verbose=0))

    # model.predict inside the traced function: the same pitfall, named as such (it once came
    # back as a bare "Calling the model failed: AttributeError: ... no attribute 'numpy'")
    with pytest.raises(batchjac.ModelError, match=r"It leaves TensorFlow \(\.numpy\(\), numpy functions or "
                                                  r"model\.predict\), so gradients cannot flow"):
        batchjac.jacobian(predict_inside, x, backend="tensorflow")


def test_multi_output_model_is_refused() -> None:
    inp = keras.Input((3,))
    model = keras.Model(inp, [keras.layers.Dense(2)(inp), keras.layers.Dense(1)(inp)])
    x = np.random.default_rng(8).normal(size=(4, 3)).astype("float32")
    with pytest.raises(batchjac.ModelError, match="list of 2 outputs"):
        batchjac.jacobian(model, x)


def test_batch_statistics_layer_is_refused() -> None:
    class BatchNormTrain(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            mean, var = tf.nn.moments(x, axes=[0])
            return (x - mean) / tf.sqrt(var + 1e-3)

    model = keras.Sequential([keras.Input((4,)), BatchNormTrain(), keras.layers.Dense(2)])
    x = np.random.default_rng(9).normal(size=(16, 4)).astype("float32")
    with pytest.raises(batchjac.RowInteractionError, match="tensorflow#38428"):
        batchjac.jacobian(model, x)


def test_xla_fallback_warns_once_and_is_correct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where XLA is tried (a race, or a store, which fixes XLA) and cannot compile the model,
    the plain graph runs with one warning. (An untimed first call runs the graph anyway; the
    race on the next calls tries XLA.)"""
    from batchjac._backends._base import made_beside

    race_now(monkeypatch)

    @tf.function
    def f(x: Any) -> Any:
        # string ops have no XLA kernel; per row, and the gradient flows through sin
        two = tf.strings.to_number(tf.strings.as_string(tf.round(x) * 0 + 2))
        return tf.sin(x) * two

    x = np.random.default_rng(10).normal(size=(12, 3)).astype("float32")
    ref = np.einsum("ni,ij->nij", np.cos(x.astype(np.float64)) * 2, np.eye(3))
    # the race of builds rides on the calls: XLA fails on the call it meets, which the plain
    # graph answers again; one warning in all, every call's Jacobians right (XLA is made
    # beside the calls where a core is free: waited for here, so that the race meets it)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(10):
            assert_jac_close(batchjac.jacobian(f, x), ref)
            made_beside(60)
    said = [str(w.message) for w in seen if issubclass(w.category, XLAFallbackWarning)]
    assert len(said) == 1, said
    assert "XLA could not compile" in said[0]
    from batchjac import _backends

    # the race ended without XLA (it did not go on timing XLA's failing call)
    kernels = next(iter(_backends._bound[f].values())).kernels()
    assert kernels
    assert all(k.call_race is None for k in kernels), [(k.variants, k.note) for k in kernels]
    assert any(k.variants == ("graph",) for k in kernels), [(k.variants, k.note) for k in kernels]


def test_100k_rows_trace_once_per_mode_and_dtype() -> None:
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 100_000, seed=11)
    from batchjac import _backends

    counts = {}
    for mode in ("forward", "reverse"):
        jac = batchjac.jacobian(model, unknown, known, mode=mode, chunk_size=16384)
        bound = next(b for b in _backends._bound[model].values() if b.signature.dtype == np.float32)
        counts[mode] = bound.trace_count
    # 7 chunks each: one trace per mode (its XLA build), none per chunk; the plain graph is
    # traced and raced against XLA only once the work seen repays it (batchjac._tune.policy)
    assert counts == {"forward": 1, "reverse": 2}
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown[-500:], known[-500:]], 1))
    assert_jac_close(jac[-500:], ref[:, :, :5])


def test_the_races_xla_build_compiles_the_traced_graph() -> None:
    """The later race's XLA build is XLA of a call of the plain graph the first call traced:
    the model and its Jacobian are not traced again, and XLA's Jacobians are the graph's."""
    from batchjac import _backends

    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 64, seed=15)
    graph_jac = batchjac.jacobian(model, unknown, known, mode="reverse")  # untimed: the graph
    bound = next(iter(_backends._bound[model].values()))
    (kernel,) = [k for k in bound.kernels() if k.mode == "reverse"]
    assert kernel.variant == "graph"
    traces = bound.trace_count
    kernel.use("xla")
    _, xla_jac = kernel(unknown, (known,))
    assert bound.trace_count == traces
    assert kernel.variant == "xla"
    assert_jac_close(np.asarray(xla_jac), np.asarray(graph_jac))
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))
    assert_jac_close(np.asarray(xla_jac), ref[:, :, :5])


def _graph_first_w1(seed: int) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, Any]:
    """The seed model's first reverse-mode call on 64 W1 rows, right and untimed on the plain
    graph: ``(model, unknown, known, reference Jacobians, its kernel)``."""
    from batchjac import _backends

    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 64, seed=seed)
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    assert_jac_close(batchjac.jacobian(model, unknown, known, mode="reverse"), ref)
    bound = next(iter(_backends._bound[model].values()))
    (kernel,) = [k for k in bound.kernels() if k.mode == "reverse"]
    assert kernel.untimed
    assert kernel.variant == "graph"
    return model, unknown, known, ref, kernel


def _threads_making(monkeypatch: pytest.MonkeyPatch, free_core: bool) -> list[str]:
    """With a core free or not, the builds TensorFlow's kernels make, as they are made:
    ``"variant@thread name"``."""
    import threading

    from batchjac._backends.tensorflow import builds

    monkeypatch.setattr(builds, "idle_core", lambda: free_core)
    made_on: list[str] = []
    real = builds.TFKernel._concrete
    monkeypatch.setattr(builds.TFKernel, "_concrete", lambda self, variant: (
        made_on.append(f"{variant}@{threading.current_thread().name}"), real(self, variant))[1])
    return made_on


def test_the_later_race_of_builds_runs_on_the_users_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first call too small to repay a race runs the plain graph untimed; the race it
    skipped rides on the next calls: XLA answers calls (compiled on its first), no build runs
    to be timed only, every call's Jacobians are right, and the race ends with a choice."""
    from batchjac._backends._base import made_beside
    from batchjac._backends.tensorflow.builds import TFKernel

    model, unknown, known, ref, kernel = _graph_first_w1(seed=19)
    timed: list[str] = []
    real = TFKernel.run_build
    answered = []
    with monkeypatch.context() as patch:
        race_now(patch)
        patch.setattr(TFKernel, "run_build", lambda self, name, *a: (
            timed.append(name), real(self, name, *a))[1])
        for _ in range(100):
            assert_jac_close(batchjac.jacobian(model, unknown, known, mode="reverse"), ref)
            answered.append(kernel.variant)
            if kernel.raced:
                break
            made_beside(60)  # (XLA compiling beside the calls, where a core is free)
    assert kernel.raced
    assert kernel.call_race is None
    assert {"xla", "graph"} <= set(answered)
    assert timed == []
    assert "timed one chunk" in kernel.note


@pytest.mark.parametrize("free_core", [True, False])
def test_the_later_races_xla_compiles_beside_the_calls(monkeypatch: pytest.MonkeyPatch,
                                                        free_core: bool) -> None:
    """With a core free, the later race's XLA build is traced and compiled on the thread beside
    the calls (its first run there, on a copy of a chunk): the race costs the calls no
    compilation, and starts once XLA is made; without one, XLA compiles on its first call of
    the race, on the caller's thread. Every call's Jacobians are right either way."""
    from batchjac._backends import _base

    made_on = _threads_making(monkeypatch, free_core)
    model, unknown, known, ref, kernel = _graph_first_w1(seed=23)
    assert kernel.race_compilations == (0 if free_core else 1)
    race_now(monkeypatch)
    answered = []
    for _ in range(200):
        assert_jac_close(batchjac.jacobian(model, unknown, known, mode="reverse"), ref)
        answered.append(kernel.variant)
        if kernel.raced:
            break
        _base.made_beside(60)  # (the calls go on meanwhile; here, so that the race ends soon)
    assert kernel.raced
    assert kernel.call_race is None
    assert "xla" in answered
    xla = [m for m in made_on if m.startswith("xla@")]
    assert len(xla) == 1, made_on
    assert xla[0].endswith("tier-up_0") == free_core, xla


@pytest.mark.parametrize("autotune", ["on", "off"])
def test_the_first_call_computes_the_jacobians_once(monkeypatch: pytest.MonkeyPatch,
                                                     autotune: str) -> None:
    """The first call's run of the build it keeps (the plain graph, untimed; XLA with tuning
    off) is its answer, outputs included: the Jacobians are computed once, not once more after
    the build is chosen (W2's first call computed them twice: 0.3 s of its 1.2 s). The next
    call runs the kept build once."""
    from batchjac._backends.tensorflow import TFKernel

    monkeypatch.setenv("BATCHJAC_AUTOTUNE", autotune)
    runs: list[str] = []
    real_run, real_selected = TFKernel._run, TFKernel._call_selected

    def run(self: Any, variant: str, *args: Any, **kwargs: Any) -> float:
        runs.append(variant)
        return real_run(self, variant, *args, **kwargs)

    def selected(self: Any, *args: Any) -> Any:
        runs.append("selected")
        return real_selected(self, *args)

    monkeypatch.setattr(TFKernel, "_run", run)
    monkeypatch.setattr(TFKernel, "_call_selected", selected)
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 37, seed=14)
    y, jac = batchjac.jacobian(model, unknown, known, return_outputs=True)
    first = "graph" if autotune == "on" else "xla"
    assert runs == [first], runs
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    assert_jac_close(jac, ref)
    np.testing.assert_allclose(y, np.asarray(model(np.concatenate([unknown, known], 1))),
                               rtol=1e-5, atol=1e-6)
    _, again = batchjac.jacobian(model, unknown, known, return_outputs=True)
    assert runs[1:] == ["selected"], runs
    assert_jac_close(again, ref)


def test_agrees_with_xla_batch_jacobian_on_original_scenario() -> None:
    from batchjac._bench.tf_baselines import xla_batch_jacobian

    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 1000, seed=12)
    expert = xla_batch_jacobian(model)(unknown, known)
    ours = batchjac.jacobian(model, unknown, known)
    np.testing.assert_allclose(ours, expert, rtol=1e-5, atol=1e-6)


def test_tensor_inputs() -> None:
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 20, seed=13)
    jac = batchjac.jacobian(model, tf.constant(unknown), tf.constant(known))
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    assert_jac_close(jac, ref)
    jac_lists = batchjac.jacobian(model, unknown.tolist(), known.tolist())
    assert_jac_close(jac_lists, ref)


def test_kernel_times_xla_against_the_plain_graph_and_both_are_right(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from batchjac import _backends
    from batchjac._errors import InputError

    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 300, seed=21)
    race_now(monkeypatch)  # a job large enough to repay the race
    jac = batchjac.jacobian(model, unknown, known, mode="reverse")
    bound = next(b for b in _backends._bound[model].values() if b.signature.dtype == np.float32)
    kernel = bound.kernel("reverse", 300, False)
    assert kernel.variant in ("xla", "graph")
    assert "timed one chunk: XLA" in kernel.note
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    assert_jac_close(jac, ref)
    for variant in ("graph", "xla"):  # either implementation, fixed, gives the same Jacobians
        got = bound.kernel("reverse", 300, False, variant=variant)(unknown, (known,))[1]
        assert kernel.variant == variant
        assert_jac_close(got, ref)
    with pytest.raises(InputError, match="no variant 'cuda'"):
        kernel.use("cuda")


def test_a_large_chunk_races_xla_in_blocks_and_every_build_is_right(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of at least BLOCKED_CHUNK rows has a third build, XLA over blocks of the chunk
    in a tf.map_fn: the race times it beside XLA and the graph, and fixed, each build gives
    the closed-form Jacobians (301 rows in blocks of 8, evened to 38 blocks of 8 rows: the
    last one padded); a smaller chunk has no such build."""
    from batchjac import _backends
    from batchjac._backends.tensorflow import TFKernel

    monkeypatch.setattr(TFKernel, "BLOCK_ROWS", 8)
    monkeypatch.setattr(TFKernel, "BLOCKED_CHUNK", 32)
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 301, seed=23)
    race_now(monkeypatch)
    jac = batchjac.jacobian(model, unknown, known, mode="reverse", chunk_size=301)
    bound = next(b for b in _backends._bound[model].values() if b.signature.dtype == np.float32)
    kernel = bound.kernel("reverse", 301, False)
    assert kernel.variants == ("xla", "graph", "xla/blocks")
    assert "XLA in blocks" in kernel.note, kernel.note
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    assert_jac_close(jac, ref)
    for variant in ("xla/blocks", "graph", "xla"):
        got = bound.kernel("reverse", 301, False, variant=variant)(unknown, (known,))[1]
        assert kernel.variant == variant
        assert_jac_close(got, ref)
    small = bound.kernel("reverse", 31, False)
    assert "xla/blocks" not in small.variants
    # with outputs: the map over blocks carries both results
    y, jac = bound.kernel("reverse", 301, True, variant="xla/blocks")(unknown, (known,))
    assert_jac_close(jac, ref)
    np.testing.assert_allclose(y, model(np.concatenate([unknown, known], 1)).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_explain_names_the_kernel_implementation(capsys: pytest.CaptureFixture[str]) -> None:
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 40, seed=22)
    batchjac.jacobian(model, unknown, known, mode="forward", explain=True)
    err = capsys.readouterr().err
    assert "forward mode" in err
    assert "batchjac: kernel: " in err


def test_recorded_xla_variant_after_a_fallback_keeps_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchjac import _backends

    race_now(monkeypatch)  # the first call tries XLA (and falls back)

    def f(x: Any) -> Any:  # string ops have no XLA kernel
        two = tf.strings.to_number(tf.strings.as_string(tf.round(x) * 0 + 2))
        return tf.sin(x) * two

    x = np.random.default_rng(23).normal(size=(12, 3)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", XLAFallbackWarning)
        batchjac.jacobian(f, x, mode="forward")
    bound = next(iter(_backends._bound[f].values()))
    kernel = bound.kernel("forward", 12, False, variant="xla")  # as a store records it
    assert kernel.variant == "graph"
    ref = np.einsum("ni,ij->nij", np.cos(x.astype(np.float64)) * 2, np.eye(3))
    assert_jac_close(kernel(x, ())[1], ref)


def test_xla_fixed_on_a_running_graph_kernel_falls_back() -> None:
    """A kernel that ran the plain graph untimed, then fixed to XLA (a store's recorded
    variant) on a model XLA cannot compile: the call falls back to the graph, with the warning."""
    from batchjac import _backends

    def f(x: Any) -> Any:  # string ops have no XLA kernel
        two = tf.strings.to_number(tf.strings.as_string(tf.round(x) * 0 + 2))
        return tf.sin(x) * two

    x = np.random.default_rng(24).normal(size=(12, 3)).astype("float32")
    batchjac.jacobian(f, x, mode="forward")  # untimed: the plain graph, XLA never tried
    bound = next(iter(_backends._bound[f].values()))
    kernel = bound.kernel("forward", 12, False, variant="xla")
    with pytest.warns(XLAFallbackWarning, match="XLA could not compile"):
        _, jac = kernel(x, ())
    assert kernel.variant == "graph"
    assert_jac_close(jac, np.einsum("ni,ij->nij", np.cos(x.astype(np.float64)) * 2, np.eye(3)))


@pytest.mark.parametrize("free_core", [True, False])
def test_a_remembered_xla_build_waits_until_the_work_repays_it(monkeypatch: pytest.MonkeyPatch,
                                                               free_core: bool) -> None:
    """An earlier process's race chose XLA: a first call still builds the plain graph (sooner
    built than XLA compiles, the cheaper first answer), and the remembered XLA replaces it,
    without a race, once the work seen repays one more build: with a core free, compiled
    beside the calls, which run the graph until it is made. Right Jacobians throughout."""
    from batchjac import _backends
    from batchjac._backends import _base
    from batchjac._tune import policy as _tuning

    made_on = _threads_making(monkeypatch, free_core)

    unknown, known = workload_inputs("W1", 200, seed=23)
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    first = seed_model("tensorflow")
    assert_jac_close(batchjac.jacobian(first, unknown, known, mode="reverse"), ref)
    bound = next(b for b in _backends._bound[first].values() if b.signature.dtype == np.float32)
    cache, key = _tuning._key(bound, "tensorflow", "variant", "reverse/200/0")
    cache.put(key, {"variant": "xla", "timings": "xla 0.4 ms, graph 0.6 ms"})  # as a race writes it

    model = seed_model("tensorflow")  # a fresh process's model: the same computation
    assert_jac_close(batchjac.jacobian(model, unknown, known, mode="reverse"), ref)
    bound = next(b for b in _backends._bound[model].values() if b.signature.dtype == np.float32)
    kernel = bound.kernel("reverse", 200, False)
    assert kernel.variant == "graph"
    assert kernel.remembered is not None
    assert kernel.remembered[0] == "xla"
    book = _tuning.ledger(bound)  # the work of many repeated calls
    book.rows, book.seconds = 10**7, 1e3
    for _ in range(4):  # (the fast path hands the due decision to the full path: a call
        # makes XLA beside, a later one finds it made)
        assert_jac_close(batchjac.jacobian(model, unknown, known, mode="reverse"), ref)
        _base.made_beside(60)
    assert kernel.variant == "xla"
    assert kernel.note.startswith("xla (remembered")
    assert not kernel.raced  # taken, not raced again
    xla = [m for m in made_on if m.startswith("xla@")]
    assert len(xla) == 1, made_on
    assert xla[0].endswith("tier-up_0") == free_core, made_on


# ---- probes proven from the layers -------------------------------------------------------------


def test_a_keras_model_of_row_wise_layers_is_probed_without_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense and convolution stacks of Keras's own layers keep their rows apart: the probes
    call nothing (no graph trace of their own), and the Jacobians are still right."""
    from batchjac._backends.tensorflow import TFBound, keras as keras_rows

    calls: list[str] = []
    original = TFBound.forward
    monkeypatch.setattr(TFBound, "forward", lambda self, *a: calls.append("forward") or original(self, *a))
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 40, seed=25)
    jac = batchjac.jacobian(model, unknown, known)
    assert calls == []
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    assert_jac_close(jac, ref)

    rng = np.random.default_rng(26)
    conv = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(3, 3, activation="tanh"),
                             keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                             keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    assert keras_rows.output_shape(conv) == (2,)
    x = rng.normal(size=(7, 6, 6, 1)).astype(np.float32)
    with tf.GradientTape() as tape:  # TensorFlow's own per-instance Jacobians
        xt = tf.constant(x)
        tape.watch(xt)
        y = conv(xt, training=False)
    ref = tape.batch_jacobian(y, xt).numpy()
    calls.clear()
    np.testing.assert_allclose(batchjac.jacobian(conv, x), ref, rtol=1e-4, atol=1e-6)
    assert calls == []


def test_keras_models_that_might_mix_rows_are_probed_with_values() -> None:
    from batchjac._backends.tensorflow import keras as keras_rows

    def functional(layer: Any) -> Any:
        inp = keras.Input((4,))
        return keras.Model(inp, keras.layers.Dense(3)(layer(inp)))

    centred = functional(keras.layers.Lambda(lambda t: t - tf.reduce_mean(t, axis=0, keepdims=True)))
    own_activation = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        3, activation=lambda t: t - tf.reduce_mean(t, axis=0, keepdims=True))])
    softmax_rows = functional(keras.layers.Softmax(axis=0))
    x = np.random.default_rng(27).normal(size=(10, 4)).astype(np.float32)
    for model in (centred, own_activation, softmax_rows):
        assert keras_rows.output_shape(model) is None
        with pytest.raises(batchjac.RowInteractionError):
            batchjac.jacobian(model, x)
    assert keras_rows.output_shape(functional(keras.layers.Softmax(axis=-1))) == (3,)


def test_the_mode_race_makes_the_other_kernel_beside_the_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a core free, the race of modes makes the other mode's kernel on the thread beside
    the calls and traces it there by a first run (TensorFlow traces a kernel on its first
    run); the calls meanwhile compute in the cost model's mode. A thread placing ops on
    another device, or a first run that fails, leaves the kernel to the call that needs it."""
    import threading

    from batchjac import _backends
    from batchjac._backends import _base
    from batchjac._tune.races import MODE_RUNS

    if not _base.idle_core():
        pytest.skip("one core: the race's kernel is made by its first call")
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 64, seed=21)
    ref = mlp_jacobian(mlp_weights(SEED_SIZES), np.concatenate([unknown, known], 1))[:, :, :5]
    assert_jac_close(batchjac.jacobian(model, unknown, known), ref)
    (bound,) = _backends._bound[model].values()
    ((prior, size, _),) = bound._kernels
    other = "reverse" if prior == "forward" else "forward"
    made_on: list[str] = []
    build = type(bound).build_kernel

    def recorded(self: Any, *a: Any, **k: Any) -> Any:
        made_on.append(threading.current_thread().name)
        return build(self, *a, **k)

    monkeypatch.setattr(type(bound), "build_kernel", recorded)
    race_now(monkeypatch)
    for _ in range(3 + 2 * MODE_RUNS):
        assert_jac_close(batchjac.jacobian(model, unknown, known), ref)
        _base.made_beside(60)
    assert (size, False) in bound.tuned
    assert made_on == ["batchjac-tier-up_0"], made_on
    assert bound.has_kernel(other, size, False)
    # made in the build of the kernel in use (the race compares the modes alike, not XLA
    # against a plain graph), and with no race of builds of its own left pending
    made = bound.kernel(other, size, False)
    assert made.fixed in made.variants
    assert made.call_race is None
    # another device in the calling thread: not made beside; a failing first run: forgotten
    assert bound.made_beside("/device:elsewhere", other, 32, False, _base.CallBudget(rows=32)) is None
    assert not bound.has_kernel(other, 32, False)

    def failing(self: Any, *a: Any, **k: Any) -> Any:
        raise RuntimeError("a first run that fails")

    kernel_type = type(bound.kernel(prior, size, False))
    monkeypatch.setattr(kernel_type, "call", failing)
    settings = bound.beside_settings()
    assert bound.made_beside(settings, other, 32, False, _base.CallBudget(rows=32)) is None
    assert not bound.has_kernel(other, 32, False)
