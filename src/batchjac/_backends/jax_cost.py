"""The arithmetic of a JAX computation, counted from its jaxpr: no compilation, no values.

A kernel's first build is chosen by what it will compute (:class:`~batchjac._backends.jax.
JaxKernel`): XLA at optimization level 0 compiles a small kernel in about two thirds of the
time of its default build (W1's 1,000-row chunk: 94 against 139 ms of CPU on the project's
machine) and runs it ~4x slower (1.9 against 0.5 ms); for a job of a few milliseconds the
compilation is the first call. Counting the work takes a walk over the traced equations
(well under a millisecond), where XLA's own ``cost_analysis`` of the lowered module takes
6-11 ms, a fifth of what it would decide about.

The count is an estimate for that one decision: matrix products and convolutions at
``2 * output size * contracted size``, every other equation at its output size, loops at their
trip count (a ``while`` at one trip: its count is not known before it runs).
"""

from __future__ import annotations

import math
from typing import Any

#: primitives holding sub-jaxprs run once per call, by parameter name
_ONCE = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def flops(jaxpr: Any) -> float:
    """Estimated floating-point operations of one evaluation of ``jaxpr`` (a Jaxpr or
    ClosedJaxpr)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in inner.eqns:
        total += _equation(eqn)
    return total


def _size(var: Any) -> float:
    shape = getattr(getattr(var, "aval", None), "shape", ())
    return float(math.prod(shape)) if shape else 1.0


def _equation(eqn: Any) -> float:
    name = eqn.primitive.name
    params = eqn.params
    out = sum(_size(v) for v in eqn.outvars)
    if name == "dot_general":
        (contract, _), _ = params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        contracted = math.prod(lhs_shape[d] for d in contract) if contract else 1
        return 2.0 * out * contracted
    if name == "conv_general_dilated":
        rhs_shape = eqn.invars[1].aval.shape
        spec = params["dimension_numbers"].rhs_spec  # (out features, in features, *spatial)
        window = math.prod(rhs_shape[d] for d in spec[1:])
        return 2.0 * out * window
    if name == "scan":
        return params["length"] * flops(params["jaxpr"])
    if name == "cond":
        return max((flops(b) for b in params["branches"]), default=0.0)
    if name == "while":
        return flops(params["cond_jaxpr"]) + flops(params["body_jaxpr"])
    for key in _ONCE:
        sub = params.get(key)
        if sub is not None and hasattr(getattr(sub, "jaxpr", sub), "eqns"):
            return flops(sub)
    return out
