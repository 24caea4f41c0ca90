"""Mixed-mode accumulation in JAX: the chain of a model read from its jaxpr, and the
Jacobian of one instance accumulated along a bracketing of it (:mod:`batchjac._chain`).

The model's function of one instance is traced once (``make_jaxpr``: no compilation), its
calls (``jit``-wrapped layers, as Flax and Equinox make them) inlined, so that the equations
form one list in the order they run. A *cut* is a place in that list: the floating values
computed before it, used at or after it, that depend on the unknowns (integer values, such as
an ``argmax``, carry no derivative: they are constants of the pieces). Where those are narrower
than both the unknowns and the outputs, the model can be differentiated through them
(:mod:`batchjac._chain`). Each piece between two cuts is a function of the flattened values of
its first cut, evaluated by re-binding the piece's equations (the equations that read nothing
the piece varies take their values from the one forward evaluation), and differentiated by
``jax.jacfwd`` or ``jax.jacrev``; the pieces' Jacobians are multiplied as the bracketing says.
The whole is one function of one instance, ``vmap``-ed over a chunk by the kernel
(:class:`batchjac._backends.jax.builds.JaxKernel`, its "mixed" build).

Where the jaxpr cannot be read (several outputs, a parameter a JAX release renamed), there is
no chain, never an error: the kernel computes in a pure mode.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._chain import MAX_CUTS, MIN_BASIS, Accumulation, Chain, Piece
from . import compat, cost as jax_cost

#: calls whose body is inlined into the list of equations: a plain function call (not a
#: custom derivative, whose rule is the point of the call, nor a rematerialisation)
_INLINED = ("pjit", "jit", "closed_call", "core_call")


@dataclass(frozen=True)
class _Lit:
    """An operand that is a literal: its value."""

    val: Any


@dataclass
class _Step:
    eqn: Any
    ins: list[Any]  # keys (int) or _Lit
    outs: list[int]


@dataclass
class Flat:
    """A function of one instance as one list of equations, its values named by integers:
    ``inputs`` the keys of its arguments (the model's parameters, the unknowns, the known
    inputs, flattened), ``output`` its one result, ``consts`` the values its closed jaxprs
    hold, ``avals`` each key's abstract value."""

    steps: list[_Step] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    output: Any = None
    consts: dict[int, Any] = field(default_factory=dict)
    avals: dict[int, Any] = field(default_factory=dict)

    def new(self, aval: Any) -> int:
        key = len(self.avals)
        self.avals[key] = aval
        return key


def _flatten(jaxpr: Any, consts: Sequence[Any], ins: list[Any], flat: Flat) -> list[Any]:
    """Append ``jaxpr``'s equations to ``flat``, its constants and arguments named by
    ``consts`` (values) and ``ins`` (keys or literals); returns the refs of its outputs."""
    names: dict[int, Any] = {}
    for v, c in zip(jaxpr.constvars, consts):
        key = flat.new(v.aval)
        flat.consts[key] = c
        names[id(v)] = key
    for v, given in zip(jaxpr.invars, ins):
        names[id(v)] = given

    def ref(v: Any) -> Any:
        return _Lit(v.val) if compat.is_literal(v) else names[id(v)]

    for eqn in jaxpr.eqns:
        args = [ref(v) for v in eqn.invars]
        name = compat.primitive(eqn)
        if name in _INLINED:
            sub = compat.param(eqn, compat.CALLS[name])
            outs = _flatten(getattr(sub, "jaxpr", sub), getattr(sub, "consts", ()), args, flat)
            for v, out in zip(eqn.outvars, outs):
                names[id(v)] = out
            continue
        keys = [flat.new(v.aval) for v in eqn.outvars]
        for v, key in zip(eqn.outvars, keys):
            names[id(v)] = key
        flat.steps.append(_Step(eqn, args, keys))
    return [ref(v) for v in jaxpr.outvars]


def flatten(closed: Any) -> Flat:
    """A closed jaxpr of one result as a :class:`Flat` list of equations."""
    flat = Flat()
    jaxpr = closed.jaxpr
    flat.inputs = [flat.new(v.aval) for v in jaxpr.invars]
    outs = _flatten(jaxpr, closed.consts, list(flat.inputs), flat)
    if len(outs) != 1:
        raise ValueError(f"a function of {len(outs)} results")
    flat.output = outs[0]
    return flat


def _inexact(aval: Any) -> bool:
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))


def _width(aval: Any) -> int:
    return int(math.prod(aval.shape))


@dataclass
class ModelChain:
    """A model's chain read from its jaxpr: ``flat`` its equations, ``x`` the key of the
    unknowns, ``dependent`` the keys that depend on them, ``cuts[i]`` the place of cut ``i`` in
    the list of equations and ``keys[i]`` its values (the first cut: the unknowns; the last:
    the output), ``chain`` the numbers :mod:`batchjac._chain` brackets."""

    flat: Flat
    x: int
    dependent: set[int]
    cuts: list[int]
    keys: list[list[Any]]
    chain: Chain


def read(closed: Any, x_index: int) -> ModelChain | None:
    """The chain of the function of one instance ``closed`` (a ClosedJaxpr) whose argument
    ``x_index`` (flattened) is the unknowns; None where it has no cut narrower than both ends,
    or holds what this reader cannot read."""
    try:
        return _read(closed, x_index)
    except Exception:  # (a renamed parameter, several results: no chain, a pure mode)
        return None


def _read(closed: Any, x_index: int) -> ModelChain | None:
    flat = flatten(closed)
    x = flat.inputs[x_index]
    out = flat.output
    if isinstance(out, _Lit) or not _inexact(flat.avals[x]) or not _inexact(flat.avals[out]):
        return None
    k, m = _width(flat.avals[x]), _width(flat.avals[out])
    if min(k, m) < MIN_BASIS:
        return None
    dtype = flat.avals[x].dtype
    dependent = {x}
    available = dict.fromkeys((*flat.inputs, *flat.consts), 0)
    last: dict[int, int] = {}
    work: list[float] = []
    for i, step in enumerate(flat.steps):
        reads = [a for a in step.ins if not isinstance(a, _Lit)]
        for a in reads:
            last[a] = i
        varies = any(a in dependent for a in reads)
        for key in step.outs:
            available[key] = i + 1
            if varies and _inexact(flat.avals[key]):
                dependent.add(key)
        work.append(jax_cost.equation(step.eqn).flops if varies else 0.0)
    end = len(flat.steps)
    last[out] = end
    # the values live at each place, those that vary: added where made, dropped after last use
    found: list[tuple[int, list[int], int]] = []  # (place, keys, width)
    live: set[int] = {x}
    for p in range(1, end):
        live.update(key for key in flat.steps[p - 1].outs if key in dependent)
        live = {key for key in live if last.get(key, -1) >= p}
        if not live or any(flat.avals[key].dtype != dtype for key in live):
            continue
        width = sum(_width(flat.avals[key]) for key in live)
        if width < min(k, m):
            found.append((p, sorted(live), width))
    if not found:
        return None
    # one place per run of places with the same values' width (elementwise steps between),
    # the last; then the narrowest MAX_CUTS, in order
    runs: list[tuple[int, list[int], int]] = []
    for place in found:
        if runs and runs[-1][2] == place[2] and runs[-1][0] == place[0] - 1:
            runs[-1] = place
        else:
            runs.append(place)
    runs = sorted(sorted(runs, key=lambda r: r[2])[:MAX_CUTS])
    cuts = [0, *(p for p, _, _ in runs), end]
    keys: list[list[Any]] = [[x], *(list(ks) for _, ks, _ in runs), [out]]
    widths = (k, *(w for _, _, w in runs), m)
    costs = tuple(float(sum(work[a:b])) for a, b in itertools.pairwise(cuts))
    labels = ("the unknowns", *(_label(flat, ks, w) for _, ks, w in runs), "the outputs")
    return ModelChain(flat, x, dependent, cuts, keys, Chain(widths, costs, labels))


def _label(flat: Flat, keys: list[int], width: int) -> str:
    """A cut in words: its width and the operations that made its values."""
    made = {key: compat.primitive(step.eqn) for step in flat.steps for key in step.outs}
    ops = sorted({made.get(key, "input") for key in keys})
    return f"the {width} values after {'/'.join(ops)}"


def instance_jacobian(mc: ModelChain, plan: Accumulation, leaves: list[Any]) -> tuple[Any, Any]:
    """``(y, J)`` of one instance, ``leaves`` the function's flattened arguments (the keys of
    :attr:`Flat.inputs`), ``J`` accumulated along ``plan``'s bracketing, of shape
    ``(m, k)`` (the caller reshapes it)."""
    flat = mc.flat
    env: dict[int, Any] = dict(flat.consts)
    env.update(zip(flat.inputs, leaves))

    def value(a: Any, local: dict[int, Any]) -> Any:
        if isinstance(a, _Lit):
            return a.val
        return local[a] if a in local else env[a]

    for step in flat.steps:  # the forward evaluation, once
        env.update(zip(step.outs, compat.bind(step.eqn, [value(a, {}) for a in step.ins])))

    def piece(p: Piece) -> Any:
        if not p.leaf:
            assert p.left is not None
            assert p.right is not None
            return piece(p.right) @ piece(p.left)
        ins, outs = mc.keys[p.start], mc.keys[p.stop]
        shapes = [flat.avals[key].shape for key in ins]
        sizes = [_width(flat.avals[key]) for key in ins]
        steps = flat.steps[mc.cuts[p.start]:mc.cuts[p.stop]]

        def fn(z: Any) -> Any:
            local: dict[int, Any] = {}
            for key, part, shape in zip(ins, jnp.split(z, np.cumsum(sizes)[:-1]), shapes):
                local[key] = part.reshape(shape)
            for step in steps:  # those that read what varies, again; the others as computed
                if any(not isinstance(a, _Lit) and a in local for a in step.ins):
                    made = compat.bind(step.eqn, [value(a, local) for a in step.ins])
                    local.update((key, v) for key, v in zip(step.outs, made) if key in mc.dependent)
            return jnp.concatenate([jnp.ravel(value(a, local)) for a in outs])

        z0 = jnp.concatenate([jnp.ravel(env[key]) for key in ins])
        differentiate = jax.jacfwd if p.mode == "forward" else jax.jacrev
        return differentiate(fn)(z0)

    return value(flat.output, {}), piece(plan.root)
