"""Whether a JAX batch function keeps its rows apart, read from its jaxpr: no values, no
compilation.

The probes (:mod:`batchjac._probes`) check that a model is deterministic and that its rows
do not interact (batch statistics make per-instance Jacobians silently wrong). They do it
with values: three forward passes of a few rows, which in JAX cost a compilation of the
forward (for a small model, about as much as the native answer's whole compilation:
docs/thresholds.md). A jaxpr can often prove both without running anything:

- **rows apart**: follow the batch axis (axis 0 of every input that has one) through each
  equation; a primitive that keeps it at axis 0 and mixes nothing along it (elementwise
  maths, a matrix product contracting other axes, a convolution with the batch as its batch
  dimension, a reduction over other axes, a reshape that keeps the leading size...) passes it
  on, and every output must end with its rows at axis 0;
- **deterministic**: every primitive met is a pure function of its operands (random
  number generators and host callbacks are not in the list).

Any primitive not known here, or a use of it that might mix rows (a reduction over axis 0,
``x - x.mean(0)``, a gather, a sort along the rows), answers "cannot tell", and the probes
then run with values as before: this is a shortcut for the common case, never a verdict
against a model. So is a jaxpr this module cannot read (a parameter a JAX release renamed,
:mod:`.compat`): "cannot tell", never an error.
"""

from __future__ import annotations

from typing import Any

from . import compat

#: primitives that act element by element (operands broadcast to the output's shape)
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma",
    "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag",
    "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "reduce_precision", "rem",
    "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh",
    "xor"
})
#: reductions (and cumulative ones) over the axes they name
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "argmax", "argmin"})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
#: primitives holding a sub-jaxpr called on their operands as they are
CALLS = compat.CALLS

ROWS = 0  # a value with the batch at axis 0
NONE = None  # a value that does not depend on the inputs' rows
#: a constant the same at every index of its axis 0 (a scalar broadcast: the zero tangent of a
#: known input, in the jaxpr of a forward derivative), which may stand beside a row's values
UNIFORM = -1


class _Unknown(Exception):
    """The jaxpr does something this module cannot follow."""


def rows_apart(closed: Any, batched: list[bool]) -> bool:
    """True when ``closed`` (a ClosedJaxpr) provably maps each row of its batched inputs
    (``batched[i]``: invar ``i`` has the batch at axis 0) to the same row of every output,
    deterministically. False means "cannot tell", not "they interact"."""
    try:
        outs = _walk(closed.jaxpr, [ROWS if b else NONE for b in batched])
    except Exception:  # _Unknown, or a jaxpr this JAX writes otherwise (a renamed parameter)
        return False
    return bool(outs) and all(o == ROWS for o in outs)


def _walk(jaxpr: Any, inputs: list[int | None]) -> list[int | None]:
    if len(inputs) != len(jaxpr.invars):
        raise _Unknown
    env: dict[Any, int | None] = dict.fromkeys(jaxpr.constvars, NONE)
    env.update(zip(jaxpr.invars, inputs))

    def read(v: Any) -> int | None:
        return env.get(v, NONE) if hasattr(v, "aval") and not compat.is_literal(v) else NONE

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if any(s == ROWS for s in ins):
            outs = _rule(eqn, ins)
        elif compat.primitive(eqn) == "broadcast_in_dim" and \
                0 not in compat.param(eqn, "broadcast_dimensions"):
            outs = [UNIFORM]  # (axis 0 is new: every index along it holds the same values)
        else:
            outs = _constant(eqn)
        for v, s in zip(eqn.outvars, outs):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _constant(eqn: Any) -> list[int | None]:
    """An equation on no row-dependent operand: its outputs are constants, if the primitive
    is a pure one (a random draw is not, even of constants)."""
    if not _known(compat.primitive(eqn)):
        raise _Unknown
    return [NONE] * len(eqn.outvars)


#: primitives that make constants from nothing (``jnp.arange``, ``jnp.eye``)
SOURCES = frozenset({"iota"})


def _known(name: str) -> bool:
    return any(name in group for group in (SOURCES, ELEMENTWISE, REDUCTIONS, CUMULATIVE, CALLS,
                                           _SHAPES))


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _rule(eqn: Any, ins: list[int | None]) -> list[int | None]:
    name = compat.primitive(eqn)
    if name in CALLS:
        sub = compat.maybe_param(eqn, CALLS[name])
        if sub is None:
            raise _Unknown
        return _walk(getattr(sub, "jaxpr", sub), ins)
    if len(eqn.outvars) != 1:
        raise _Unknown
    out = _shape(eqn.outvars[0])
    if name in ELEMENTWISE:
        for v, s in zip(eqn.invars, ins):
            shape = _shape(v)
            if s == ROWS and len(shape) != len(out):
                raise _Unknown  # a batched operand broadcast against more axes
            if s is NONE and len(shape) == len(out) and out and shape[0] != 1 and out[0] != 1:
                raise _Unknown  # a constant of one value per row: row-specific
        return [ROWS]
    if name != "concatenate":  # (beside a row's values there, as in elementwise maths)
        ins = [NONE if s == UNIFORM else s for s in ins]  # elsewhere a constant like any other
    if name in REDUCTIONS:
        if 0 in tuple(compat.param(eqn, "axes")):
            raise _Unknown
        return [ROWS]
    if name in CUMULATIVE:
        if compat.param(eqn, "axis") == 0:
            raise _Unknown
        return [ROWS]
    rule = _SHAPES.get(name)
    if rule is None or not rule(eqn, ins, out):
        raise _Unknown
    return [ROWS]


def _broadcast(eqn: Any, ins: list[int | None], out: tuple[int, ...]) -> bool:
    dims = tuple(compat.param(eqn, "broadcast_dimensions"))
    return bool(dims) and dims[0] == 0 and _shape(eqn.invars[0])[0] == out[0]


def _reshape(eqn: Any, ins: list[int | None], out: tuple[int, ...]) -> bool:
    return compat.maybe_param(eqn, "dimensions") is None and bool(out) and \
        out[0] == _shape(eqn.invars[0])[0]


def _dot(eqn: Any, ins: list[int | None], out: tuple[int, ...]) -> bool:
    (lc, _), (lb, rb) = (tuple(map(tuple, d)) for d in compat.param(eqn, "dimension_numbers"))
    lhs, rhs = ins[0], ins[1]
    if lhs == ROWS and rhs is NONE:
        return 0 not in lc and not lb
    if lhs == ROWS and rhs == ROWS:
        return lb[:1] == (0,) and rb[:1] == (0,)
    return False


def _conv(eqn: Any, ins: list[int | None], out: tuple[int, ...]) -> bool:
    dn = compat.param(eqn, "dimension_numbers")
    return ins[0] == ROWS and ins[1] is NONE and dn.lhs_spec[0] == 0 and \
        dn.out_spec[0] == 0 and compat.param(eqn, "batch_group_count") == 1


def _transpose(eqn: Any, ins: list[int | None], out: tuple[int, ...]) -> bool:
    return tuple(compat.param(eqn, "permutation"))[:1] == (0,)


def _concatenate(eqn: Any, ins: list[int | None], out: tuple[int, ...]) -> bool:
    return compat.param(eqn, "dimension") != 0 and all(s in (ROWS, UNIFORM) for s in ins)


def _slice(eqn: Any, ins: list[int | None], out: tuple[int, ...]) -> bool:
    strides = compat.maybe_param(eqn, "strides")
    return compat.param(eqn, "start_indices")[0] == 0 and \
        compat.param(eqn, "limit_indices")[0] == _shape(eqn.invars[0])[0] and \
        (strides is None or strides[0] == 1)


def _squeeze(eqn: Any, ins: list[int | None], out: tuple[int, ...]) -> bool:
    return 0 not in tuple(compat.param(eqn, "dimensions"))


def _pad(eqn: Any, ins: list[int | None], out: tuple[int, ...]) -> bool:
    return ins[1] is NONE and tuple(compat.param(eqn, "padding_config")[0]) == (0, 0, 0)


_SHAPES = {"broadcast_in_dim": _broadcast, "reshape": _reshape, "dot_general": _dot,
           "conv_general_dilated": _conv, "transpose": _transpose, "concatenate": _concatenate,
           "slice": _slice, "squeeze": _squeeze, "pad": _pad}
