"""Mixed-mode accumulation in TensorFlow (batchjac._backends.tensorflow.chain): a Keras model's
chain read from its layers, the Jacobians accumulated through its bottleneck against
TensorFlow's own batch_jacobian and float64 finite differences, and the pure paths kept where
the count is unsure or the model is outside the reader."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import batchjac  # noqa: E402
from batchjac import _backends  # noqa: E402
from batchjac._backends.tensorflow import compat  # noqa: E402

from .helpers import assert_jac_close, central_differences  # noqa: E402

keras = compat.keras_module()

#: counted 3.3x fewer operations than the better pure mode: the mixed path is taken
SURE = (128, 128, 2, 128, 128)
#: counted 2.7x: offered to backends that race it; TensorFlow takes it only where sure
UNSURE = (128, 96, 2, 96, 128)


def sequential(sizes: tuple[int, ...], seed: int) -> Any:
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(b, activation="tanh" if i < len(sizes) - 2 else None)
              for i, b in enumerate(sizes[1:])]
    return keras.Sequential([keras.Input((sizes[0],)), *layers])


def tf_reference(model: Any, x: np.ndarray) -> np.ndarray:
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = model(xt)
    return tape.batch_jacobian(y, xt).numpy()


def bound_of(model: Any, dtype: Any = np.float32) -> Any:
    return next(b for b in _backends._bound[model].values() if b.signature.dtype == dtype)


def kernel_of(model: Any, dtype: Any = np.float32) -> Any:
    return next(iter(bound_of(model, dtype)._kernels.values()))


def test_a_bottlenecked_keras_model_is_accumulated_through_its_narrow_layer(capsys: Any) -> None:
    model = sequential(SURE, seed=1)
    x = np.random.default_rng(2).normal(0, 1, (23, 128)).astype(np.float32)
    jac = batchjac.jacobian(model, x, explain=True)
    err = capsys.readouterr().err
    assert "mixed mode: reverse from the unknowns to the 2 values after" in err
    assert "then forward from the 2 values after" in err
    kernel = kernel_of(model)
    assert kernel.path == "mixed"
    assert "the pure paths are not tried" in kernel.note
    assert_jac_close(jac, tf_reference(model, x))
    # float64: a float64 clone of the model, its chain read again
    jac64 = batchjac.jacobian(model, x.astype(np.float64), dtype=np.float64)
    assert kernel_of(model, np.float64).path == "mixed"

    def forward64(v: np.ndarray) -> np.ndarray:
        w = [np.asarray(a, np.float64) for a in model.get_weights()]
        for i in range(0, len(w), 2):
            v = v @ w[i] + w[i + 1]
            if i < len(w) - 2:
                v = np.tanh(v)
        return v

    assert_jac_close(jac64, central_differences(forward64, x.astype(np.float64)))


def test_known_inputs_concatenated_into_a_functional_model() -> None:
    keras.utils.set_random_seed(3)
    inp = keras.Input((134,))
    h = keras.layers.Dense(128, activation="tanh")(inp)
    code = keras.layers.Dense(2, activation="tanh", name="code")(h)
    a = keras.layers.Dense(128, activation="sigmoid")(code)
    out = keras.layers.Dense(128)(a)
    model = keras.Model(inp, out)
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (9, 128)).astype(np.float32)
    known = rng.normal(0, 1, (9, 6)).astype(np.float32)
    y, jac = batchjac.jacobian(model, x, known, return_outputs=True, explain=False)
    assert kernel_of(model).path == "mixed"
    whole = np.concatenate([x, known], axis=1)
    np.testing.assert_allclose(y, model(whole).numpy(), rtol=1e-5, atol=1e-6)
    assert_jac_close(jac, tf_reference(model, whole)[..., :128])


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_mode_asked_for_is_computed_in_that_mode(mode: str) -> None:
    model = sequential(SURE, seed=5)
    x = np.random.default_rng(6).normal(0, 1, (5, 128)).astype(np.float32)
    jac = batchjac.jacobian(model, x, mode=mode)
    assert kernel_of(model).path == mode
    assert_jac_close(jac, tf_reference(model, x))


def test_an_unsure_count_and_no_bottleneck_keep_the_pure_paths() -> None:
    unsure = sequential(UNSURE, seed=7)
    x = np.random.default_rng(8).normal(0, 1, (5, 128)).astype(np.float32)
    jac = batchjac.jacobian(unsure, x)
    assert bound_of(unsure).accumulation() is not None  # offered ...
    assert kernel_of(unsure).path != "mixed"  # ... but not sure enough to run unraced
    assert_jac_close(jac, tf_reference(unsure, x))
    wide = sequential((40, 64, 64, 40), seed=9)
    x = np.random.default_rng(10).normal(0, 1, (5, 40)).astype(np.float32)
    batchjac.jacobian(wide, x)
    assert bound_of(wide).accumulation() is None


def test_a_plain_tf_function_has_no_chain() -> None:
    w1 = tf.constant(np.random.default_rng(11).normal(0, 0.1, (128, 2)).astype(np.float32))
    w2 = tf.constant(np.random.default_rng(12).normal(0, 0.5, (2, 128)).astype(np.float32))

    @tf.function
    def f(x: Any) -> Any:
        return tf.tanh(x @ w1) @ w2

    x = np.random.default_rng(13).normal(0, 1, (4, 128)).astype(np.float32)
    jac = batchjac.jacobian(f, x)
    assert bound_of(f).accumulation() is None
    assert_jac_close(jac, tf_reference(f, x))


@pytest.mark.parametrize("workload", ["W1", "W2", "W3", "W4"])
def test_the_other_benchmark_workloads_read_no_chain(workload: str) -> None:
    from batchjac.examples import workload_inputs, workload_model

    model = workload_model(workload, "tensorflow")
    unknown, known = workload_inputs(workload, 4)
    batchjac.jacobian(model, unknown, *(() if known is None else (known,)))
    assert bound_of(model).accumulation() is None
    assert kernel_of(model).path != "mixed"


def test_w9_reads_its_bottleneck() -> None:
    from batchjac.examples import workload_inputs, workload_model

    model = workload_model("W9", "tensorflow")
    unknown, _ = workload_inputs("W9", 3)
    jac = batchjac.jacobian(model, unknown)
    assert kernel_of(model).path == "mixed"
    assert_jac_close(jac, tf_reference(model, unknown))
