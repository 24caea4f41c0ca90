"""A JAX model's linear head: its first operation on the unknowns, where that is a product with
values that are the same for every instance (a dense layer's ``x @ W``), read from the jaxpr
of one instance (:mod:`batchjac._backends.jax.chain`'s flattened equations).

Then ``z = x @ W`` and ``J = J_z A`` for every instance, ``A = dz/dx`` one ``w x k`` matrix
and ``J_z = dy/dz``: an analysis that needs ``J Sigma J^T`` for one shared ``Sigma`` forms
``A Sigma A^T`` once and ``J_z`` per instance, ``m x w`` where ``J`` is ``m x k``
(:class:`batchjac._backends._base.LinearHead`). Both come from the chain's piece machinery:
``A`` is the Jacobian of the piece from the unknowns to ``z``, ``J_z`` that of the piece from
``z`` to the output. Offered only where the unknowns are read by that one product and nothing
else, ``z`` is narrower than the unknowns, and the product's other operand depends on no
instance's inputs; otherwise None, never an error.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..._chain import Accumulation, Chain, Piece
from . import compat, cost as jax_cost
from .chain import ModelChain, _inexact, _Lit, _width, flatten, instance_jacobian

if TYPE_CHECKING:
    from . import JaxBound

#: the operations a head is: a product with weights (a dense layer, an einsum)
_PRODUCTS = ("dot_general",)
#: operations before it that move the unknowns' values without changing them
_MOVES = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
          "convert_element_type", "copy", "copy_p")


def read(closed: Any, x_index: int) -> ModelChain | None:
    """The chain ``unknowns -> z -> output`` of the function of one instance ``closed`` (a
    ClosedJaxpr, argument ``x_index`` the unknowns, the known inputs after it), ``z`` the
    result of its linear head; None where it has none (see the module's docstring)."""
    try:
        return _read(closed, x_index)
    except Exception:  # (a renamed parameter, several results: no head, the plain route)
        return None


def _read(closed: Any, x_index: int) -> ModelChain | None:
    flat = flatten(closed)
    x, out = flat.inputs[x_index], flat.output
    if isinstance(out, _Lit) or not _inexact(flat.avals[x]) or not _inexact(flat.avals[out]):
        return None
    # from the unknowns, through operations that only move their values (the batch axis a
    # batch function's instance gets), to the product: each value read by the next one only
    cur, place = x, -1
    while True:
        readers = [i for i, step in enumerate(flat.steps)
                   if any(not isinstance(a, _Lit) and a == cur for a in step.ins)]
        if len(readers) != 1 or cur == out or len(flat.steps[readers[0]].outs) != 1:
            return None
        place = readers[0]
        name = compat.primitive(flat.steps[place].eqn)
        if name in _PRODUCTS:
            break
        if name not in _MOVES:
            return None
        cur = flat.steps[place].outs[0]
    head = flat.steps[place]
    # the values of an instance: its unknowns, its known inputs, and what is computed from them
    varying = set(flat.inputs[x_index:])
    for step in flat.steps[:place]:
        if any(not isinstance(a, _Lit) and a in varying for a in step.ins):
            varying.update(step.outs)
    if any(not isinstance(a, _Lit) and a != cur and a in varying for a in head.ins):
        return None  # (a product of the unknowns with another instance's values: not linear)
    z = head.outs[0]
    k, w, m = _width(flat.avals[x]), _width(flat.avals[z]), _width(flat.avals[out])
    if w >= k or not _inexact(flat.avals[z]):
        return None
    dependent = {x}
    work = []
    for step in flat.steps:
        varies = any(not isinstance(a, _Lit) and a in dependent for a in step.ins)
        if varies:
            dependent.update(key for key in step.outs if _inexact(flat.avals[key]))
        work.append(jax_cost.equation(step.eqn).flops if varies else 0.0)
    end = len(flat.steps)
    chain = Chain((k, w, m), (float(sum(work[:place + 1])), float(sum(work[place + 1:]))),
                  ("the unknowns", f"the {w} values of the first product", "the outputs"))
    return ModelChain(flat, x, dependent, [0, place + 1, end], [[x], [z], [out]], chain)


def _piece(head: ModelChain, start: int, mode: str) -> Accumulation:
    """The one piece ``start -> start + 1`` of ``head``'s chain, differentiated in ``mode``."""
    piece = Piece(start, start + 1, head.chain.costs[start], mode=mode)  # type: ignore[arg-type]
    return Accumulation(head.chain, piece, {})


class JaxHead:
    """:class:`batchjac._backends._base.LinearHead` of a JAX model: ``A`` from one instance,
    ``J_z`` of a block of rows by one compiled function (``vmap`` of the piece's Jacobian)."""

    def __init__(self, bound: JaxBound, head: ModelChain) -> None:
        self.bound, self.head = bound, head
        _, w, m = head.chain.widths
        self.width = w
        # J_z: m backward passes through the rest of the model, or w tangents where fewer
        self._rest = _piece(head, 1, "reverse" if m <= w else "forward")
        self._first = _piece(head, 0, "forward")
        self._blocks: Any = None

    def matrix(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        """``A`` (``w x k``, float64), from the first row of ``(u, ctx)`` (any row: the head
        is linear in the unknowns)."""
        bound = self.bound
        weights = jax.tree_util.tree_leaves(bound.args)
        leaves = [*weights, u[0], *jax.tree_util.tree_leaves(tuple(c[0] for c in ctx))]
        _, a = instance_jacobian(self.head, self._first, leaves)
        return np.asarray(a, np.float64).reshape(self.width, -1)

    def jacobians(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        """``(y, J_z)`` of a block of rows: ``J_z`` is ``(rows, m, w)``."""
        bound = self.bound
        if self._blocks is None:
            head, rest = self.head, self._rest

            def block(args: Any, u: Any, ctx: tuple[Any, ...]) -> tuple[Any, Any]:
                bound.trace_count += 1
                weights = jax.tree_util.tree_leaves(args)

                def row(u_i: Any, c_i: tuple[Any, ...]) -> tuple[Any, Any]:
                    return instance_jacobian(head, rest,
                                             [*weights, u_i, *jax.tree_util.tree_leaves(c_i)])

                return jax.vmap(row)(u, ctx)

            self._blocks = jax.jit(block)
        try:
            y, jz = self._blocks(bound.args, u, tuple(ctx))
            y, jz = np.asarray(y), np.asarray(jz)
        except Exception as e:
            from ..._errors import BatchJacError

            if isinstance(e, BatchJacError):
                raise
            raise bound._explain(e) from e
        rows = u.shape[0]
        return y, jz.reshape(rows, math.prod(y.shape[1:]), self.width)
