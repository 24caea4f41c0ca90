"""Mixed-mode accumulation in PyTorch: the chain of a model read from the ATen operations of
one instance, and its Jacobian accumulated along a bracketing of it (:mod:`batchjac._chain`).

The model is recorded once on one row (a :class:`~batchjac._backends.torch.laplacian.Tape`, the
forward Laplacian's recording: functionalised ATen operations, the weights as constants) and run
once more, eagerly, to read each value's shape and dtype. A *cut* is a place in the list of
operations: the floating values made before it, used at or after it, that depend on the unknowns
(:mod:`batchjac._backends.jax.chain` reads a jaxpr the same way). The Jacobian of one instance is
then accumulated by re-running the operations of each piece on the values of its first cut,
differentiated by ``torch.func.jacrev`` or ``jacfwd``, the products as the bracketing says; the
whole is ``torch.func.vmap``-ed over a chunk's rows, each row run as the recording's batch of one.

The recording holds the weights it saw: where their versions or identities change (an optimizer
step, a new ``state_dict``), it is made again, its chain unchanged. Where the model cannot be
recorded (it branches on values, calls a custom operation) or has no narrow cut, there is no
chain: the kernel computes in a pure mode.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..._chain import MAX_CUTS, MIN_BASIS, Accumulation, Chain, Piece, choose
from . import compat

if TYPE_CHECKING:
    from . import TorchBound
    from .laplacian import Tape

Key = tuple[int, "int | None"]

#: ATen operations counted as matrix products: their operands' shapes give the work
_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot",
             "convolution", "einsum"}


@dataclass
class TorchChain:
    """A model's chain read from its recording: ``tape`` the operations, ``keys[i]`` the values
    of cut ``i`` (the first: the unknowns; the last: the output), ``cuts[i]`` its place in the
    operations, ``dependent`` the values that depend on the unknowns, ``shapes`` each value's
    shape (one row), ``weights`` what the recording was made with (:func:`_weights`)."""

    tape: Tape
    keys: list[list[Key]]
    cuts: list[int]
    dependent: set[Key]
    shapes: dict[Key, tuple[int, ...]]
    chain: Chain
    weights: tuple[Any, ...]
    record: Callable[[], Tape]


def _weights(bound: TorchBound) -> tuple[Any, ...]:
    from .second import _weights as held

    return tuple((id(t), compat.version(t)) for t in held(bound))


def _sample(bound: TorchBound) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One row of the model's inputs: halves for the unknowns, ones for the known inputs."""
    sig = bound.signature
    u = np.full((1, *sig.unknown_shape), 0.5, sig.dtype)
    return bound.tensors(u, tuple(np.ones((1, *shape), dt) for shape, dt in sig.ctx))


def _get(value: Any, item: int | None) -> Any:
    return value if item is None else value[item]


def read(bound: TorchBound) -> tuple[TorchChain, Accumulation] | None:
    """The model's chain and its bracketing where mixed mode is offered; None where the model
    cannot be recorded, has a narrow basis (:data:`~batchjac._chain.MIN_BASIS`) or no cut pays."""

    sig = bound.signature
    if bound.output_shape is None or \
            min(math.prod(sig.unknown_shape), math.prod(bound.output_shape)) < MIN_BASIS:
        return None
    made = recorded(bound, _read)
    plan = None if made is None else choose(made.chain, bound.forward_bias)
    return None if made is None or plan is None else (made, plan)


def recorded(bound: TorchBound, reader: Callable[[Tape, Any], Any]) -> TorchChain | None:
    """The model's recording (:func:`recording`) read by ``reader`` (``(tape, inputs) ->
    (keys, cuts, dependent, shapes, chain)`` or None) into a chain; None where the model
    cannot be recorded, or ``reader`` finds no chain or cannot run an operation again."""
    made = recording(bound)
    if made is None:
        return None
    tape, inputs, weights, record = made
    try:
        found = reader(tape, inputs)
    except Exception:  # (an operation this reader cannot run again: none)
        return None
    if found is None:
        return None
    keys, cuts, dependent, shapes, chain = found
    return TorchChain(tape, keys, cuts, dependent, shapes, chain, weights, record)


def recording(bound: TorchBound) -> tuple[Tape, list[torch.Tensor], tuple[Any, ...],
                                         Callable[[], Tape]] | None:
    """The model recorded on one row (:func:`_sample`), made once per bound model for its
    readers (the chain, the linear head): the tape, the row's inputs, the weights it saw
    (:func:`_weights`) and how to record it again; None where it cannot be recorded (it
    branches on values, calls a custom operation)."""
    if "_recording" not in bound.__dict__:
        from . import laplacian

        u, ctx = _sample(bound)

        def record() -> Tape:
            with bound.calling(), torch.no_grad():
                return laplacian.trace(lambda a, *c: bound.apply(a, c), u, *ctx)

        try:
            weights = _weights(bound)
            bound.__dict__["_recording"] = (record(), [u, *ctx], weights, record)
        except Exception:
            bound.__dict__["_recording"] = None
    return bound.__dict__["_recording"]  # type: ignore[no-any-return]


def _read(tape: Tape, inputs: list[torch.Tensor]) -> Any:
    from .laplacian import _Ref, _tree

    pytree = _tree()
    n = tape.inputs
    values: dict[int, Any] = dict(enumerate(inputs))
    dependent: set[Key] = {(0, None)}
    shapes: dict[Key, tuple[int, ...]] = {(i, None): tuple(t.shape) for i, t in enumerate(inputs)}
    last: dict[Key, int] = {}
    work: list[float] = []
    made: list[list[Key]] = []
    for i, (target, args, kwargs) in enumerate(tape.ops):
        refs = [r for r in pytree.tree_leaves((args, kwargs)) if isinstance(r, _Ref)]
        reads = [(r.slot, r.item) for r in refs]
        for key in reads:
            last[key] = i
        a, kw = pytree.tree_map_only(_Ref, lambda r: _get(values[r.slot], r.item), (args, kwargs))
        out = target(*a, **kw)
        values[n + i] = out
        outs: list[Key] = [(n + i, None)] if isinstance(out, torch.Tensor) else \
            [(n + i, j) for j, o in enumerate(out) if isinstance(o, torch.Tensor)]
        varies = any(key in dependent for key in reads)
        for key in outs:
            t = _get(out, key[1])
            shapes[key] = tuple(t.shape)
            if varies and t.is_floating_point():
                dependent.add(key)
        made.append(outs)
        work.append(_work(target, a, out) if varies else 0.0)
    output = tape.output
    if not isinstance(output, _Ref):
        return None
    out_key: Key = (output.slot, output.item)
    end = len(tape.ops)
    last[out_key] = end
    x_key: Key = (0, None)
    k, m = math.prod(shapes[x_key]), math.prod(shapes.get(out_key, ()))
    dtype = inputs[0].dtype
    found: list[tuple[int, list[Key], int]] = []
    live: set[Key] = {x_key}
    for p in range(1, end):
        live.update(key for key in made[p - 1] if key in dependent)
        live = {key for key in live if last.get(key, -1) >= p}
        if not live or any(_get(values[s], j).dtype != dtype for s, j in live):
            continue
        width = sum(math.prod(shapes[key]) for key in live)
        if width < min(k, m):
            found.append((p, sorted(live, key=lambda kk: (kk[0], -1 if kk[1] is None else kk[1])),
                          width))
    if not found:
        return None
    runs: list[tuple[int, list[Key], int]] = []
    for place in found:
        if runs and runs[-1][2] == place[2] and runs[-1][0] == place[0] - 1:
            runs[-1] = place
        else:
            runs.append(place)
    runs = sorted(sorted(runs, key=lambda r: r[2])[:MAX_CUTS])
    cuts = [0, *(p for p, _, _ in runs), end]
    keys = [[x_key], *(ks for _, ks, _ in runs), [out_key]]
    widths = (k, *(w for _, _, w in runs), m)
    costs = tuple(float(sum(work[a:b])) for a, b in itertools.pairwise(cuts))
    names = {key: compat.aten_name(tape.ops[key[0] - n][0]) or "an operation"
             for _, ks, _ in runs for key in ks if key[0] >= n}
    labels = ("the unknowns",
              *(f"the {w} values after {'/'.join(sorted({names.get(key, 'input') for key in ks}))}"
                for _, ks, w in runs), "the outputs")
    return keys, cuts, dependent, shapes, Chain(widths, costs, labels)


def _work(target: Any, args: Any, out: Any) -> float:
    """An operation's work: ``2 * output size * contracted size`` for matrix products and
    convolutions, the output's size for the others."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    size = float(sum(o.numel() for o in outs if isinstance(o, torch.Tensor)))
    name = compat.aten_name(target)
    if name not in _PRODUCTS:
        return size
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name == "convolution" and len(tensors) >= 2:
        w = tensors[1]
        return 2.0 * size * w.numel() / max(1, w.shape[0])
    lhs = tensors[1] if name in ("addmm", "baddbmm", "addmv") and len(tensors) >= 2 else \
        tensors[0] if tensors else None
    inner = lhs.shape[-1] if lhs is not None and lhs.ndim else 1
    return 2.0 * size * inner


def current(tc: TorchChain, bound: TorchBound) -> Tape:
    """The recording, made again where the weights changed since (their versions or
    identities): the same operations on the new constants."""
    weights = _weights(bound)
    if weights != tc.weights or any(v is None for _, v in weights):
        tc.tape, tc.weights = tc.record(), weights
    return tc.tape


def jacobians(tc: TorchChain, plan: Accumulation, tape: Tape, u: torch.Tensor,
              ctx: tuple[torch.Tensor, ...], *, raw: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, J)`` of a chunk's rows: each row's Jacobian accumulated along ``plan`` by
    :func:`_instance`, ``vmap``-ed; ``raw``: as the plan's root piece gives it (its ends'
    flattened values, not the output's and the unknowns' shapes)."""
    y, jac = torch.func.vmap(lambda u_i, *c_i: _instance(tc, plan, tape, u_i, c_i, raw))(u, *ctx)
    return y, jac


def _instance(tc: TorchChain, plan: Accumulation, tape: Tape, u_i: torch.Tensor,
              c_i: tuple[torch.Tensor, ...], raw: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    from .laplacian import _Ref, _tree

    pytree = _tree()
    n = tape.inputs
    env: dict[int, Any] = {0: u_i[None], **{i + 1: c[None] for i, c in enumerate(c_i)}}

    def value(r: Any, local: dict[Key, Any]) -> Any:
        key = (r.slot, r.item)
        return local[key] if key in local else _get(env[r.slot], r.item)

    for i, (target, args, kwargs) in enumerate(tape.ops):  # the forward evaluation, once
        a, kw = pytree.tree_map_only(_Ref, lambda r: value(r, {}), (args, kwargs))
        env[n + i] = target(*a, **kw)

    def piece(p: Piece) -> torch.Tensor:
        if not p.leaf:
            assert p.left is not None
            assert p.right is not None
            return piece(p.right) @ piece(p.left)
        ins, outs = tc.keys[p.start], tc.keys[p.stop]
        sizes = [math.prod(tc.shapes[key]) for key in ins]
        ops = list(enumerate(tape.ops))[tc.cuts[p.start]:tc.cuts[p.stop]]

        def fn(z: torch.Tensor) -> torch.Tensor:
            local: dict[Key, Any] = {}
            for key, part in zip(ins, torch.split(z, sizes)):
                local[key] = part.reshape(tc.shapes[key])
            for i, (target, args, kwargs) in ops:
                refs = [r for r in pytree.tree_leaves((args, kwargs)) if isinstance(r, _Ref)]
                if not any((r.slot, r.item) in local for r in refs):
                    continue
                a, kw = pytree.tree_map_only(_Ref, lambda r: value(r, local), (args, kwargs))
                out = target(*a, **kw)
                made: list[Key] = [(n + i, None)] if isinstance(out, torch.Tensor) else \
                    [(n + i, j) for j in range(len(out))]
                for key in made:
                    if key in tc.dependent:
                        local[key] = _get(out, key[1])
            return torch.cat([value(_Ref(*key), local).reshape(-1) for key in outs])

        z0 = torch.cat([_get(env[key[0]], key[1]).reshape(-1) for key in ins])
        differentiate = torch.func.jacfwd if p.mode == "forward" else torch.func.jacrev
        return differentiate(fn)(z0)

    out_key = tc.keys[-1][0]
    y = _get(env[out_key[0]], out_key[1])[0]
    jac = piece(plan.root)
    return y, jac if raw else jac.reshape(*y.shape, *u_i.shape)
