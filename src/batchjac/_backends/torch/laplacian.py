"""A forward Laplacian for PyTorch models: the outputs, their Jacobians and their Laplacians
over the unknowns in one forward pass, with no ``k x k`` block per output and no second pass.

Each value ``x`` of the model's graph that depends on the unknowns is carried with ``J``, its
derivatives along the ``k`` unit tangents, and ``L``, the sum of its second derivatives along
them (:class:`Carried`). Through an operation ``z = g(x)``:

    J_z = g'(x) J        L_z = g'(x) L + sum_j g''(x)[J_j, J_j]

(Li et al., "A computational framework for neural network-based variational Monte Carlo with
Forward Laplacian", 2023; the rule set of ``folx`` and ``fwdlap`` for JAX). The model is
recorded once per input shape as the ATen operations its functionalised call runs (a
:class:`Tape`, by a dispatch mode: ``make_fx`` would import TorchDynamo; a model whose Python
branches on the values cannot be recorded, and the kernel then computes by its order as
before); each operation of the tape that depends on the unknowns is applied by
a rule: matrix products with a constant (the weights), sums with constants and the common
elementwise functions (tanh, sin, cos, exp, sigmoid, log, relu, silu) directly, ``J`` and ``L``
stacked into one ``(k + 1, ...)`` tensor; any other operation by ``torch.func``: ``vmap`` of
``jvp`` over that stack, and where it is not linear in what varies the second-order term from
``jvp`` of ``jvp`` along each ``J_j``. A dense layer then costs ``k + 2`` matrix products,
where forward over reverse (``vmap(jacfwd(jacrev))``, the Hessian then its trace) costs
``2k + 2`` and ``jvp`` of ``jvp`` along each ``e_j`` ``3k + 1``.

Measured side by side on the benchmark's PINN MLP, this build runs well under half the time
of the native trace of ``vmap(jacfwd(jacrev))``, where forward over reverse is about as fast
as that trace (docs/thresholds.md, "Measured choices").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import compat

#: ATen operations linear in every argument that carries a derivative (a constant argument,
#: such as a weight or a shape, may be anything): their second derivatives vanish
_LINEAR = {
    "t", "transpose", "permute", "view", "reshape", "_unsafe_view", "expand", "unsqueeze",
    "squeeze", "slice", "select", "cat", "stack", "sum", "mean", "neg", "clone", "alias",
    "_to_copy", "index_select", "narrow", "flatten", "constant_pad_nd", "split",
    "split_with_sizes", "unbind", "view_as", "expand_as", "repeat", "flip", "roll", "diagonal",
    "squeeze_copy", "unsqueeze_copy", "view_copy", "permute_copy", "t_copy", "transpose_copy",
    "expand_copy", "slice_copy", "select_copy", "lift_fresh_copy", "copy", "cumsum", "trace",
    "diag_embed", "tril", "triu", "gather", "index", "where", "select_scatter",
    "slice_scatter",
}
#: ATen operations linear in each argument: linear while only one argument varies
_MULTILINEAR = {"mul", "mm", "bmm", "matmul", "mv", "dot", "addmm", "baddbmm", "linear",
                "einsum", "convolution", "div", "addmv", "outer", "tensordot"}


def _unary(name: str, x: torch.Tensor, y: torch.Tensor
           ) -> tuple[torch.Tensor | float, torch.Tensor | float] | None:
    """``(g'(x), g''(x))`` of the elementwise functions met most, from the output ``y``
    where it gives them; None for the others (the generic rule then)."""
    if name == "tanh":
        d1 = 1 - y * y
        return d1, -2 * y * d1
    if name == "sin":
        return torch.cos(x), -y
    if name == "cos":
        return -torch.sin(x), -y
    if name == "exp":
        return y, y
    if name == "sigmoid":
        d1 = y * (1 - y)
        return d1, d1 * (1 - 2 * y)
    if name == "log":
        r = 1 / x
        return r, -r * r
    if name == "relu":
        return (x > 0).to(x.dtype), 0.0
    if name == "silu":
        s = torch.sigmoid(x)
        return s * (1 + x * (1 - s)), s * (1 - s) * (2 + x * (1 - 2 * s))
    return None


@dataclass
class Carried:
    """A value of the graph that depends on the unknowns and its derivatives: ``d[:k]`` along
    the ``k`` unit tangents (the Jacobian), ``d[k]`` the sum of the second derivatives along
    them (the Laplacian), ``d`` of shape ``(k + 1, *x.shape)``."""

    x: torch.Tensor
    d: torch.Tensor


def _name(target: Any) -> str | None:
    """The ATen name the tables above use (:func:`.compat.aten_name`): "" where it cannot be
    read (the general rule), None for an operation outside ATen (no rule: see :func:`_apply`)."""
    return compat.aten_name(target)


def _tree() -> Any:
    """torch's pytree functions (:func:`.compat.pytree`). Where this torch has none batchjac
    can use, the tape cannot be made or run: the kernel then computes by its order."""
    tree = compat.pytree()
    if tree is None:
        raise NotImplementedError(f"torch {torch.__version__} has no torch.utils._pytree "
                                  f"batchjac can use: no forward Laplacian")
    return tree


@dataclass(frozen=True)
class _Ref:
    """A value of the recorded call: ``slot`` the input (``slot < inputs``) or the operation
    (``slot - inputs``) that made it, ``item`` the output of an operation that makes several."""

    slot: int
    item: int | None = None


@dataclass
class Tape:
    """One call of a model as the ATen operations it ran, in order, for inputs of one set of
    shapes: each ``(operation, args, kwargs)`` with the values of the call as :class:`_Ref`
    (the constants, such as the weights, as they are); ``free[i]`` the slots whose last use is
    operation ``i`` (released after it); ``output`` the call's result, a :class:`_Ref` or a
    constant; ``widest`` the bytes of the largest value an operation made from the inputs."""

    inputs: int
    ops: list[tuple[Any, Any, Any]]
    free: list[list[int]]
    output: Any
    widest: int = 0


class _Recorder:
    """Records the ATen operations of a call under ``functionalize`` (no in-place operation
    reaches it) as they run, as a torch dispatch mode (:func:`.compat.dispatch_mode`, which
    keeps TorchDynamo out of its handler). ``make_fx`` does the same, but imports TorchDynamo
    and Inductor to read one setting."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.pytree = _tree()
        self.where: dict[int, _Ref] = {}
        self.alive: list[torch.Tensor] = []  # every value named: no id is reused meanwhile
        self.ops: list[tuple[Any, Any, Any]] = []
        self.widest = 0
        self.inputs = len(inputs)
        for i, t in enumerate(inputs):
            self._name(t, _Ref(i))

    def _name(self, t: torch.Tensor, ref: _Ref) -> None:
        self.where[id(t)] = ref
        self.alive.append(t)

    def ref(self, a: Any) -> Any:
        return self.where.get(id(a), a) if isinstance(a, torch.Tensor) else a

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        pytree = self.pytree
        recorded = pytree.tree_map(self.ref, (args, kwargs))
        slot = self.inputs + len(self.ops)
        tensors = isinstance(out, torch.Tensor) or (
            isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out))
        if not tensors and any(isinstance(a, _Ref) for a in pytree.tree_leaves(recorded)):
            # a Python value computed from the inputs (.item(), a branch on a value): a
            # recording would hold it as a constant, right for these inputs only
            raise NotImplementedError(f"{func} returns a Python value computed from the "
                                      "inputs: the model branches on values")
        self.ops.append((func, *recorded))
        if any(isinstance(a, _Ref) for a in pytree.tree_leaves(recorded)):
            for o in (out,) if isinstance(out, torch.Tensor) else out if tensors else ():
                self.widest = max(self.widest, o.numel() * o.element_size())
        if isinstance(out, torch.Tensor):
            self._name(out, _Ref(slot))
        elif tensors:
            for j, o in enumerate(out):
                self._name(o, _Ref(slot, j))
        return out


def trace(fn: Callable[..., torch.Tensor], *example: torch.Tensor) -> Tape:
    """``fn`` as the ATen operations it runs, for inputs of the shapes of ``example`` (runs
    ``fn`` once on them); the operations its output does not depend on dropped."""
    pytree, mode = _tree(), compat.dispatch_mode(_Recorder)
    if mode is None:
        raise NotImplementedError(f"torch {torch.__version__} has no dispatch mode batchjac "
                                  f"can use: no forward Laplacian")
    recorder = mode(example)
    with recorder:
        out = torch.func.functionalize(fn)(*example)
    output = pytree.tree_map(recorder.ref, out)
    del recorder.alive[:]  # (the ids are no longer looked up)
    n, ops = recorder.inputs, recorder.ops
    live = {r.slot for r in pytree.tree_leaves(output) if isinstance(r, _Ref)}
    kept: list[int] = []
    for i in range(len(ops) - 1, -1, -1):  # backwards: an operation is kept where used
        if n + i in live:
            kept.append(i)
            live.update(r.slot for r in pytree.tree_leaves(ops[i][1:]) if isinstance(r, _Ref))
    kept.reverse()
    renumber = {j: j for j in range(n)} | {n + i: n + new for new, i in enumerate(kept)}

    def moved(a: Any) -> Any:
        return _Ref(renumber[a.slot], a.item) if isinstance(a, _Ref) else a

    new_ops = [(ops[i][0], *pytree.tree_map(moved, ops[i][1:])) for i in kept]
    output = pytree.tree_map(moved, output)
    last: dict[int, int] = {}
    for i, op in enumerate(new_ops):
        for r in pytree.tree_leaves(op[1:]):
            if isinstance(r, _Ref):
                last[r.slot] = i
    ends = {r.slot for r in pytree.tree_leaves(output) if isinstance(r, _Ref)}
    free: list[list[int]] = [[] for _ in new_ops]
    for s, i in last.items():
        if s not in ends and s >= n:  # (the inputs are the caller's)
            free[i].append(s)
    return Tape(n, new_ops, free, output, recorder.widest)


def same_ops(a: Tape, b: Tape) -> bool:
    """Whether two tapes run the same operations on the same values: each argument the same
    reference, the same constant tensor (the very object: a weight), or an equal Python value.
    Two tapes of one model traced on different row counts are the same where no operation
    depends on the row count (no size, no fresh constant): one tape then serves every count."""
    pytree = _tree()

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return x is y
        return type(x) is type(y) and bool(x == y)

    if (a.inputs, a.free, a.output) != (b.inputs, b.free, b.output) or len(a.ops) != len(b.ops):
        return False
    for op_a, op_b in zip(a.ops, b.ops):
        if op_a[0] is not op_b[0]:
            return False
        leaves_a, spec_a = pytree.tree_flatten(op_a[1:])
        leaves_b, spec_b = pytree.tree_flatten(op_b[1:])
        if spec_a != spec_b or not all(same(x, y) for x, y in zip(leaves_a, leaves_b)):
            return False
    return True


def run(tape: Tape, inputs: list[torch.Tensor], varying: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, J, L)`` of the tape's one output for ``inputs``: ``J`` ``(k, *y.shape)``, the
    derivatives along the unit tangents of ``inputs[varying]`` (``(rows, *unknown_shape)``,
    ``k`` unknowns a row), and ``L`` the sum of the second derivatives along them."""
    pytree = _tree()
    u = inputs[varying]
    rows, ushape = u.shape[0], tuple(u.shape[1:])
    k = math.prod(ushape)
    seed = torch.zeros((k + 1, rows, k), dtype=u.dtype, device=u.device)
    seed[torch.arange(k), :, torch.arange(k)] = 1
    env: list[Any] = [*inputs, *([None] * len(tape.ops))]
    env[varying] = Carried(u, seed.reshape(k + 1, rows, *ushape))

    def get(r: _Ref) -> Any:
        value = env[r.slot]
        return value if r.item is None else value[r.item]

    n = tape.inputs
    for i, (target, args, kwargs) in enumerate(tape.ops):
        a, kw = pytree.tree_map_only(_Ref, get, (args, kwargs))
        env[n + i] = _apply(target, a, kw, k)
        for s in tape.free[i]:
            env[s] = None
    out = pytree.tree_map_only(_Ref, get, tape.output)
    (result,) = pytree.tree_leaves(out, is_leaf=lambda a: isinstance(a, Carried))
    if not isinstance(result, Carried):  # the output does not depend on the unknowns
        zeros = torch.zeros((k, *result.shape), dtype=result.dtype, device=result.device)
        return result, zeros, torch.zeros_like(result)
    return result.x, result.d[:k], result.d[k]


def _apply(target: Any, args: Any, kwargs: Any, k: int) -> Any:
    pytree = _tree()
    leaves, spec = pytree.tree_flatten((args, kwargs))
    vary = [i for i, a in enumerate(leaves) if isinstance(a, Carried)]
    if not vary:
        return target(*args, **kwargs)
    primals = [a.x if isinstance(a, Carried) else a for a in leaves]
    carried: list[Carried] = [leaves[i] for i in vary]
    name = _name(target)
    if name is None:  # (a custom op: torch's forward mode may drop its tangents, silently)
        raise NotImplementedError(f"{target} is not an ATen operation: the forward Laplacian "
                                  f"has no rule for it")
    if len(vary) == 1:
        fast = _fast_one(name, target, primals, vary[0], carried[0], leaves, spec)
        if fast is not None:
            return fast
    elif name == "mul" and len(vary) == 2 and len(leaves) == 2:
        a, b = carried
        y = a.x * b.x
        d = a.x * b.d + b.x * a.d
        d[k] += 2 * (a.d[:k] * b.d[:k]).sum(0)
        return Carried(y, d)

    def g(*xs: torch.Tensor) -> Any:
        vals = list(primals)
        for i, x in zip(vary, xs):
            vals[i] = x
        a, kw = pytree.tree_unflatten(vals, spec)
        return target(*a, **kw)

    from .state import _load_forward_ad

    _load_forward_ad()  # (torch.func's forward mode: its decompositions, once)
    p = tuple(c.x for c in carried)

    def push(*t: torch.Tensor) -> tuple[Any, Any]:
        y, d = torch.func.jvp(g, p, t)[:2]
        return y, d

    both: Any = torch.func.vmap(push, out_dims=(None, 0))  # type: ignore[arg-type]
    y, d = both(*(c.d for c in carried))
    linear = name in _LINEAR or (name in _MULTILINEAR and len(vary) == 1 and
                                 (name != "div" or vary == [0]))
    ys, ds = pytree.tree_flatten(y)[0], pytree.tree_flatten(d)[0]
    if not linear:
        def second(*t: torch.Tensor) -> Any:
            return torch.func.jvp(lambda *q: torch.func.jvp(g, q, t)[1], p, t)[1]

        d2 = pytree.tree_flatten(torch.func.vmap(second)(*(c.d[:k] for c in carried)))[0]
        for i, di in enumerate(ds):
            if isinstance(di, torch.Tensor) and di.is_floating_point():
                di[k] += d2[i].sum(0)
    results = [Carried(yi, di) if isinstance(yi, torch.Tensor) and yi.is_floating_point()
               else yi for yi, di in zip(ys, ds)]
    return pytree.tree_unflatten(results, pytree.tree_structure(y))


def _fast_one(name: str, target: Any, primals: list[Any], at: int, c: Carried,
              leaves: list[Any], spec: Any) -> Carried | None:
    """The rules of the operations most models spend their time in, one argument varying:
    matrix products with the weights, sums with constants, elementwise functions."""
    pytree = _tree()
    k1 = c.d.shape[0]
    if name in ("mm", "addmm") and at == len(leaves) - 2 and not spec_has_kwargs(spec):
        # mm(x, W) / addmm(b, x, W): the tangents are x's, times W, in one product
        w = primals[at + 1]
        y = target(*pytree.tree_unflatten(primals, spec)[0])
        d = (c.d.reshape(-1, c.d.shape[-1]) @ w).reshape(k1, *y.shape)
        return Carried(y, d)
    if name in ("add", "sub") and not spec_has_kwargs(spec) and len(leaves) == 2:
        y = target(*primals)
        sign = -1 if (name == "sub" and at == 1) else 1
        d = c.d if sign == 1 else -c.d
        if d.shape[1:] != y.shape:
            d = d.expand(k1, *y.shape)
        return Carried(y, d)
    if len(leaves) == 1:
        y = target(c.x)
        derivs = _unary(name, c.x, y)
        if derivs is not None:
            d1, d2 = derivs
            if torch.is_grad_enabled() and c.d.requires_grad:
                # (in autograd's graph, a differentiable call's: one node with its own
                # backward, where the in-place sums below would each copy the whole carried
                # value backwards and the same rule in separate operations fills and copies
                # it for each slice)
                if isinstance(d2, float) and d2 == 0.0:
                    return Carried(y, c.d * d1)
                if isinstance(d1, torch.Tensor) and isinstance(d2, torch.Tensor):
                    return Carried(y, _Elementwise.apply(c.d, d1, d2)[0])
                d = c.d * d1
                lap = d[-1] + d2 * c.d[:-1].square().sum(0)
                return Carried(y, torch.cat([d[:-1], lap[None]]))
            d = c.d * d1
            if not (isinstance(d2, float) and d2 == 0.0):
                # sum_j J_j^2 one tangent at a time (no (k, ...) temporary), then d2 times it
                squares = c.d[0] * c.d[0]
                for j in range(1, k1 - 1):
                    squares.addcmul_(c.d[j], c.d[j])
                d[-1].addcmul_(squares, d2 if isinstance(d2, torch.Tensor) else
                               torch.as_tensor(d2, dtype=squares.dtype))
            return Carried(y, d)
    return None


class _Elementwise(torch.autograd.Function):
    """The rule of an elementwise ``g`` in autograd's graph as one node: for the carried
    ``D`` (``(k + 1, ...)``) and ``g'``, ``g''`` at the value, ``D' = g' D`` and
    ``D'[k] += g'' sum_{j<k} D[j]^2``. Its backward and forward derivatives are written with
    differentiable operations (a loss's Hessian, or a transform over the call, goes through
    them), and torch.func transforms it by its ``vmap`` rule generated from ``forward``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(d: torch.Tensor, d1: torch.Tensor, d2: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        k = d.shape[0] - 1
        squares = _squares(d, k)
        out = d * d1
        out[k] += d2 * squares  # (not addcmul_, which vmap runs row by row)
        return out, squares

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(*inputs, output[1])
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _: Any) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        d, d1, d2, squares = ctx.saved_tensors
        k = d.shape[0] - 1
        if torch.is_grad_enabled():  # (a graph of the backward: the sum from d, not a copy)
            squares = d[:k].square().sum(0)
        gk = g[k]
        gd = g * d1
        gd[:k] += (2 * gk * d2) * d[:k]
        g1 = g[0] * d[0]
        for j in range(1, k + 1):
            g1 = g1 + g[j] * d[j] if torch.is_grad_enabled() else g1.add_(g[j] * d[j])
        return gd, _unbroadcast(g1, d1.shape), _unbroadcast(gk * squares, d2.shape)

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        d, d1, d2 = ctx.saved_tensors
        k = d.shape[0] - 1
        out = t * d1 + d * t1
        out[k] += t2 * d[:k].square().sum(0) + 2 * d2 * (d[:k] * t[:k]).sum(0)
        return out, None  # type: ignore[return-value]


def _squares(d: torch.Tensor, k: int) -> torch.Tensor:
    """``sum_{j<k} d[j]^2``, one tangent at a time (no ``(k, ...)`` temporary)."""
    if not k:
        return torch.zeros_like(d[0])
    squares = d[0] * d[0]
    for j in range(1, k):
        squares += d[j] * d[j]
    return squares


def _unbroadcast(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``g`` summed back to the ``shape`` it was broadcast from."""
    if g.shape == shape:
        return g
    lead = g.dim() - len(shape)
    dims = [*range(lead), *(lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)]
    return g.sum(dims, keepdim=True).reshape(shape)


def spec_has_kwargs(spec: Any) -> bool:
    """Whether the call had keyword arguments (``alpha=``, ``beta=``: the general rule)."""
    pytree = _tree()
    kw = pytree.tree_unflatten([None] * spec.num_leaves, spec)[1]
    return bool(kw)
