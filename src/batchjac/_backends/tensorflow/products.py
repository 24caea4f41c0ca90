"""Products with the per-instance Jacobians that never form them (:mod:`batchjac._products`):
``J v`` pushed forward and ``c^T J`` pulled back, for the whole chunk at once.

Rows are independent (the probes check it), so a ``tf.autodiff.ForwardAccumulator`` over the
chunk with per-row tangents holds each instance's ``J_i v_i``, and the gradient of the chunk's
outputs with per-row ``output_gradients`` each instance's ``c_i^T J_i``. The ``d`` directions
of an instance are a loop inside one ``tf.function`` (the reverse directions share one
forward pass on a persistent tape), traced once per kind and shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

if TYPE_CHECKING:
    from . import TFBound


def product(bound: TFBound, kind: str, u: np.ndarray, ctx: tuple[np.ndarray, ...],
            t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(y, p)``: the outputs and, for each of the ``d`` directions of ``t`` (rows, d, ...),
    ``J v`` (``kind="jvp"``, (rows, d, *out)) or ``c^T J`` (``"vjp"``, (rows, d, *unknown))."""
    fn = bound.products.get(kind)
    if fn is None:
        def run(u: Any, t: Any, *ctx: Any) -> tuple[Any, Any]:
            bound.trace_count += 1
            d = t.shape[1]
            if kind == "jvp":
                parts, y = [], None
                for i in range(d):
                    with tf.autodiff.ForwardAccumulator(u, t[:, i]) as acc:
                        y = bound.apply(u, ctx)
                    jv = acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                    parts.append(jv)
                assert y is not None
                return y, tf.stack(parts, axis=1)
            with tf.GradientTape(persistent=d > 1) as tape:
                tape.watch(u)
                y = bound.apply(u, ctx)
            parts = [tape.gradient(y, u, output_gradients=t[:, i],
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
                     for i in range(d)]
            return y, tf.stack(parts, axis=1)

        # (one trace per shapes: the number of directions is a loop bound)
        fn = bound.products[kind] = tf.function(run, autograph=False)
    y, p = fn(u, t, *ctx)
    return y.numpy(), p.numpy()
