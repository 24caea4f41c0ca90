"""The work of a JAX computation, counted from its jaxpr: no compilation, no values.

A kernel's first build is chosen by what it will compute (:class:`~batchjac._backends.jax.
JaxKernel`): XLA at optimization level 0 without its fusion emitters compiles a kernel in a
third to 40% of the time of its default build and runs its own loops 2-3x slower, while
matrix products and convolutions, library calls either way, run about as fast. So the count
keeps the two apart:

- ``products``: floating-point operations of matrix products and convolutions, at
  ``2 * output size * contracted size``;
- ``elements``: the output elements of every other equation, the loops XLA emits, each a
  little slower in the quick build: the count prices what that build loses against what its
  compilation saves (measured: docs/thresholds.md, ``JaxKernel.QUICK_ELEMENTS``).

Loops count at their trip count (a ``while`` at one trip: its count is not known before it
runs). The walk is quick, where XLA's own ``cost_analysis`` of the lowered module takes a
sizeable part of what it would decide about (docs/thresholds.md, "Measured choices").

The count is a heuristic whose only job is speed: where a jaxpr holds something it cannot
read (a parameter a JAX release renamed, :mod:`.compat`), it is no estimate (None), never an
error, so that a first call is never failed by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from . import compat

_PRODUCTS = ("dot_general", "conv_general_dilated")


@dataclass(frozen=True)
class Work:
    products: float = 0.0
    elements: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.products + other.products, self.elements + other.elements)

    def __mul__(self, times: float) -> Work:
        return Work(self.products * times, self.elements * times)

    @property
    def flops(self) -> float:
        """Every operation, an element of elementwise work counted as one."""
        return self.products + self.elements


def work(jaxpr: Any) -> Work | None:
    """The estimated work of one evaluation of ``jaxpr`` (a Jaxpr or ClosedJaxpr), or None
    where the jaxpr holds what the count cannot read: no estimate."""
    try:
        return _work(jaxpr)
    except Exception:  # (a renamed parameter: KeyError; a changed structure)
        return None


def flops(jaxpr: Any) -> float | None:
    counted = work(jaxpr)
    return None if counted is None else counted.flops


def _work(jaxpr: Any) -> Work:
    total = Work()
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        total = total + _equation(eqn)
    return total


def equation(eqn: Any) -> Work:
    """The work of one equation, its sub-jaxprs' included (raises where it cannot be read)."""
    return _equation(eqn)


def _size(var: Any) -> float:
    shape = getattr(getattr(var, "aval", None), "shape", ())
    return float(math.prod(shape)) if shape else 1.0


def _equation(eqn: Any) -> Work:
    name = compat.primitive(eqn)
    out = sum(_size(v) for v in eqn.outvars)
    if name == "dot_general":
        (contract, _), _ = compat.param(eqn, "dimension_numbers")
        lhs_shape = eqn.invars[0].aval.shape
        contracted = math.prod(lhs_shape[d] for d in contract) if contract else 1
        return Work(products=2.0 * out * contracted)
    if name == "conv_general_dilated":
        rhs_shape = eqn.invars[1].aval.shape
        spec = compat.param(eqn, "dimension_numbers").rhs_spec  # (out, in features, *spatial)
        window = math.prod(rhs_shape[d] for d in spec[1:])
        return Work(products=2.0 * out * window)
    if name == "scan":
        return _work(compat.param(eqn, "jaxpr")) * compat.param(eqn, "length")
    if name == "cond":
        branches = [_work(b) for b in compat.param(eqn, "branches")]
        return max(branches, key=lambda w: w.flops, default=Work())
    if name == "while":
        return _work(compat.param(eqn, "cond_jaxpr")) + _work(compat.param(eqn, "body_jaxpr"))
    for sub in compat.sub_jaxprs(eqn, compat.CALLED_ONCE):
        return _work(sub)
    return Work(elements=out)


def peak_row_bytes(jaxpr: Any, rows: int) -> float | None:
    """Bytes per row of the arrays ``jaxpr`` holds at once at its peak, evaluated equation by
    equation, each array freed after its last use (the arguments excluded: they exist
    already), counting only arrays whose leading axis is the ``rows`` of the batch (weights
    and other per-batch arrays do not grow with the chunk). An upper bound of what XLA's own
    buffer assignment keeps (it fuses elementwise chains): measured on the project's machine,
    1.4-2.9x ``memory_analysis().temp_size_in_bytes`` of the same kernels. None for a jaxpr
    with no batch-sized array, or one the walk cannot read (no estimate)."""
    try:
        peak = _peak(getattr(jaxpr, "jaxpr", jaxpr), rows, {})
    except Exception:  # (a renamed parameter, a changed structure)
        return None
    return peak / rows if peak > 0 else None


def _row_bytes(var: Any, rows: int) -> float:
    aval: Any = getattr(var, "aval", None)
    shape = getattr(aval, "shape", ())
    if not shape or shape[0] != rows:
        return 0.0
    return float(math.prod(shape)) * getattr(getattr(aval, "dtype", None), "itemsize", 0)


def _peak(jaxpr: Any, rows: int, seen: dict[int, float]) -> float:
    """One pass over the equations (linear in their count; a sub-jaxpr met again, as each
    ``jnp`` function's ``pjit`` is, is counted from ``seen``). Literals are told by their
    value (:func:`~batchjac._backends.jax.compat.is_literal`)."""
    key = id(jaxpr)
    if key in seen:
        return seen[key]
    last: dict[int, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not compat.is_literal(v):
                last[id(v)] = i
    for v in jaxpr.outvars:
        if not compat.is_literal(v):
            last[id(v)] = len(jaxpr.eqns)
    given = {id(v) for v in (*jaxpr.invars, *jaxpr.constvars)}  # not held by this jaxpr
    live = peak = 0.0
    for i, eqn in enumerate(jaxpr.eqns):
        inner = 0.0
        for body in compat.sub_jaxprs(eqn):
            inner = max(inner, _peak(body, rows, seen))
        out = 0.0
        for v in eqn.outvars:
            out += _row_bytes(v, rows)
        peak = max(peak, live + max(inner, out))
        live += out
        freed = {id(v): v for v in eqn.invars
                 if not compat.is_literal(v) and last.get(id(v)) == i and id(v) not in given}
        for v in freed.values():
            live -= _row_bytes(v, rows)
        for v in eqn.outvars:
            if id(v) not in last:
                live -= _row_bytes(v, rows)
    seen[key] = peak
    return peak
