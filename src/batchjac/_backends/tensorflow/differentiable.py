"""TensorFlow derivatives that carry gradients (:mod:`batchjac._differentiable`): the backend's
own builds, traced into one ``tf.function`` per chunk shape and called on the caller's tensors,
so that a ``GradientTape`` around the call (eager, or inside the caller's ``tf.function``)
differentiates the result to the model's variables and to watched inputs.

The builds are those of the compiled kernels, as plain graphs (no XLA: the gradient of a
second derivative under XLA meets operations without a gradient of their own): the
reverse-mode ``batch_jacobian`` and forward-mode ``ForwardAccumulator`` of :mod:`.builds`, and
the second-order kernel's bodies (:class:`.second.TFSecondKernel`), its forward Laplacian and
forward Hessian first where they apply (their rule sets are TensorFlow operations re-created
over the model's graph, whose gradients TensorFlow derives like any other). Being one function
call, the tape records it as one operation and takes its gradient from the function's graph;
the variables that graph reads through re-created operations are read once through their own
API too, so that the caller's tape watches them.

A chunk of a budgeted call is recomputed in the backward pass by ``tf.recompute_grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from ..._errors import InputError
from .._base import SECOND_RESULT
from .builds import jac_forward, jac_reverse

if TYPE_CHECKING:
    from . import TFBound

Compute = Callable[[tf.Tensor, tuple[tf.Tensor, ...], Any], dict[str, tf.Tensor]]

#: the second-order kernel's builds of forward rules, taken first where the kernel starts with
#: one (else, or where an operation has no rule, its tapes)
_FORWARD = ("forward-laplacian", "forward-hessian")


def derivatives(bound: TFBound, kind: str, how: str, with_outputs: bool,
                with_jacobian: bool) -> Compute:
    """``(u, ctx, v) -> {name: tensor}`` in the caller's graph (see the module's docstring)."""
    if bound.synced:
        raise InputError(
            f"differentiable=True computes in the model's own dtype, so that the gradient "
            f"reaches its variables; the inputs ask for {bound.signature.dtype} but the Keras "
            f"model holds variables of another dtype (batchjac would differentiate a "
            f"{bound.signature.dtype} copy). Pass dtype= the model's dtype (e.g. "
            f"dtype='float32'), or build the model in {bound.signature.dtype}.")
    functions: dict[tuple[int, bool], Any] = {}
    failed: list[str] = []

    def traced(rows: int, n_ctx: int, with_v: bool) -> Any:
        key = (rows, with_v)
        if key not in functions:
            functions[key] = tf.function(lambda u, *rest: _body(rest[:n_ctx], u, rest),
                                         autograph=False)
        return functions[key]

    def _body(ctx: tuple[tf.Tensor, ...], u: tf.Tensor, rest: tuple[tf.Tensor, ...]
              ) -> dict[str, tf.Tensor]:
        # (the model's own failures are explained where it is called: TFBound.apply)
        v = rest[len(ctx)] if len(rest) > len(ctx) else None
        if kind == "jacobian":
            y, jac = (jac_forward if how == "forward" else jac_reverse)(bound, u, ctx)
            return {"jacobians": jac, "outputs": y}
        return _second(bound, kind, how, int(u.shape[0]), u, ctx, v, failed)

    def concrete(u: tf.Tensor, ctx: tuple[tf.Tensor, ...], v: Any) -> Any:
        args = (u, *ctx, *(() if v is None else (v,)))
        return traced(int(u.shape[0]), len(ctx), v is not None).get_concrete_function(*args)

    def run(u: tf.Tensor, ctx: tuple[tf.Tensor, ...], v: Any) -> dict[str, tf.Tensor]:
        out = concrete(u, ctx, v)(u, *ctx, *(() if v is None else (v,)))
        wanted = {"jacobians" if kind == "jacobian" else SECOND_RESULT[kind]}
        wanted |= {"outputs"} if with_outputs else set()
        wanted |= {"jacobians"} if with_jacobian else set()
        return {n: t for n, t in out.items() if n in wanted}

    run.prepare = concrete  # type: ignore[attr-defined]
    return run


def _second(bound: TFBound, kind: str, how: str, rows: int, u: tf.Tensor,
            ctx: tuple[tf.Tensor, ...], v: tf.Tensor | None, failed: list[str]
            ) -> dict[str, tf.Tensor]:
    """The second-order kernel's body for ``rows`` rows, traced here: its forward rules where
    the kernel would start with them (and they have a rule for every operation), else the
    tiled tapes of ``how``."""
    from .second import TFSecondKernel

    kernel = TFSecondKernel(bound, kind, how, rows, True, True)  # type: ignore[arg-type]
    args = (*ctx, v) if v is not None else ctx
    first = kernel.variants[0]
    if first in _FORWARD and not failed:
        try:
            out = kernel.graph_body(u, args, forward=True)
        except NotImplementedError as e:  # (an operation without a rule: the tapes)
            failed.append(str(e))
        else:
            return out
    tapes = kernel.variants[0] == "tapes" or (first in _FORWARD and kernel.variants[1] == "tapes")
    return kernel.graph_body(u, args, tapes=tapes)


def recomputed(fn: Compute) -> Compute:
    """``fn`` recomputed in the backward pass (``tf.recompute_grad``)."""
    def run(u: tf.Tensor, ctx: tuple[tf.Tensor, ...], v: Any) -> dict[str, tf.Tensor]:
        # traced first: tf.recompute_grad runs its function with the tapes paused, and a
        # trace there would record none of the derivatives' own tapes (wrong derivatives)
        variables = fn.prepare(u, ctx, v).trainable_variables  # type: ignore[attr-defined]
        names: list[str] = []

        def flat(u: tf.Tensor, *rest: tf.Tensor) -> list[tf.Tensor]:
            # read through their API, which tf.recompute_grad watches to find the variables
            # to differentiate (it does not see a traced function's reads with tapes paused)
            for var in variables:
                var.read_value()
            out = fn(u, rest[:len(ctx)], rest[len(ctx)] if v is not None else None)
            names[:] = sorted(out)
            return [out[n] for n in names]

        parts = tf.recompute_grad(flat)(u, *ctx, *(() if v is None else (v,)))
        return dict(zip(names, parts))

    return run


