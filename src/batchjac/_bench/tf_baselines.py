"""TensorFlow baselines: what users write (B0 loop, B1 eager batch_jacobian) and what experts
write (B2 batch_jacobian under XLA), plus the forward pass F. Each takes numpy and returns
numpy, like batchjac, so timings compare the same work."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf


def _call(model: Any, x: tf.Tensor) -> tf.Tensor:
    return model(x, training=False)


def naive_loop(model: Any, unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
    """B0: one GradientTape.jacobian per instance, as in the original question."""
    out = []
    for i in range(unknown.shape[0]):
        u = tf.constant(unknown[i : i + 1])
        with tf.GradientTape() as tape:
            tape.watch(u)
            x = u if known is None else tf.concat([u, known[i : i + 1]], axis=-1)
            y = _call(model, x)
        out.append(tape.jacobian(y, u).numpy().reshape(y.shape[1:] + u.shape[1:]))
    return np.stack(out)


def eager_batch_jacobian(model: Any, unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
    """B1: the well-known answer, eager ``tape.batch_jacobian``."""
    u = tf.constant(unknown)
    with tf.GradientTape() as tape:
        tape.watch(u)
        x = u if known is None else tf.concat([u, tf.constant(known)], axis=-1)
        y = _call(model, x)
    return tape.batch_jacobian(y, u).numpy()


def xla_batch_jacobian(model: Any) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    """B2: ``batch_jacobian`` inside ``tf.function(jit_compile=True)``."""

    @tf.function(jit_compile=True)
    def jac(u: tf.Tensor, known: tf.Tensor | None) -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(u)
            x = u if known is None else tf.concat([u, known], axis=-1)
            y = _call(model, x)
        return tape.batch_jacobian(y, u)

    return lambda unknown, known: jac(unknown, known).numpy()


def xla_forward(model: Any, jit_compile: bool = True
                ) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    """F: one compiled forward pass, the cost unit of the autodiff-bound ratio; with XLA, or
    as a plain graph (``jit_compile=False``), which is faster for convolutions here: the
    report takes the faster of the two."""

    def fwd(u: tf.Tensor, known: tf.Tensor | None) -> tf.Tensor:
        x = u if known is None else tf.concat([u, known], axis=-1)
        return _call(model, x)

    compiled = tf.function(fwd, jit_compile=jit_compile, autograph=False)
    return lambda unknown, known: compiled(unknown, known).numpy()
