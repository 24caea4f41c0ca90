"""batchjac.check: wrong gradients are caught in every framework, right ones pass, and the
reference says what it is (float64 copy, or a float32 fallback with a wider tolerance)."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import numpy as np
import pytest

import batchjac

W = np.random.default_rng(0).normal(size=(3, 2))


def data(n: int = 40, k: int = 3, seed: int = 1, dtype: str = "float32") -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, k)).astype(dtype)


def true_jacobian(x: np.ndarray) -> np.ndarray:
    """Of ``sin(x @ W)``: ``cos(x @ W)[:, o] * W[j, o]``."""
    return np.cos(x.astype(np.float64) @ W)[:, :, None] * W.T[None]


def assert_flagged(report: batchjac.CheckReport, n: int) -> None:
    assert not report.passed
    assert len(report.failed) == n  # factor 2: every instance is wrong
    np.testing.assert_allclose(report.max_rel_error, 1.0, rtol=1e-3)  # |2J - J| / |J|
    assert "FAILED" in str(report)
    worst = report.worst_entries[0]
    assert worst.jacobian == pytest.approx(2 * worst.reference, rel=1e-3)


def assert_clean(report: batchjac.CheckReport) -> None:
    assert report.passed, str(report)
    assert report.max_error < 1e-5
    assert len(report.failed) == 0
    assert "PASSED" in str(report)


# -- TensorFlow ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tf() -> Any:
    return pytest.importorskip("tensorflow")


def tf_model(tf: Any, factor: float) -> Any:
    """``sin(x @ W)`` whose custom gradient is ``factor`` times the true one."""

    @tf.custom_gradient
    def sin(z: Any) -> Any:
        def grad(dy: Any) -> Any:
            return dy * factor * tf.cos(z)

        return tf.sin(z), grad

    def model(x: Any) -> Any:
        return sin(tf.matmul(x, tf.constant(W, x.dtype)))

    return model


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_tf_wrong_custom_gradient_is_flagged(tf: Any, mode: str) -> None:
    x = data()
    assert_flagged(batchjac.check(tf_model(tf, 2.0), x, mode=mode), len(x))
    report = batchjac.check(tf_model(tf, 1.0), x, mode=mode)
    assert_clean(report)
    assert report.reference_dtype == "float64"
    assert report.mode == mode


def test_keras_model_passes_with_a_float64_clone_and_sample(tf: Any) -> None:
    from batchjac.examples import seed_model

    u = data(300, 8, seed=2)
    report = batchjac.check(seed_model("tensorflow"), u, wrt=[0, 2, 4, 5, 7], sample=25, seed=3,
                            mode="reverse")  # a fixed mode: no timing of both
    assert_clean(report)
    assert report.reference_dtype == "float64"
    assert report.compute_dtype == "float32"
    assert report.rtol == 1e-3
    assert not report.notes
    assert len(report.instances) == 25
    assert report.n_total == 300
    assert np.all(np.diff(report.instances) > 0)
    again = batchjac.check(seed_model("tensorflow"), u, wrt=[0, 2, 4, 5, 7], sample=25, seed=3,
                           mode="reverse")
    np.testing.assert_array_equal(again.instances, report.instances)  # seeded
    # unknowns named by their column of x (0, 2, 4, 5, 7), not by their position among the
    # unknowns (0..4): the worst entries of this seeded sample include column 5
    shown = {int(c) for c in re.findall(r"x\[:, (\d+)\]", str(report))}
    assert shown, str(report)
    assert shown <= {0, 2, 4, 5, 7}, str(report)
    assert shown - set(range(5)), str(report)
    assert "a random sample of 25 of 300" in str(report)


def test_float64_jacobians_use_the_tight_tolerance(tf: Any) -> None:
    report = batchjac.check(tf_model(tf, 1.0), data(10, dtype="float64"))
    assert report.compute_dtype == "float64"
    assert report.reference_dtype == "float64"
    assert report.rtol == 1e-6
    assert report.passed
    assert report.max_error < 1e-8


def test_keras_model_without_a_float64_copy_falls_back_to_float32(tf: Any) -> None:
    keras = pytest.importorskip("keras")

    class Fixed(keras.Model):  # no get_config for its argument: cannot be cloned in float64
        def __init__(self, w: np.ndarray) -> None:
            super().__init__()
            self.w = self.add_weight(shape=w.shape, initializer="zeros", name="w")
            self.w.assign(w.astype("float32"))

        def call(self, x: Any) -> Any:
            return tf.sin(tf.matmul(x, self.w))

    with pytest.raises(batchjac.InputError, match="could not be cloned in float64"):
        batchjac.jacobian(Fixed(W), data(4, dtype="float64"))
    report = batchjac.check(Fixed(W), data(), rtol=1e-4)
    assert report.reference_dtype == "float32"
    assert report.rtol == 1e-2  # widened from the 1e-4 asked for
    assert any("no float64 copy" in note for note in report.notes)
    assert any("widened" in note for note in report.notes)
    assert report.passed, str(report)
    assert "note: no float64 copy" in str(report)


def test_model_rounding_to_float32_inside_is_not_taken_as_a_float64_reference(tf: Any) -> None:
    def model(x: Any) -> Any:
        z = tf.cast(x, tf.float32)  # silently float32, whatever the input dtype
        return tf.cast(tf.sin(tf.matmul(z, tf.constant(W, tf.float32))), x.dtype)

    report = batchjac.check(model, data())
    assert report.reference_dtype == "float32"
    assert any("does not resolve float64" in note for note in report.notes)
    assert report.passed, str(report)


def test_kink_within_the_step_is_inconclusive_not_failed(tf: Any) -> None:
    x = data(20, 3, seed=4)
    x[7, 1] = 0.0  # exactly at relu's kink: central differences give slope 1/2
    report = batchjac.check(lambda v: tf.nn.relu(v) * 1.5, x, backend="tensorflow")
    assert list(report.inconclusive) == [7]
    assert len(report.failed) == 0
    assert report.passed  # 1 of 20 is within the allowed 10%
    x[:5, 0] = 0.0  # now 6 of 20 sit at a kink
    many = batchjac.check(lambda v: tf.nn.relu(v) * 1.5, x, backend="tensorflow")
    assert not many.passed
    assert any("inconclusive" in note for note in many.notes)


def test_step_follows_the_column_scale(tf: Any) -> None:
    x = data(30, 3, seed=5) * np.array([1e-4, 1.0, 1e4], np.float32)  # very different units
    report = batchjac.check(lambda v: tf.tanh(v * tf.constant([1e4, 1.0, 1e-4], v.dtype)), x,
                            backend="tensorflow")
    assert report.passed, str(report)
    assert report.max_error < 1e-5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"sample": 0}, "at least 1"), ({"sample": [0, 99]}, "out of range"),
     ({"sample": True}, "number of instances"), ({"rtol": -1.0}, "positive"),
     ({"rel_step": 2.0}, "between 0 and 1"), ({"top": -1}, ">= 0"),
     ({"n": 0}, "no instances")],
)
def test_bad_arguments(tf: Any, kwargs: dict[str, Any], match: str) -> None:
    n = kwargs.pop("n", 10)
    with pytest.raises(batchjac.InputError, match=match):
        batchjac.check(tf_model(tf, 1.0), data(n), **kwargs)


def test_bad_inputs_are_reported_as_for_jacobian(tf: Any) -> None:
    with pytest.raises(batchjac.InputError, match="has 9 rows but `unknown` has 10"):
        batchjac.check(tf_model(tf, 1.0), data(10, 2), data(9, 1))


# -- PyTorch -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch() -> Any:
    mod = pytest.importorskip("torch")
    pytest.importorskip("batchjac._backends.torch")
    return mod


def torch_model(torch: Any, factor: float) -> Any:
    class Sin(torch.autograd.Function):
        generate_vmap_rule = True  # the forward-mode kernel vmaps the jvp over the basis

        @staticmethod
        def forward(z: Any) -> Any:
            return torch.sin(z)

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            ctx.save_for_backward(inputs[0])
            ctx.save_for_forward(inputs[0])

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (z,) = ctx.saved_tensors
            return g * factor * torch.cos(z)

        @staticmethod
        def jvp(ctx: Any, t: Any) -> Any:
            (z,) = ctx.saved_tensors
            return t * factor * torch.cos(z)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(W, dtype=torch.float32))

        def forward(self, x: Any) -> Any:
            return Sin.apply(x @ self.w)

    return Model()


@pytest.mark.parametrize("mode", ["forward", "reverse"])  # forward uses jvp, reverse backward
def test_torch_wrong_autograd_function_is_flagged(torch: Any, mode: str) -> None:
    x = data()
    assert_flagged(batchjac.check(torch_model(torch, 2.0), x, mode=mode), len(x))
    report = batchjac.check(torch_model(torch, 1.0), x, mode=mode)
    assert_clean(report)
    assert report.reference_dtype == "float64"  # float64 copies of the module's weights


def test_torch_function_with_float32_weights_falls_back(torch: Any) -> None:
    w = torch.tensor(W, dtype=torch.float32)

    def model(x: Any) -> Any:
        return torch.sin(x @ w)  # float64 x @ float32 w fails: no float64 copy possible

    report = batchjac.check(model, data())
    assert report.reference_dtype == "float32"
    assert report.rtol == 1e-2
    assert any("no float64 copy" in note for note in report.notes)
    assert report.passed, str(report)


# -- JAX -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax() -> Any:
    mod = pytest.importorskip("jax")
    pytest.importorskip("batchjac._backends.jax")
    return mod


def x64(jax: Any) -> contextlib.AbstractContextManager[Any]:
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pragma: no cover - older jax

    return enable_x64()  # pragma: no cover


def jax_model(jax: Any, factor: float) -> Any:
    jnp = jax.numpy

    @jax.custom_jvp
    def sin(z: Any) -> Any:
        return jnp.sin(z)

    @sin.defjvp
    def sin_jvp(primals: Any, tangents: Any) -> Any:
        (z,), (t,) = primals, tangents
        return jnp.sin(z), factor * jnp.cos(z) * t

    w = np.asarray(W)

    def model(x: Any) -> Any:
        return sin(x @ jnp.asarray(w, x.dtype))

    return model


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_jax_wrong_custom_jvp_is_flagged_with_x64(jax: Any, mode: str) -> None:
    x = data()
    with x64(jax):
        assert_flagged(batchjac.check(jax_model(jax, 2.0), x, mode=mode, backend="jax"), len(x))
        report = batchjac.check(jax_model(jax, 1.0), x, mode=mode, backend="jax")
    assert_clean(report)
    assert report.reference_dtype == "float64"


def test_jax_without_x64_uses_a_float32_reference_and_still_flags(jax: Any) -> None:
    x = data()
    report = batchjac.check(jax_model(jax, 1.0), x, backend="jax")
    assert report.reference_dtype == "float32"
    assert report.rtol == 1e-2
    assert any("x64" in note for note in report.notes)
    assert report.passed, str(report)
    wrong = batchjac.check(jax_model(jax, 2.0), x, backend="jax")
    assert not wrong.passed
    assert len(wrong.failed) == len(x)


def test_true_jacobian_matches_the_reference_entries(tf: Any) -> None:
    x = data(5)
    report = batchjac.check(tf_model(tf, 1.0), x, top=3)
    true = true_jacobian(x)
    for e in report.worst_entries:
        assert e.reference == pytest.approx(true[e.instance][e.output][e.unknown], rel=1e-7, abs=1e-9)
    assert len(report.worst_entries) == 3
