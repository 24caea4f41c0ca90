"""JAX derivatives that carry gradients (:mod:`batchjac._differentiable`): the kernels' own
functions, traced into the caller's trace instead of compiled apart, so that
``jax.grad``/``jax.jit``/``jax.vmap`` of a loss on the result differentiate through them.

The first-order function is ``vmap`` of ``jacfwd``/``jacrev`` of one instance's function (the
Jacobian kernel's); the second-order one is :meth:`~.second.JaxSecondKernel.body_of`, the
second-order kernel's, forward rule sets (the forward Laplacian, diagonal and Hessian) and
their fallbacks included: they are ``jax.numpy`` over the model's jaxpr, which JAX
differentiates as any other function. A chunk of a budgeted call is ``jax.checkpoint``-ed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from .second import JaxSecondKernel, failure

if TYPE_CHECKING:
    from . import JaxBound

Compute = Callable[[Any, tuple[Any, ...], Any], dict[str, Any]]


def derivatives(bound: JaxBound, kind: str, how: str) -> Compute:
    """``(u, ctx, v) -> {name: array}`` as JAX operations (see the module's docstring)."""
    if kind != "jacobian":
        body = JaxSecondKernel.body_of(bound, kind, how)  # type: ignore[arg-type]

    def run(u: Any, ctx: tuple[Any, ...], v: Any) -> dict[str, Any]:
        args = bound.args
        try:
            if kind != "jacobian":
                return body(args, u, ctx if v is None else (*ctx, v))
            one = bound._instance_fn(args)
            jac = jax.jacfwd if how == "forward" else jax.jacrev
            j, y = jax.vmap(jac(lambda u_i, c_i: (one(u_i, c_i),) * 2, has_aux=True))(u, ctx)
            return {"jacobians": j, "outputs": y}
        except Exception as e:
            err = failure(e, how, bound)
            if err is e:
                raise
            raise err from e

    return run
