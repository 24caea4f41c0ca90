"""The forward Laplacian of TensorFlow models (batchjac._backends.tensorflow.laplacian), a build of the
TensorFlow Laplacian kernel.

References: the trace of TensorFlow's own nested ``batch_jacobian`` Hessian and its
``batch_jacobian`` Jacobian in float64, and the closed form of ``sum(sin x)``.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import race_now, rng

tf = pytest.importorskip("tensorflow")

from batchjac._bind import prepare  # noqa: E402
from batchjac._validate import normalize  # noqa: E402


def nested_tapes(f: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(y, J, H)`` of the batch function ``f`` by TensorFlow's nested tapes."""
    xt = tf.constant(x)
    with tf.GradientTape() as outer:
        outer.watch(xt)
        with tf.GradientTape() as inner:
            inner.watch(xt)
            y = f(xt)
        jac = inner.batch_jacobian(y, xt)
    return y.numpy(), jac.numpy(), outer.batch_jacobian(jac, xt).numpy()


def references(f: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(J, Laplacian)`` of the batch function ``f`` by TensorFlow's nested tapes."""
    _, jac, hess = nested_tapes(f, x)
    return jac, np.trace(hess, axis1=-2, axis2=-1)


def _kernel(model: Any, x: np.ndarray, *known: np.ndarray, kind: str = "laplacian",
            build: str = "forward-laplacian") -> tuple[Any, np.ndarray, tuple[np.ndarray, ...]]:
    spec = normalize((x, *known), wrt=None, dtype=None, nan_policy="raise")
    bound = prepare(model, spec, "tensorflow", {})
    kernel = bound.second_kernel(kind, "forward-over-reverse", spec.n, True, True)
    kernel.use(build)
    u, ctx = spec.chunk(0, spec.n)
    return kernel, u, ctx


@pytest.mark.parametrize("block_rows", [None, 4])
def test_rules_match_the_nested_tapes(block_rows: int | None, monkeypatch: Any) -> None:
    """Matrix products, bias additions, sums and products of two varying values, a quotient
    by a constant, slices and a concatenation with the known columns, and the elementwise
    functions with rules (tanh, sin, exp, sigmoid, softplus, square, log); in one block, and
    in blocks of 4 rows (13 rows: the last block padded with copies of the last row)."""
    if block_rows is not None:
        from batchjac._backends.tensorflow import TFSecondKernel

        monkeypatch.setattr(TFSecondKernel, "LAPLACIAN_BLOCK_ROWS", block_rows)
    r = rng(1)
    w1 = tf.constant(r.normal(size=(5, 6)) * 0.6)
    b1 = tf.constant(r.normal(size=6) * 0.1)
    w2 = tf.constant(r.normal(size=(6, 2)) * 0.6)

    def f(xh: Any) -> Any:  # (called on concat([unknown, known]), as batchjac assembles it)
        x, h = xh[:, :3], xh[:, 3:]
        z = tf.nn.bias_add(tf.matmul(tf.concat([h, x], -1), w1), b1)
        a = tf.tanh(z) * tf.sigmoid(z) + tf.square(tf.sin(z)) - tf.exp(-z * z) / 3.0
        s = tf.matmul(tf.nn.softplus(a), w2)
        return tf.math.log(1 + s * s) + tf.reduce_sum(s, -1, keepdims=True)

    x, h = r.normal(size=(13, 3)), r.normal(size=(13, 2))
    kernel, u, ctx = _kernel(f, x, h)
    out = kernel(u, ctx)
    assert "a forward Laplacian" in kernel.note
    # the reference differentiates w.r.t. all 5 inputs: the unknowns' block of it
    y, jac, hess = nested_tapes(f, np.concatenate([x, h], 1))
    want_lap = np.trace(hess[..., :3, :3], axis1=-2, axis2=-1)
    np.testing.assert_allclose(out["laplacians"], want_lap, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["jacobians"], jac[..., :3], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["outputs"], y, rtol=1e-12, atol=1e-12)
    assert np.abs(want_lap).max() > 0.1  # a curved model: the test could fail


def test_keras_model_and_closed_form() -> None:
    keras = pytest.importorskip("keras")
    r = rng(2)
    inp = keras.Input((3,), dtype="float64")
    h = keras.layers.Dense(8, activation="tanh", dtype="float64")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, dtype="float64")(h))
    x = r.normal(size=(11, 3))
    kernel, u, ctx = _kernel(model, x)
    out = kernel(u, ctx)
    jac, lap = references(lambda z: model(z, training=False), x)
    np.testing.assert_allclose(out["laplacians"], lap, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["jacobians"], jac, rtol=1e-10, atol=1e-12)

    def sines(z: Any) -> Any:
        return tf.reduce_sum(tf.sin(z), -1)

    kernel, u, ctx = _kernel(sines, x)
    np.testing.assert_allclose(kernel(u, ctx)["laplacians"], -np.sin(x).sum(-1),
                               rtol=1e-12, atol=1e-12)


def test_an_operation_without_a_rule_keeps_the_other_builds() -> None:
    x = rng(3).normal(size=(9, 3))

    def f(z: Any) -> Any:
        return tf.reduce_sum(tf.atan(z), -1)  # Atan: no rule

    kernel, u, ctx = _kernel(f, x)
    out = kernel(u, ctx)
    assert kernel.variant == "graph"
    assert "no forward-Laplacian rule for the operation Atan" in kernel.note
    np.testing.assert_allclose(out["laplacians"], (-2 * x / (1 + x * x) ** 2).sum(-1),
                               rtol=1e-10, atol=1e-12)


def test_the_race_times_it(monkeypatch: Any) -> None:
    x = rng(4).normal(size=(40, 3)) * 2

    def f(z: Any) -> Any:
        return tf.reduce_sum(tf.sin(z), -1)

    race_now(monkeypatch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        lap = batchjac.laplacian(f, x, backend="tensorflow", explain=True)
    assert "forward-laplacian " in err.getvalue(), err.getvalue()
    np.testing.assert_allclose(lap, -np.sin(x).sum(-1), rtol=1e-12, atol=1e-12)


def test_a_race_choice_holds_for_other_chunk_sizes(monkeypatch: Any) -> None:
    """A kernel of another chunk size takes the build the race chose (without racing every
    build again), and computes the same values."""
    x = rng(5).normal(size=(48, 3)) * 2

    def f(z: Any) -> Any:
        return tf.reduce_sum(tf.sin(z), -1)

    race_now(monkeypatch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        batchjac.laplacian(f, x, backend="tensorflow", explain=True, chunk_size=48)
        lap = batchjac.laplacian(f, x, backend="tensorflow", explain=True, chunk_size=16)
    notes = [line for line in err.getvalue().splitlines() if "kernel:" in line]
    assert "timed one chunk" in notes[0], notes
    chosen = notes[0].split("forward-over-reverse, ")[1].split(" ")[0]
    assert f"{chosen} (as timed for another chunk size)" in notes[1], notes
    np.testing.assert_allclose(lap, -np.sin(x).sum(-1), rtol=1e-12, atol=1e-12)


def test_the_untimed_first_call_takes_it_and_falls_back_where_it_cannot() -> None:
    """A first call that times nothing computes by the forward Laplacian (the closed form of
    ``sum(sin x)``); with an operation without a rule (atan) by the next build, the nested
    tapes, with the values of the closed form ``sum(-2x / (1 + x^2)^2)`` and the reason."""
    x = rng(6).normal(size=(30, 3)) * 2
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        lap = batchjac.laplacian(lambda z: tf.reduce_sum(tf.sin(z), -1), x, backend="tensorflow",
                                 explain=True)
    assert "forward-laplacian (not timed" in err.getvalue(), err.getvalue()
    np.testing.assert_allclose(lap, -np.sin(x).sum(-1), rtol=1e-12, atol=1e-12)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        lap = batchjac.laplacian(lambda z: tf.reduce_sum(tf.atan(z), -1), x, backend="tensorflow",
                                 explain=True)
    assert "tapes (not timed" in err.getvalue(), err.getvalue()
    assert "no forward-Laplacian rule for the operation Atan" in err.getvalue(), err.getvalue()
    np.testing.assert_allclose(lap, (-2 * x / (1 + x * x) ** 2).sum(-1), rtol=1e-10, atol=1e-12)


def test_a_first_call_computes_its_chunk_once(monkeypatch: Any) -> None:
    """The check that a first call's build works (the forward Laplacian, the nested tapes)
    computes the chunk, and that result is the call's: the compiled function runs once (it
    ran twice: W7H at 100,000 rows took 1.77 s against the native tapes' 0.79 s)."""
    from batchjac._backends.tensorflow import TFSecondKernel

    runs: list[str] = []
    original = TFSecondKernel._fn

    def counting(self: Any, variant: str) -> Any:
        fn = original(self, variant)

        def run(*args: Any) -> Any:
            runs.append(variant)
            return fn(*args)
        return run

    monkeypatch.setattr(TFSecondKernel, "_fn", counting)
    x = rng(7).normal(size=(20, 3))
    lap = batchjac.laplacian(lambda z: tf.reduce_sum(tf.sin(z), -1), x, backend="tensorflow")
    assert runs == ["forward-laplacian"]
    np.testing.assert_allclose(lap, -np.sin(x).sum(-1), rtol=1e-12, atol=1e-12)
    runs.clear()
    hess = batchjac.hessian(lambda z: tf.reduce_sum(tf.sin(z), -1), x, backend="tensorflow")
    assert runs == ["forward-hessian"]
    want = np.zeros((20, 3, 3))
    want[:, range(3), range(3)] = -np.sin(x)
    np.testing.assert_allclose(hess, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block_rows", [None, 4])
def test_the_forward_hessian_matches_the_nested_tapes(block_rows: int | None,
                                                      monkeypatch: Any) -> None:
    """The Hessian build (every pair of unit tangents): the same operations as the Laplacian's
    test, products of two different varying values among them, against TensorFlow's nested
    tapes in float64, in one block and in blocks of 4 rows (13 rows: the last one padded)."""
    from batchjac._backends.tensorflow import TFSecondKernel

    if block_rows is not None:
        monkeypatch.setattr(TFSecondKernel, "HESSIAN_BLOCK_ROWS", block_rows)
    r = rng(8)
    w1 = tf.constant(r.normal(size=(5, 6)) * 0.6)
    b1 = tf.constant(r.normal(size=6) * 0.1)
    w2 = tf.constant(r.normal(size=(6, 2)) * 0.6)
    w3 = tf.constant(r.normal(size=(5, 6)) * 0.6)

    def f(xh: Any) -> Any:
        x, h = xh[:, :3], xh[:, 3:]
        z = tf.nn.bias_add(tf.matmul(tf.concat([h, x], -1), w1), b1)
        q = tf.matmul(xh, w3)  # another value: the product's cross terms are asymmetric
        a = tf.tanh(z) * tf.sigmoid(q) + tf.square(tf.sin(z)) - tf.exp(-z * z) / 3.0
        s = tf.matmul(tf.nn.softplus(a), w2)
        return tf.math.log(1 + s * s) + tf.reduce_sum(s, -1, keepdims=True)

    x, h = r.normal(size=(13, 3)), r.normal(size=(13, 2))
    kernel, u, ctx = _kernel(f, x, h, kind="hessian", build="forward-hessian")
    out = kernel(u, ctx)
    assert "a forward Hessian (one pass)" in kernel.note
    y, jac, hess = nested_tapes(f, np.concatenate([x, h], 1))
    hess = hess[..., :3, :3]
    np.testing.assert_allclose(out["hessians"], hess, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["jacobians"], jac[..., :3], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["outputs"], y, rtol=1e-12, atol=1e-12)
    off = hess - np.diagonal(hess, axis1=-2, axis2=-1)[..., None] * np.eye(3)
    assert np.abs(off).max() > 0.1  # mixed terms present: a wrong pairing would fail


def test_reshapes_identities_and_casts_move_the_tangents_without_vectorized_map(
        monkeypatch: Any) -> None:
    """Keras reshapes and flattenings, identities, casts, added and removed axes are pushed
    as one reshape (or cast) of the tangents each, never through ``vectorized_map`` (which
    traced W7's Keras model 95 ms longer); in blocks of 4 rows (37 rows: the last block
    padded), TensorFlow tensors in and out, equal to the numpy path's and to the trace of
    the nested tapes' Hessian, with the Jacobian and the outputs of the same pass."""
    from batchjac._backends.tensorflow import TFSecondKernel

    monkeypatch.setattr(TFSecondKernel, "LAPLACIAN_BLOCK_ROWS", 4)

    def no_vectorized_map(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("vectorized_map")

    monkeypatch.setattr(tf, "vectorized_map", no_vectorized_map)
    r = rng(31)
    inp = tf.keras.Input((3,), dtype="float64")
    h = tf.keras.layers.Dense(6, activation="tanh", dtype="float64")(inp)
    h = tf.keras.layers.Reshape((2, 3), dtype="float64")(h)
    h = tf.keras.layers.Flatten(dtype="float64")(h)
    out = tf.keras.layers.Dense(2, dtype="float64")(h)
    model = tf.keras.Model(inp, out)
    x = r.normal(size=(37, 3))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        y, jac, lap = batchjac.laplacian(model, tf.constant(x), backend="tensorflow",
                                         return_jacobian=True, return_outputs=True, explain=True)
    assert "a forward Laplacian (one pass)" in err.getvalue(), err.getvalue()  # not a fallback
    assert all(tf.is_tensor(a) for a in (y, jac, lap))
    assert (lap.shape, jac.shape, y.shape) == ((37, 2), (37, 2, 3), (37, 2))
    from_numpy = batchjac.laplacian(model, x, backend="tensorflow")
    want_y, want_jac, hess = nested_tapes(lambda z: model(z), x)
    want = np.trace(hess, axis1=-2, axis2=-1)
    np.testing.assert_allclose(np.asarray(lap), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(jac), want_jac, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(from_numpy, np.asarray(lap), rtol=1e-12, atol=1e-14)
    assert np.abs(want).max() > 1e-2  # curved: the test could fail
    # identities, casts, added and removed axes in a plain function: the same rule
    w = tf.constant(r.normal(size=(3, 4)))

    def f(z: Any) -> Any:
        a = tf.expand_dims(tf.identity(tf.tanh(tf.matmul(z, w))), 1)  # (rows, 1, 4)
        b = tf.cast(tf.cast(tf.squeeze(a, 1), tf.float32), tf.float64)
        return tf.reshape(tf.sin(b), (-1, 2, 2))

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        lap = batchjac.laplacian(f, x, backend="tensorflow", explain=True)
        hessians = batchjac.hessian(f, x, backend="tensorflow", explain=True)
    assert "a forward Laplacian (one pass)" in err.getvalue(), err.getvalue()
    assert "a forward Hessian (one pass)" in err.getvalue(), err.getvalue()
    _, _, hess = nested_tapes(f, x)
    np.testing.assert_allclose(lap, np.trace(hess, axis1=-2, axis2=-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hessians, hess, rtol=1e-5, atol=1e-6)
