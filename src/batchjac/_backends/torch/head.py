"""A PyTorch model's linear head: its first operation on the unknowns, where that is a product
with weights (a ``Linear`` layer's ``addmm``, a ``matmul`` with a parameter), read from the
recording of one row that mixed mode reads (:mod:`batchjac._backends.torch.chain`), or, for a
``Sequential`` that starts with a ``Linear``, from its modules (:class:`SequentialHead`).

Then ``z = x W^T + b`` and ``J = J_z A`` for every instance, ``A = dz/dx`` one ``w x k``
matrix (:class:`batchjac._backends._base.LinearHead`; :mod:`batchjac._backends.jax.head` reads
a jaxpr the same way). ``A`` is the Jacobian of the piece from the unknowns to ``z`` and
``J_z`` that of the piece from ``z`` to the output, by the chain's piece machinery, re-recorded
where the weights change. Offered only where the unknowns are read by that one product (after
operations that only move their values) and nothing else, ``z`` is narrower than the
unknowns, and the product's other operands are the recording's constants (no instance's
values); otherwise None, never an error.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..._chain import Accumulation, Chain, Piece
from . import compat
from .chain import Key, TorchChain, _get, _work, current, jacobians, recorded

if TYPE_CHECKING:
    from . import TorchBound
    from .laplacian import Tape

#: the ATen operations a head is: a product with weights
_PRODUCTS = ("mm", "addmm", "linear", "matmul", "mv", "addmv")
#: ATen operations before it that move the unknowns' values without changing them
_MOVES = ("view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "expand", "t", "transpose",
          "permute", "_to_copy", "clone", "alias", "contiguous")


def read(bound: TorchBound) -> TorchHead | SequentialHead | None:
    """The model's linear head, or None (see the module's docstring)."""
    if bound.output_shape is None:
        return None
    found = _sequential(bound)
    if found is not None:
        return found
    made = recorded(bound, _read)
    return None if made is None else TorchHead(bound, made)


def _read(tape: Tape, inputs: list[torch.Tensor]) -> Any:
    from .laplacian import _Ref, _tree

    pytree = _tree()
    n = tape.inputs
    values: dict[int, Any] = dict(enumerate(inputs))
    x_key: Key = (0, None)
    dependent: set[Key] = {x_key}
    varying: set[Key] = {(i, None) for i in range(len(inputs))}  # (an instance's values)
    shapes: dict[Key, tuple[int, ...]] = {(i, None): tuple(t.shape) for i, t in enumerate(inputs)}
    reads: list[list[Key]] = []
    work: list[float] = []
    for i, (target, args, kwargs) in enumerate(tape.ops):
        refs = [(r.slot, r.item) for r in pytree.tree_leaves((args, kwargs)) if isinstance(r, _Ref)]
        reads.append(refs)
        a, kw = pytree.tree_map_only(_Ref, lambda r: _get(values[r.slot], r.item), (args, kwargs))
        out = target(*a, **kw)
        values[n + i] = out
        outs: list[Key] = [(n + i, None)] if isinstance(out, torch.Tensor) else \
            [(n + i, j) for j, o in enumerate(out) if isinstance(o, torch.Tensor)]
        for key in outs:
            t = _get(out, key[1])
            shapes[key] = tuple(t.shape)
            if any(r in dependent for r in refs) and t.is_floating_point():
                dependent.add(key)
        if any(r in varying for r in refs):
            varying.update(outs)
        work.append(_work(target, a, out) if any(r in dependent for r in refs) else 0.0)
    output = tape.output
    if not isinstance(output, _Ref):
        return None
    out_key: Key = (output.slot, output.item)
    # from the unknowns, through operations that only move their values, to the product: each
    # value read by the next one only
    cur, place = x_key, -1
    while True:
        readers = [i for i, refs in enumerate(reads) if cur in refs]
        if cur == out_key or len(readers) != 1 or reads[readers[0]].count(cur) != 1:
            return None
        place = readers[0]
        if not isinstance(values[n + place], torch.Tensor):
            return None
        name = compat.aten_name(tape.ops[place][0])
        if name in _PRODUCTS:
            break
        if name not in _MOVES:
            return None
        cur = (n + place, None)
    if any(r != cur and r in varying for r in reads[place]):
        return None  # (a product with another instance's values: not the same for all)
    z: Key = (n + place, None)
    k, w, m = (math.prod(shapes[key]) for key in (x_key, z, out_key))
    if w >= k or not values[n + place].is_floating_point():
        return None
    end = len(tape.ops)
    chain = Chain((k, w, m), (float(sum(work[:place + 1])), float(sum(work[place + 1:]))),
                  ("the unknowns", f"the {w} values of the first product", "the outputs"))
    return [[x_key], [z], [out_key]], [0, place + 1, end], dependent, shapes, chain


class TorchHead:
    """:class:`batchjac._backends._base.LinearHead` of a PyTorch model: ``A`` from one row,
    ``J_z`` of a block of rows (``torch.func.vmap`` of the piece's ``jacrev``)."""

    def __init__(self, bound: TorchBound, tc: TorchChain) -> None:
        self.bound, self.tc = bound, tc
        self.width = tc.chain.widths[1]
        costs = tc.chain.costs
        self._first = Accumulation(tc.chain, Piece(0, 1, costs[0], mode="reverse"), {})
        self._rest = Accumulation(tc.chain, Piece(1, 2, costs[1], mode="reverse"), {})

    def matrix(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        """``A`` (``w x k``, float64), from the first row of ``(u, ctx)``."""
        _, a = self._run(self._first, u[:1], tuple(c[:1] for c in ctx))
        return np.asarray(a, np.float64).reshape(self.width, -1)

    def jacobians(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        """``(y, J_z)`` of a block of rows: ``J_z`` is ``(rows, m, w)``."""
        y, jz = self._run(self._rest, u, ctx)
        rows = u.shape[0]
        return y, jz.reshape(rows, math.prod(y.shape[1:]), self.width)

    def _run(self, plan: Accumulation, u: np.ndarray, ctx: tuple[np.ndarray, ...]
             ) -> tuple[np.ndarray, np.ndarray]:
        from .errors import _explain_model_failure

        bound = self.bound
        ut, ct = bound.tensors(u, ctx)
        try:
            tape = current(self.tc, bound)
            with bound.calling(), torch.no_grad():
                y, jac = jacobians(self.tc, plan, tape, ut, ct, raw=True)
        except Exception as e:
            from ..._errors import BatchJacError

            if isinstance(e, BatchJacError):
                raise
            raise _explain_model_failure(e, bound.signature) from e
        return y.detach().cpu().numpy(), jac.detach().cpu().numpy()


def _sequential(bound: TorchBound) -> SequentialHead | None:
    """A ``Sequential`` whose first module is a ``Linear`` reading the unknowns alone, its
    weights in the compute dtype (no substitution): its own layers are the two pieces."""
    model, sig = bound.model, bound.signature
    if type(model) is not torch.nn.Sequential or len(model) < 2 or sig.layout.kind != "single" \
            or len(sig.unknown_shape) != 1 or bound._state():
        return None
    first = model[0]
    k = int(sig.unknown_shape[0])
    if type(first) is not torch.nn.Linear or first.in_features != k or first.out_features >= k \
            or first.weight.dtype != bound.tensors(np.zeros((1, k), sig.dtype), ())[0].dtype:
        return None
    return SequentialHead(bound, first, model[1:])


class SequentialHead:
    """:class:`batchjac._backends._base.LinearHead` of a ``Sequential`` that starts with a
    ``Linear``: ``A`` its weight, ``J_z`` by plain autograd through the later modules, a
    backward pass per output (no recording, no torch.func)."""

    def __init__(self, bound: TorchBound, first: torch.nn.Linear, rest: torch.nn.Module) -> None:
        self.bound, self.first, self.rest = bound, first, rest
        self.width = int(first.out_features)

    def matrix(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        """``A``, the layer's weight now (``w x k``, float64)."""
        return self.first.weight.detach().cpu().double().numpy()

    def jacobians(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        """``(y, J_z)`` of a block of rows: ``J_z`` is ``(rows, m, w)`` (rows are independent,
        which the probes check: each output's gradient of the block's sum is its rows')."""
        from .errors import _explain_model_failure

        bound = self.bound
        ut, _ = bound.tensors(u, ctx)
        try:
            with bound.calling(), torch.enable_grad():
                z = self.first(ut).detach().requires_grad_(True)
                y = bound._check_output(self.rest(z))
                flat = y.reshape(y.shape[0], -1)
                m = flat.shape[1]
                rows = [torch.autograd.grad(flat[:, i].sum(), z, retain_graph=i < m - 1,
                                            allow_unused=True, materialize_grads=True)[0]
                        for i in range(m)]
        except Exception as e:
            from ..._errors import BatchJacError

            if isinstance(e, BatchJacError):
                raise
            raise _explain_model_failure(e, bound.signature) from e
        jz = torch.stack(rows, dim=1)
        return y.detach().cpu().numpy(), jz.detach().cpu().numpy()
