"""Products with the per-instance Jacobians that never form them (:mod:`batchjac._products`):
``J v`` pushed forward and ``c^T J`` pulled back, for the whole chunk at once.

Rows are independent (the probes check it), so the forward derivative of the batch function
along per-row tangents holds each instance's ``J_i v_i``, and the pullback of per-row
cotangents each instance's ``c_i^T J_i``. Several directions per instance share one forward
pass: ``jax.linearize`` (forward) or ``jax.vjp`` (reverse) once, its linear function
``vmap``-ed over the directions. One compiled function per kind and shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from . import JaxBound


def product(bound: JaxBound, kind: str, u: np.ndarray, ctx: tuple[np.ndarray, ...],
            t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(y, p)``: the outputs and, for each of the ``d`` directions of ``t`` (rows, d, ...),
    ``J v`` (``kind="jvp"``, (rows, d, *out)) or ``c^T J`` (``"vjp"``, (rows, d, *unknown))."""
    bound.refresh()  # (values baked into its traces changed: traced again, products cleared)
    fn = bound.products.get(kind)
    if fn is None:
        def run(args: Any, u: Any, ctx: tuple[Any, ...], t: Any) -> tuple[Any, Any]:
            bound.trace_count += 1

            def f(a: Any) -> Any:
                return bound._batch(args, a, ctx)

            if kind == "jvp":
                y, linear = jax.linearize(f, u)
                return y, jax.vmap(linear, in_axes=1, out_axes=1)(t)
            y, pull = jax.vjp(f, u)
            return y, jax.vmap(lambda c: pull(c)[0], in_axes=1, out_axes=1)(t)

        fn = bound.products[kind] = jax.jit(run)
    try:
        y, p = fn(bound.args, u, tuple(ctx), t)
        return np.asarray(y), np.asarray(p)
    except Exception as e:
        from ..._errors import BatchJacError

        if isinstance(e, BatchJacError):
            raise
        raise bound._explain(e) from e
