"""Products with the per-instance Jacobians that never form them (:mod:`batchjac._products`):
``J v`` pushed forward and ``c^T J`` pulled back, for the whole chunk at once.

Rows are independent (the probes check it), so a ``tf.autodiff.ForwardAccumulator`` over the
chunk with per-row tangents holds each instance's ``J_i v_i``, and the gradient of the chunk's
outputs with per-row ``output_gradients`` each instance's ``c_i^T J_i``. The ``d`` directions
of an instance are vectorised by pfor, as the forward-mode Jacobian's basis is
(:func:`.builds.pushed`, :func:`.builds.pulled`; the reverse directions share one forward pass
on a persistent tape), in one ``tf.function`` traced once per kind and shapes; where pfor
cannot vectorise the model, a loop over the directions.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from .._base import first_line
from . import builds, compat

if TYPE_CHECKING:
    from . import TFBound

log = logging.getLogger("batchjac")


def product(bound: TFBound, kind: str, u: np.ndarray, ctx: tuple[np.ndarray, ...],
            t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(y, p)``: the outputs and, for each of the ``d`` directions of ``t`` (rows, d, ...),
    ``J v`` (``kind="jvp"``, (rows, d, *out)) or ``c^T J`` (``"vjp"``, (rows, d, *unknown))."""
    made = bound.products.get(kind)
    if made is None:  # (traced under the model's lock, as its kernels are: see TFBound.tracing)
        made = bound.products[kind] = (_function(bound, kind, pfor=True), True)
        with bound.tracing:
            return _run(bound, kind, made, u, t, ctx)
    return _run(bound, kind, made, u, t, ctx)


def _run(bound: TFBound, kind: str, made: tuple[Any, bool], u: np.ndarray, t: np.ndarray,
         ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    fn, pfor = made
    try:
        with compat.quiet_pfor():
            y, p = fn(u, t, *ctx)
    except Exception as e:
        if not pfor or isinstance(e, Warning) or builds._out_of_memory(e) or builds._at_run_time(e):
            raise
        # a loop over the directions instead; its error, if any, is the model's
        log.debug("%s products: pfor cannot vectorise the directions (%s); a loop over them",
                  kind, first_line(e))
        fn = _function(bound, kind, pfor=False)
        bound.products[kind] = (fn, False)
        y, p = fn(u, t, *ctx)
    return y.numpy(), p.numpy()


def _function(bound: TFBound, kind: str, pfor: bool) -> Any:
    def run(u: Any, t: Any, *ctx: Any) -> tuple[Any, Any]:
        bound.trace_count += 1
        rank = len(t.shape)
        perm = [1, 0, *range(2, rank)]  # (rows, d, ...) <-> (d, rows, ...)
        fn = builds.pushed if kind == "jvp" else builds.pulled
        y, p = fn(bound, u, tuple(ctx), tf.transpose(t, perm), pfor)
        return y, tf.transpose(p, perm)

    # (one trace per shapes)
    return tf.function(run, autograph=False)
