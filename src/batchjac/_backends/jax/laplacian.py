"""A forward Laplacian for JAX functions (collapsed Taylor mode; cf. y1xiaoc/fwdlap and
Dangel et al. 2024, "Kronecker-factored ... / collapsed Taylor mode"): the value, its ``k``
first derivatives along the unit tangents of the unknowns and ONE summed second-order term,
pushed together through the function's jaxpr. A dense layer then costs ``k + 2`` matrix
products, where ``jvp`` of ``jvp`` along each unknown costs ``2k + 1`` and the trace of
``jax.hessian`` (forward over reverse) ``2k + 2``; the primal is computed once.

The interpreter walks the jaxpr of one instance's function, equation by equation. A value
that depends on the unknowns is a :class:`_Dual` ``(p, j, l)``: ``p`` the value, ``j`` its
derivatives along the ``k`` unit tangents, shaped ``(k, *p.shape)``, ``l`` the sum of its
second derivatives along them (``None``: zero, as for the unknowns themselves and anything
affine in them). The rules:

- affine operations (shape operations, sums, concatenation, selection, casts between
  floating types): the tangent is the operation of the tangents (``vmap`` over the ``k``
  axis, constants as zeros), the Laplacian the operation of the Laplacians;
- multilinear ones with one varying operand (``dot_general``, ``conv_general_dilated``,
  ``mul``, ``div`` of a varying numerator): the same with the other operands kept; with two
  varying operands, the product rule, ``l = B(la, b) + B(a, lb) + 2 sum_k B(ja_k, jb_k)``;
- elementwise functions ``g`` (tanh, logistic, exp, log, sin, cos, sqrt, rsqrt, powers...):
  ``j' = g'(p) j`` and ``l' = g'(p) l + g''(p) sum_k j_k^2``; ``max``/``min`` (relu) are
  piecewise linear (JAX's balanced choice at ties);
- ``jit``/``closed_call``/``custom_jvp_call``/``checkpoint``: their jaxpr, recursively (for
  ``custom_jvp_call`` the function itself, not its rule, as ``jax.experimental.jet`` does).

The same walk gives the whole Hessian (:func:`run_hessian`, forward second-order Taylor mode)
when ``l`` holds, instead of the one summed term, the second derivatives along every pair of
unit tangents ``a <= b``, ``(k(k+1)/2, *p.shape)`` (:class:`_Form` says which): the rules are
the same with ``sum_k j_k^2`` read as the products ``j_a j_b`` of each pair, the product rule's
``2 sum_k B(ja_k, jb_k)`` as ``B(ja_a, jb_b) + B(ja_b, jb_a)``, and a linear operation applied
to each pair's term. A dense layer then costs ``1 + k + k(k+1)/2`` matrix products (W6's 5
unknowns: 21) where ``jacfwd(jacrev(f))`` pushes ``k`` tangents through the primal and ``m``
gradients (W6's 4 outputs: about ``2k(1 + m)`` = 50), and its program is a few operations a
layer, which XLA compiles sooner.

An equation with no rule raises :class:`Unsupported` naming its primitive, during the trace:
the caller then computes the result the other way (``jvp`` of ``jvp``, ``jax.hessian``) and
says why. So does an equation the walk cannot read (a parameter a JAX release renamed,
:mod:`.compat`): slower, never an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import compat

if TYPE_CHECKING:  # (at run time told apart by their attributes, as cost.py does:
    # importing jax.extend for the classes costs a first call a noticeable share)
    from jax.extend.core import ClosedJaxpr, Jaxpr


class Unsupported(Exception):
    """The function has a primitive the forward Laplacian has no rule for."""

    def __init__(self, primitive: str, why: str = "") -> None:
        super().__init__(f"no forward-Laplacian rule for the JAX primitive {primitive!r}"
                         + (f" ({why})" if why else ""))
        self.primitive = primitive


class _Dual:
    """A value depending on the unknowns: value ``p``, tangents ``j`` ``(k, *p.shape)``,
    summed second derivative ``l`` (None: zero)."""

    __slots__ = ("j", "l", "p")

    def __init__(self, p: Any, j: Any, l: Any) -> None:  # noqa: E741 - the paper's name
        self.p, self.j, self.l = p, j, l


#: sub-jaxprs called on the operands as they are
_CALLS = compat.FORWARD_CALLS
#: affine in their floating operands (integer operands: indices, predicates, kept)
_AFFINE = frozenset({
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "concatenate", "pad",
    "slice", "dynamic_slice", "dynamic_update_slice", "gather", "reduce_sum", "select_n",
    "copy", "copy_p", "rev", "cumsum", "split", "convert_element_type", "real", "stack",
    "unstack",
})
#: linear in each operand (the others kept)
_BILINEAR = frozenset({"dot_general", "conv_general_dilated", "mul"})
#: results with no derivative (comparisons, rounding, integer results)
_FLAT = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "is_finite", "sign", "floor", "ceil",
                   "round", "and", "or", "not", "xor", "argmax", "argmin", "iota",
                   "stop_gradient"})


def _unary(name: str, x: Any, y: Any, eqn: Any) -> tuple[Any, Any] | None:
    """``(g'(x), g''(x))`` of the elementwise ``y = g(x)`` (``g''`` None: zero), or None."""
    if name == "tanh":
        d1 = 1 - y * y
        return d1, -2 * y * d1
    if name == "logistic":
        d1 = y * (1 - y)
        return d1, d1 * (1 - 2 * y)
    if name == "exp":
        return y, y
    if name == "exp2":
        ln2 = float(np.log(2.0))
        return ln2 * y, ln2 * ln2 * y
    if name == "expm1":
        return y + 1, y + 1
    if name == "log":
        r = 1 / x
        return r, -r * r
    if name == "log1p":
        r = 1 / (1 + x)
        return r, -r * r
    if name == "sin":
        return jnp.cos(x), -y
    if name == "cos":
        return -jnp.sin(x), -y
    if name == "sqrt":
        d1 = 0.5 / y
        return d1, -0.5 * d1 / x
    if name == "rsqrt":
        d1 = -0.5 * y / x
        return d1, -1.5 * d1 / x
    if name == "square":
        return 2 * x, jnp.full_like(x, 2)
    if name == "integer_pow":
        n = int(compat.param(eqn, "y"))
        if n == 0:
            return jnp.zeros_like(x), None
        d1 = n * (lax.integer_pow(x, n - 1) if n != 1 else jnp.ones_like(x))
        d2 = None if n == 1 else n * (n - 1) * (lax.integer_pow(x, n - 2) if n != 2
                                                else jnp.ones_like(x))
        return d1, d2
    if name == "erf":
        d1 = float(2 / np.sqrt(np.pi)) * jnp.exp(-x * x)  # (a Python float: weak, no promotion)
        return d1, -2 * x * d1
    if name == "abs":
        return jnp.sign(x), None
    return None


def _bcast(j: Any, shape: tuple[int, ...]) -> Any:
    """Tangents ``(k, *s)`` broadcast to ``(k, *shape)`` (numpy rules on the trailing axes)."""
    if tuple(j.shape[1:]) == shape:
        return j
    k, s = j.shape[0], tuple(j.shape[1:])
    j = j.reshape((k, *([1] * (len(shape) - len(s))), *s))
    return jnp.broadcast_to(j, (k, *shape))


class _Form:
    """What the second-order part ``l`` of a :class:`_Dual` holds: the Laplacian's one summed
    term, shaped as the value (``pairs`` "sum"), or the second derivatives along pairs of unit
    tangents ``(a, b)``, ``(T, *p.shape)``: every pair ``a <= b`` ("triangle": the Hessian's
    upper triangle, ``T = k(k+1)/2``, in :func:`numpy.triu_indices` order) or ``a = b``
    ("diagonal", ``T = k``)."""

    def __init__(self, k: int, pairs: str) -> None:
        self.k, self.full = k, pairs != "sum"
        self.a, self.b = np.triu_indices(k) if pairs == "triangle" else (np.arange(k),) * 2
        self.diagonal = pairs == "diagonal"

    def outer(self, ja: Any, jb: Any) -> Any:
        """The second-order term of ``g(x)`` per unit of ``g''``: ``sum_k ja_k jb_k`` or
        ``ja_a jb_b`` per pair (``ja``, ``jb`` tangents ``(k, *s)`` of one shape)."""
        if not self.full:
            return jnp.sum(ja * jb, axis=0)
        return ja * jb if self.diagonal else ja[self.a] * jb[self.b]

    def cross(self, ja: Any, jb: Any) -> Any:
        """The product rule's cross term of ``x * z``: ``2 sum_k ja_k jb_k`` or
        ``ja_a jb_b + ja_b jb_a`` per pair."""
        if not self.full:
            return 2 * jnp.sum(ja * jb, axis=0)
        return 2 * ja * jb if self.diagonal else ja[self.a] * jb[self.b] + ja[self.b] * jb[self.a]

    def cross_of(self, bb: Callable[[Any, Any], Any], ja: Any, jb: Any) -> Any:
        """:meth:`cross` for a bilinear ``bb`` (a matrix product of two varying operands)."""
        if not self.full:
            return 2 * jnp.sum(jax.vmap(bb)(ja, jb), axis=0)
        if self.diagonal:
            return 2 * jax.vmap(bb)(ja, jb)
        return jax.vmap(bb)(ja[self.a], jb[self.b]) + jax.vmap(bb)(ja[self.b], jb[self.a])

    def map(self, fn: Callable[..., Any], *ls: Any) -> Any:
        """A linear operation applied to second-order parts (to each pair's term)."""
        return jax.vmap(fn)(*ls) if self.full else fn(*ls)

    def bcast(self, l: Any, shape: tuple[int, ...]) -> Any:  # noqa: E741 - the paper's name
        if l is None:
            return None
        if self.full:
            return _bcast(l, shape)
        return l if tuple(l.shape) == shape else jnp.broadcast_to(l, shape)

    def zeros(self, p: Any) -> Any:
        p = jnp.asarray(p)
        return jnp.zeros((len(self.a), *p.shape), p.dtype) if self.full else jnp.zeros_like(p)


def _plus(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None else a + b


def _through(d: _Dual, y: Any, d1: Any, d2: Any, form: _Form) -> _Dual:
    """``g(d)`` for an elementwise ``g`` with ``y = g(d.p)``, ``g' = d1``, ``g'' = d2``."""
    lap = None if d.l is None else d.l * d1
    if d2 is not None:
        lap = _plus(lap, d2 * form.outer(d.j, d.j))
    return _Dual(y, d.j * d1, lap)


def _mul(a: Any, b: Any, form: _Form) -> Any:
    """The product of two values, either of them a :class:`_Dual`."""
    if not isinstance(a, _Dual) and not isinstance(b, _Dual):
        return a * b
    if not isinstance(b, _Dual):
        a, b = b, a
    # (the derivatives are broadcast to the result's shape before the product: a scalar
    # times a vector is a ``mul`` of shapes () and (n,), whose tangents (k,) would otherwise
    # meet the vector's (n,) axis)
    if not isinstance(a, _Dual):  # b varies
        y = a * b.p
        shape = tuple(y.shape)
        return _Dual(y, _bcast(b.j, shape) * a,
                     None if b.l is None else form.bcast(b.l, shape) * a)
    y = a.p * b.p
    shape = tuple(y.shape)
    ja, jb = _bcast(a.j, shape), _bcast(b.j, shape)
    la, lb = form.bcast(a.l, shape), form.bcast(b.l, shape)
    lap = _plus(_plus(None if la is None else la * b.p, None if lb is None else a.p * lb),
                form.cross(ja, jb))
    return _Dual(y, ja * b.p + a.p * jb, lap)


def _recip(d: _Dual, form: _Form) -> _Dual:
    r = 1 / d.p
    return _through(d, r, -r * r, 2 * r * r * r, form)


def _log(d: _Dual, form: _Form) -> _Dual:
    r = 1 / d.p
    return _through(d, jnp.log(d.p), r, -r * r, form)


def _exp(d: _Dual, form: _Form) -> _Dual:
    y = jnp.exp(d.p)
    return _through(d, y, y, y, form)


def _bind(eqn: Any, args: Sequence[Any]) -> list[Any]:
    return compat.bind(eqn, args)


def _floating(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def _linear(eqn: Any, ins: list[Any], vary: list[int], affine: bool, form: _Form
            ) -> list[Any]:
    """An operation linear in its varying operands (affine: the others' floating values
    as zeros in the derivatives): the tangents ``vmap``-ed over ``k``, the second-order
    parts through :meth:`_Form.map`."""
    primals = [a.p if isinstance(a, _Dual) else a for a in ins]
    outs = _bind(eqn, primals)
    zeros = [i for i, a in enumerate(primals) if affine and i not in vary and _floating(a)]

    def apply(*ts: Any) -> list[Any]:
        args = list(primals)
        for i in zeros:
            args[i] = jnp.zeros_like(args[i])
        for i, t in zip(vary, ts):
            args[i] = t
        return _bind(eqn, args)

    laps: list[Any] = [None] * len(outs)
    if form.full and any(ins[i].l is not None for i in vary):
        # the tangents and the pairs' terms in one operation ((k + T) slices, one product)
        k = form.k
        both = jax.vmap(apply)(*[jnp.concatenate([ins[i].j, ins[i].l if ins[i].l is not None
                                                  else form.zeros(ins[i].p)]) for i in vary])
        jacs, laps = [t[:k] for t in both], [t[k:] for t in both]
    else:
        jacs = jax.vmap(apply)(*[ins[i].j for i in vary])
        if any(ins[i].l is not None for i in vary):
            laps = form.map(apply, *[ins[i].l if ins[i].l is not None else form.zeros(ins[i].p)
                                     for i in vary])
    return [_Dual(y, j, lp) if _floating(y) else y for y, j, lp in zip(outs, jacs, laps)]


def _bilinear_both(eqn: Any, ins: list[Any], form: _Form) -> list[Any]:
    """``B(a, b)`` with both operands varying: the product rule."""
    a, b = ins
    (y,) = _bind(eqn, [a.p, b.p])

    def bb(x: Any, z: Any) -> Any:
        return _bind(eqn, [x, z])[0]

    jac = jax.vmap(bb, in_axes=(0, None))(a.j, b.p) + jax.vmap(bb, in_axes=(None, 0))(a.p, b.j)
    lap = form.cross_of(bb, a.j, b.j)
    if a.l is not None:
        lap = lap + form.map(lambda x: bb(x, b.p), a.l)
    if b.l is not None:
        lap = lap + form.map(lambda z: bb(a.p, z), b.l)
    return [_Dual(y, jac, lap)]


def _pick(a: Any, b: Any, y: Any, name: str) -> Any:
    """The weight of ``a`` in ``max``/``min``: 1 where it is chosen, 0.5 at ties (JAX's)."""
    pa, pb = (a.p if isinstance(a, _Dual) else a), (b.p if isinstance(b, _Dual) else b)
    wins = pa > pb if name == "max" else pa < pb
    return jnp.where(wins, 1.0, jnp.where(pa == pb, 0.5, 0.0)).astype(y.dtype)


def _equation(eqn: Any, ins: list[Any], form: _Form) -> list[Any]:
    name = compat.primitive(eqn)
    vary = [i for i, a in enumerate(ins) if isinstance(a, _Dual)]
    if not vary or name in _FLAT:
        return _bind(eqn, [a.p if isinstance(a, _Dual) else a for a in ins])
    if name in _CALLS:
        sub = compat.param(eqn, _CALLS[name])
        if hasattr(sub, "consts"):  # a ClosedJaxpr
            return _eval(sub.jaxpr, sub.consts, ins, form)
        return _eval(sub, [], ins, form)
    if name in ("add", "sub", "add_any") or (name == "neg" and len(ins) == 1):
        primals = [a.p if isinstance(a, _Dual) else a for a in ins]
        (y,) = _bind(eqn, primals)
        shape = tuple(y.shape)
        jac = lap = None
        for i in vary:
            neg = name == "neg" or (name == "sub" and i == 1)
            j, lp = _bcast(ins[i].j, shape), form.bcast(ins[i].l, shape)
            if neg:
                j, lp = -j, None if lp is None else -lp
            jac, lap = _plus(jac, j), _plus(lap, lp)
        return [_Dual(y, jac, lap)]
    if name == "convert_element_type" and not jnp.issubdtype(compat.param(eqn, "new_dtype"),
                                                              jnp.inexact):
        return _bind(eqn, [ins[0].p])
    if name in _AFFINE:
        return _linear(eqn, ins, vary, True, form)
    if name == "mul":
        return [_mul(ins[0], ins[1], form)]
    if name in _BILINEAR:
        return _linear(eqn, ins, vary, False, form) if len(vary) == 1 \
            else _bilinear_both(eqn, ins, form)
    if name == "div":
        a, b = ins
        if not isinstance(b, _Dual):
            return _linear(eqn, ins, vary, False, form)
        return [_mul(a, _recip(b, form), form)]
    if name == "pow":
        a, b = ins
        if not isinstance(b, _Dual):  # x ** c
            (y,) = _bind(eqn, [a.p, b])
            # (c as a JAX value: numpy 1's arithmetic on a literal's float32 value gives float64)
            b = jnp.asarray(b)
            d1 = b * a.p ** (b - 1)
            return [_through(a, y, d1, b * (b - 1) * a.p ** (b - 2), form)]
        return [_exp(_mul(_log(a, form) if isinstance(a, _Dual) else jnp.log(a), b, form), form)]
    if name in ("max", "min"):
        a, b = ins
        (y,) = _bind(eqn, [x.p if isinstance(x, _Dual) else x for x in ins])
        shape = tuple(y.shape)
        w = _pick(a, b, y, name)
        jac = lap = None
        for d, wt in ((a, w), (b, 1 - w)):
            if isinstance(d, _Dual):
                jac = _plus(jac, _bcast(d.j, shape) * wt)
                lap = _plus(lap, None if d.l is None else form.bcast(d.l, shape) * wt)
        return [_Dual(y, jac, lap)]
    if len(ins) == 1:
        (y,) = _bind(eqn, [ins[0].p])
        derivs = _unary(name, ins[0].p, y, eqn)
        if derivs is not None:
            return [_through(ins[0], y, *derivs, form)]
    raise Unsupported(name)


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], form: _Form) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if compat.is_literal(v) else env[v]  # a Literal's value

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    eqn: Any = None
    try:
        for eqn in jaxpr.eqns:
            outs = _equation(eqn, [read(v) for v in eqn.invars], form)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]
    except Unsupported:
        raise
    except Exception as e:  # a jaxpr this JAX writes otherwise (a renamed parameter)
        raise Unsupported(_name(eqn), f"{type(e).__name__}: {e}"[:200]) from e


def _name(eqn: Any) -> str:
    if eqn is None:
        return "?"
    try:
        return compat.primitive(eqn)
    except Exception:
        return "?"


def trace(fn: Callable[..., Any], *specs: Any) -> ClosedJaxpr:
    """The jaxpr of ``fn`` (one instance's function) for arguments shaped as ``specs``."""
    return jax.make_jaxpr(fn)(*specs)


def _push(closed: ClosedJaxpr, u: Any, rest: Sequence[Any], pairs: str
          ) -> tuple[Any, Any, Any, _Form]:
    """``(y, J, l, form)``: the walk of ``closed`` from ``u`` along its unit tangents."""
    k = int(np.prod(u.shape, dtype=np.int64))
    form = _Form(k, pairs)
    seed = jnp.eye(k, dtype=u.dtype).reshape((k, *u.shape))
    (out,) = _eval(closed.jaxpr, closed.consts, [_Dual(u, seed, None), *rest], form)
    if not isinstance(out, _Dual):
        out = jnp.asarray(out)
        return out, jnp.zeros((k, *out.shape), out.dtype), form.zeros(out), form
    shape = tuple(out.p.shape)
    lap = form.zeros(out.p) if out.l is None else form.bcast(out.l, shape)
    return out.p, _bcast(out.j, shape), lap, form


def run(closed: ClosedJaxpr, u: Any, *rest: Any) -> tuple[Any, Any, Any]:
    """``(y, J, L)`` of ``closed`` (a function of ``(u, *rest)`` with one output) at ``u``:
    ``J`` ``(k, *y.shape)`` along the unit tangents of ``u`` (``k = u.size``, in ``u``'s
    row-major order), ``L`` the Laplacian over ``u``. Raises :class:`Unsupported`."""
    y, jac, lap, _ = _push(closed, u, rest, "sum")
    return y, jac, lap


def run_diagonal(closed: ClosedJaxpr, u: Any, *rest: Any) -> tuple[Any, Any, Any]:
    """``(y, J, D)`` as :func:`run`, with ``D`` ``(k, *y.shape)`` the Hessian's diagonal over
    ``u`` (the second derivative along each unit tangent)."""
    y, jac, diag, _ = _push(closed, u, rest, "diagonal")
    return y, jac, diag


def run_hessian(closed: ClosedJaxpr, u: Any, *rest: Any) -> tuple[Any, Any, Any]:
    """``(y, J, H)`` as :func:`run`, with ``H`` ``(k, k, *y.shape)`` the Hessian over ``u``
    (symmetric: its upper triangle computed, the lower one a copy)."""
    y, jac, tri, form = _push(closed, u, rest, "triangle")
    k = form.k
    index = np.zeros((k, k), dtype=np.int32)
    index[form.a, form.b] = np.arange(len(form.a))
    index[form.b, form.a] = np.arange(len(form.a))
    return y, jac, tri[index.reshape(-1)].reshape((k, k, *tri.shape[1:]))
