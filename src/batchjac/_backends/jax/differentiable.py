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

from ..._errors import BatchJacError, ModelError, OrderFailedError
from .._base import first_line
from . import compat

if TYPE_CHECKING:
    from . import JaxBound

Compute = Callable[[Any, tuple[Any, ...], Any], dict[str, Any]]


def derivatives(bound: JaxBound, kind: str, how: str) -> Compute:
    """``(u, ctx, v) -> {name: array}`` as JAX operations (see the module's docstring)."""
    if kind != "jacobian":
        from .second import JaxSecondKernel

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
            # (the model's call explains its failure: the cause is JAX's, as in the kernel)
            cause = compat.unwrapped(e.__cause__ if isinstance(e, ModelError) else e)
            if how in ("forward", "forward-over-forward") and isinstance(cause, Exception) \
                    and not isinstance(cause, BatchJacError) and compat.no_forward_rule(cause):
                other = "reverse" if how == "forward" else "forward-over-reverse"
                raise OrderFailedError(
                    f"{'Jacobians' if how == 'forward' else 'Second derivatives'} cannot be "
                    f"computed with mode={how!r} for this model: it calls a jax.custom_vjp "
                    f"function, which has no forward-mode rule ({first_line(cause)[:200]}). "
                    f"Pass mode={other!r} (or 'auto').") from e
            if isinstance(e, (BatchJacError, Warning)):
                raise
            raise bound._explain(e) from e

    return run
