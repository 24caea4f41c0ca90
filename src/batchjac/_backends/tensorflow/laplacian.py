"""A forward Laplacian, and a forward Hessian, for TensorFlow models (the rule set of
the PyTorch backend's forward Laplacian, on TensorFlow's graph): the outputs, their
Jacobians and their Laplacians over the unknowns in one pass, ``k + 2`` matrix products a
dense layer where the trace of the Hessian (nested ``batch_jacobian`` tapes) costs ``2k + 2``.

The model is traced once into a graph (a ``ConcreteFunction`` of the kernel's block shape);
its operations are then re-created, in order, inside the kernel's own traced function, each
value that depends on the unknowns carried with its derivatives along the ``k`` unit tangents,
``(k, *x.shape)`` (or ``(k, 1, ...)`` while they are the same for every row: the unknowns'
own and the first dense layer's), and the sum of its second derivatives along them. The
rules: matrix products and elementwise products with one varying argument, sums, bias
additions and the shape operations (affine in what varies: the tangent is the
operation of the tangents, constants as zeros), and the elementwise functions met most (tanh,
sin, cos, exp, sigmoid, log, relu, softplus, square). An operation without a rule raises
:class:`NotImplementedError`, and the kernel keeps its other builds; so does an operation
this TensorFlow cannot re-create, or whose type the tables do not know (:mod:`.compat`).

:func:`run_hessian` walks the same rules carrying, instead of the one summed term, the second
derivatives along every pair of unit tangents ``a <= b``, ``(k(k+1)/2, *x.shape)`` (as
the JAX backend's forward Hessian does: ``sum_k j_k^2`` read as ``j_a j_b`` per pair, the product rule's
cross term as ``ja_a jb_b + ja_b jb_a``, a linear operation applied to each pair's term).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from . import compat

#: the op-type tables (:mod:`.compat`): an operation of a type in none of them, and without a
#: rule of its own below, has no rule (``NotImplementedError``: the kernel's other builds)
_AFFINE, _MULTILINEAR, _RESHAPES, _SKIP = compat.AFFINE, compat.MULTILINEAR, compat.RESHAPES, compat.SKIP


def _unary(kind: str, x: tf.Tensor, y: tf.Tensor) -> tuple[Any, Any] | None:
    """``(g'(x), g''(x))`` of the elementwise functions met most, from ``y = g(x)``."""
    if kind == "Tanh":
        d1 = 1 - y * y
        return d1, -2 * y * d1
    if kind == "Sin":
        return tf.cos(x), -y
    if kind == "Cos":
        return -tf.sin(x), -y
    if kind == "Exp":
        return y, y
    if kind == "Sigmoid":
        d1 = y * (1 - y)
        return d1, d1 * (1 - 2 * y)
    if kind == "Log":
        r = 1 / x
        return r, -r * r
    if kind == "Relu":
        return tf.cast(x > 0, x.dtype), None
    if kind == "Softplus":
        s = tf.sigmoid(x)
        return s, s * (1 - s)
    if kind == "Square":
        return 2 * x, 2 * tf.ones_like(x)
    return None


class _Form:
    """What the second-order part of a value holds: the Laplacian's one summed term, shaped as
    the value (``full`` False), or the second derivatives along each pair of unit tangents
    ``a <= b``, ``(T, *shape)``, ``T = k(k+1)/2`` (``full``: the Hessian's upper triangle, in
    :func:`numpy.triu_indices` order)."""

    def __init__(self, k: int, full: bool) -> None:
        self.k, self.full = k, full
        self.a, self.b = np.triu_indices(k)

    def outer(self, ja: tf.Tensor, jb: tf.Tensor) -> tf.Tensor:
        """``sum_k ja_k jb_k``, or ``ja_a jb_b`` per pair: the term of ``g''``."""
        if not self.full:
            return tf.reduce_sum(ja * jb, 0)
        return tf.gather(ja, self.a) * tf.gather(jb, self.b)

    def cross(self, ja: tf.Tensor, jb: tf.Tensor) -> tf.Tensor:
        """The product rule's cross term: ``2 sum_k ja_k jb_k``, or ``ja_a jb_b + ja_b jb_a``."""
        if not self.full:
            return 2 * tf.reduce_sum(ja * jb, 0)
        return (tf.gather(ja, self.a) * tf.gather(jb, self.b)
                + tf.gather(ja, self.b) * tf.gather(jb, self.a))

    def zeros(self, p: tf.Tensor) -> tf.Tensor:
        return tf.zeros((len(self.a), *p.shape), p.dtype) if self.full else tf.zeros_like(p)

    def fit(self, lap: tf.Tensor, shape: Any) -> tf.Tensor:
        """A second-order part made to broadcast, row for row, against values of ``shape``."""
        if self.full:
            return lap if _broadcasts(lap, shape) else _full(lap, shape)
        return lap if lap.shape == shape else tf.broadcast_to(lap, shape)


def _rebuild(op: tf.Operation, inputs: list[tf.Tensor]) -> list[tf.Tensor]:
    """``op`` created again in the current graph on ``inputs`` (its attributes as they were)."""
    return compat.rebuild_op(op, inputs)


def run(concrete: Any, u: tf.Tensor, ctx: tuple[tf.Tensor, ...]
        ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(y, J, L)`` of the model ``concrete`` (a ConcreteFunction of ``(u, *ctx)``) inside
    the caller's traced function: ``J`` ``(k, *y.shape)`` along the unit tangents of ``u``
    (``(rows, k)``), ``L`` the sum of the second derivatives along them."""
    return _push(concrete, u, ctx, _Form(int(u.shape[1]), full=False))


def run_hessian(concrete: Any, u: tf.Tensor, ctx: tuple[tf.Tensor, ...]
                ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(y, J, H)`` as :func:`run`, with ``H`` ``(k, k, *y.shape)`` the Hessian over ``u``
    (symmetric: its upper triangle computed, the lower one gathered from it)."""
    k = int(u.shape[1])
    form = _Form(k, full=True)
    y, jac, tri = _push(concrete, u, ctx, form)
    index = np.zeros((k, k), dtype=np.int32)
    index[form.a, form.b] = np.arange(len(form.a))
    index[form.b, form.a] = np.arange(len(form.a))
    return y, jac, tf.reshape(tf.gather(tri, index.reshape(-1)), (k, k, *tri.shape[1:]))


def _push(concrete: Any, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], form: _Form
          ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    graph = concrete.graph
    k = int(u.shape[1])
    # the unit tangents are the same for every row: kept as one row (k, 1, k), which matrix
    # products, bias additions and elementwise functions broadcast (the first dense layer's
    # tangents are its kernel's rows, not k x rows x width values), made full where a rule
    # needs the rows (:func:`_full`)
    seed = tf.eye(k, dtype=u.dtype)[:, None, :]
    values: dict[Any, Any] = {}  # graph tensor -> tensor, or (tensor, J, L or None)
    args = graph.inputs[:len(graph.inputs) - len(concrete.captured_inputs)]
    for t, v in zip(args, [u, *ctx]):
        values[t.ref()] = (v, seed, None) if v is u else v
    for inner, outer in zip(graph.inputs[len(args):], concrete.captured_inputs):
        values[inner.ref()] = outer
    placeholders = {t.ref() for t in graph.inputs}
    for op in graph.get_operations():
        kind = compat.op_type(op)
        if kind in _SKIP or (kind == "Placeholder" and op.outputs[0].ref() in placeholders):
            continue
        outs = _apply(op, [values[t.ref()] for t in op.inputs], k, form)
        for t, v in zip(op.outputs, outs):
            values[t.ref()] = v
    (out,) = [values[t.ref()] for t in graph.outputs]
    if not isinstance(out, tuple):
        return out, tf.zeros((k, *out.shape), out.dtype), form.zeros(out)
    y, jac, lap = out
    if lap is None:
        return y, _full(jac, y.shape), form.zeros(y)
    return y, _full(jac, y.shape), _full(lap, y.shape) if form.full else form.fit(lap, y.shape)


def _full(jac: tf.Tensor, shape: Any) -> tf.Tensor:
    """Tangents ``(k, *s)`` broadcast to ``(k, *shape)`` where they are not that already."""
    if tuple(jac.shape[1:]) == tuple(shape):
        return jac
    return tf.broadcast_to(jac, (int(jac.shape[0]), *shape))


def _broadcasts(jac: tf.Tensor, shape: Any) -> bool:
    """Whether tangents ``(k, *s)`` broadcast, row for row, against values of ``shape``."""
    s = tuple(jac.shape[1:])
    return len(s) == len(shape) and all(a in (1, b) for a, b in zip(s, shape))


def _plus(a: tf.Tensor | None, b: tf.Tensor | None) -> tf.Tensor | None:
    return b if a is None else a if b is None else a + b


def _apply(op: tf.Operation, ins: list[Any], k: int, form: _Form) -> list[Any]:
    vary = [i for i, a in enumerate(ins) if isinstance(a, tuple)]
    primals = [a[0] if isinstance(a, tuple) else a for a in ins]
    if not vary:
        return _rebuild(op, primals)
    kind = compat.op_type(op)
    if kind == "MatMul" and vary == [0] and not op.get_attr("transpose_a"):
        (y,) = _rebuild(op, primals)
        _, jac, lap = ins[0]
        w, tb = primals[1], op.get_attr("transpose_b")
        def times_w(t: tf.Tensor) -> tf.Tensor:  # (lead, ..., in) -> (lead, ..., out)
            prod = tf.linalg.matmul(tf.reshape(t, (-1, t.shape[-1])), w, transpose_b=tb)
            return tf.reshape(prod, (t.shape[0], *t.shape[1:-1], y.shape[-1]))

        if lap is not None:
            lap = times_w(lap) if form.full else tf.linalg.matmul(lap, w, transpose_b=tb)
        return [(y, times_w(jac), lap)]
    if kind in ("BiasAdd", "AddV2", "Add", "Sub") and len(ins) == 2:
        if kind == "BiasAdd" and 1 in vary:
            raise NotImplementedError("no forward-Laplacian rule for a varying bias")
        (y,) = _rebuild(op, primals)
        jac = lap = None
        for i in vary:
            _, j, lp = ins[i]
            if kind == "Sub" and i == 1:
                j, lp = -j, None if lp is None else -lp
            if not _broadcasts(j, y.shape):
                j = _full(j, y.shape)
            if lp is not None:
                lp = form.fit(lp, y.shape)
            jac, lap = _plus(jac, j), _plus(lap, lp)
        return [(y, jac, lap)]
    if len(ins) == 1:
        (y,) = _rebuild(op, primals)
        derivs = _unary(kind, primals[0], y)
        if derivs is not None:
            _, jac, lap = ins[0]
            d1, d2 = derivs
            new_lap = None if lap is None else lap * d1
            if d2 is not None:
                new_lap = _plus(new_lap, d2 * form.outer(jac, jac))
            return [(y, jac * d1, new_lap)]
    if kind in _RESHAPES and vary == [0]:
        found = _reshaped(op, primals, ins[0], form)
        if found is not None:
            return found
    # the rules below need each value's tangents at its full shape
    ins = [(a[0], _full(a[1], a[0].shape),
            _full(a[2], a[0].shape) if form.full and a[2] is not None else a[2])
           if isinstance(a, tuple) else a for a in ins]
    if kind == "Mul" and vary == [0, 1]:
        (a, ja, la), (b, jb, lb) = ins
        (y,) = _rebuild(op, primals)
        lap = _plus(_plus(None if lb is None else a * lb, None if la is None else b * la),
                    form.cross(ja, jb))
        return [(y, a * jb + b * ja, lap)]
    linear = kind in _AFFINE or (kind in _MULTILINEAR and len(vary) == 1 and
                                 (kind != "RealDiv" or vary == [0]))
    if not linear:
        raise NotImplementedError(f"no forward-Laplacian rule for the operation {kind}")
    outs = _rebuild(op, primals)
    zeros = [i for i, a in enumerate(primals) if i not in vary and a.dtype.is_floating
             and kind in _AFFINE]

    def tangent(ts: Any) -> Any:
        args = list(primals)
        for i, t in zip(vary, ts):
            args[i] = t
        for i in zeros:
            args[i] = tf.zeros_like(primals[i])
        return tuple(_rebuild(op, args))

    jacs = tf.vectorized_map(tangent, tuple(ins[i][1] for i in vary))
    laps: Any = [None] * len(outs)
    if any(ins[i][2] is not None for i in vary):
        parts = tuple(ins[i][2] if ins[i][2] is not None else form.zeros(primals[i])
                      for i in vary)
        laps = tf.vectorized_map(tangent, parts) if form.full else tangent(parts)
    return [(y, j, lp) if y.dtype.is_floating else y for y, j, lp in zip(outs, jacs, laps)]


def _reshaped(op: tf.Operation, primals: list[tf.Tensor], varying: tuple[Any, Any, Any],
              form: _Form) -> list[Any] | None:
    """An operation that only moves or relabels its first input's elements (:data:`_RESHAPES`):
    the tangents and second-order terms moved alike, as one reshape (or cast) each with their
    leading axis kept, instead of the generic rule's ``vectorized_map`` over them (whose
    trace was a large part of a small Keras model's: docs/thresholds.md). None where
    the shapes are not all known (the generic rule then)."""
    x, jac, lap = varying
    kind = compat.op_type(op)
    if kind not in ("Identity", "EnsureShape") and not (
            x.shape.is_fully_defined() and op.outputs[0].shape.is_fully_defined()):
        return None  # (before the op is made again: the generic rule makes it)
    (y,) = _rebuild(op, primals)
    if kind in ("Identity", "EnsureShape"):
        return [(y, jac, lap)]
    if kind != "Cast" and x.shape == y.shape:
        # (a Keras model's reshape of its input to its own shape: the unit tangents stay one
        # row, which the first matrix product broadcasts)
        return [(y, jac, lap)]
    if kind == "Cast":
        if not y.dtype.is_floating:
            return [y]
        return [(y, tf.cast(jac, y.dtype), None if lap is None else tf.cast(lap, y.dtype))]

    def moved(t: tf.Tensor) -> tf.Tensor:  # (lead, ...) broadcasting against x -> (lead, *y)
        return tf.reshape(_full(t, x.shape), (int(t.shape[0]), *y.shape))

    if lap is not None:
        lap = moved(lap) if form.full else tf.reshape(form.fit(lap, x.shape), y.shape)
    return [(y, moved(jac), lap)]


def traced_model(apply: Callable[..., tf.Tensor], specs: list[tf.TensorSpec]) -> Any:
    """The model's ConcreteFunction for inputs of ``specs`` (``u`` first)."""
    return tf.function(apply, autograph=False).get_concrete_function(*specs)
