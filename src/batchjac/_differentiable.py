"""Derivatives that carry gradients: ``differentiable=True`` on ``jacobian``, ``hessian`` (its
diagonal, the Laplacian) and ``hvp``.

A training loss built on a per-instance Jacobian, Hessian or Laplacian (a physics-informed
network's residual, a Jacobian penalty) needs that result inside the framework's own graph,
so that the loss's gradient reaches the model's parameters, and the inputs where they require
it. The compiled kernels of :mod:`batchjac._compute` cannot give that: they run detached, on
the host's copies or behind XLA's executables, and time their builds on the calls. Here the
same call forms are validated the same way (:func:`batchjac._validate.normalize`, kept in the
model's framework: torch tensors, JAX arrays or tracers, TensorFlow tensors), the mode or the
order is chosen from the shapes by the one cost model (:func:`batchjac._plan.make_plan`,
:func:`batchjac._plan.make_second_plan`), never by timing, and the backend's builds run as
framework operations (:meth:`~batchjac._backends.BoundModel.differentiable`): torch.func and
plain autograd outside ``no_grad``, JAX's transforms inside the caller's trace, TensorFlow's
tapes inside the caller's tape. The forward Laplacian's rule sets are framework operations
too, so a physics-informed loss gets batchjac's fastest Laplacian with its gradient.

Under a memory budget the rows are cut into chunks, each recomputed in the backward pass
(:meth:`~batchjac._backends.BoundModel.rematerialized`: ``torch.utils.checkpoint``,
``jax.checkpoint``, ``tf.recompute_grad``), so that a chunk's intermediates are held once, not
all of them until the loss's gradient is taken.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from . import _backends
from ._arrays import OutputArg, _leaves, kind_of
from ._backends._base import SECOND_RESULT, Signature
from ._bind import memory_budget
from ._compute import context
from ._errors import BatchJacError, InputError, OrderFailedError, add_context
from ._loaders import as_model
from ._plan import (
    bytes_per_row,
    check_options,
    choose_order,
    make_plan,
    make_second_plan,
    second_bytes_per_row,
)
from ._spec import BatchSpec, check_finite_rows
from ._validate import DTypeLike, NanPolicy, normalize

#: the memory a chunk's derivatives hold until the loss's gradient is taken, and while that
#: gradient is computed, against the planner's estimate of the derivatives alone (their graph
#: and the gradient's passes over it): the budget a chunk may take is cut by this much
BACKWARD_FACTOR = 3


def refuse(**given: Any) -> None:
    """The options of the computing verbs a differentiable call cannot take, each refused by
    name with what to do instead."""
    why = {
        "out": "its result lives in the framework's graph, not in an array or a store",
        "client": "a gradient cannot come back from Dask's workers",
        "scheduler": "a gradient cannot come back from Dask's workers",
        "progress": "it computes inside the caller's step, chunk by chunk without a bar",
    }
    for name, value in given.items():
        if value is not None and value is not False:
            raise InputError(f"`{name}=` cannot be combined with `differentiable=True`: {why[name]}. "
                             f"Drop `{name}` (or compute without differentiable=True).")


def derivatives(model: Any, inputs: tuple[Any, ...], kind: str, *, wrt: Any, mode: str,
                chunk_size: int | None, max_memory: int | str | None, dtype: DTypeLike,
                return_outputs: bool, return_jacobian: bool, nan_policy: NanPolicy,
                backend: str | None, backend_options: dict[str, Any] | None, explain: bool,
                output: OutputArg, tangents: Any = None) -> Any:
    """The result of ``kind`` ("jacobian" or a second-order kind) as the framework's arrays in
    its graph: ``(outputs?, jacobians?, result)`` as the verbs return them."""
    model = as_model(model)
    name = backend or _backends.detect(model)
    be = _backends.get_backend(name)
    if output not in ("auto", name):
        raise InputError(f"`output={output!r}` cannot be combined with `differentiable=True`: the "
                         f"result is the {name} model's own arrays, in its graph. Drop `output`.")
    if kind == "jacobian":
        check_options(mode, chunk_size, max_memory)
    else:
        choose_order(mode, kind, 1, 1)  # type: ignore[arg-type]
        check_options("auto", chunk_size, max_memory)
    given = (*inputs, tangents) if tangents is not None else inputs
    found = {kind_of(a) for a in _leaves(given)} - {"numpy"}
    if found - {name}:
        raise InputError(
            f"With differentiable=True the inputs must be the {name} model's own arrays (or "
            f"numpy); got {sorted(found)} arrays. A gradient cannot cross frameworks: convert "
            f"them to {name} arrays first.")
    for a in _leaves(given):
        if any(d is None for d in tuple(getattr(a, "shape", ()))):
            raise InputError(
                f"An input has the shape {tuple(a.shape)}, with sizes not known while the "
                f"caller's function is traced; differentiable=True plans its chunks and "
                f"builds from static shapes. Trace with fixed shapes: a tf.function without a "
                f"None in its input_signature, or for Keras's fit a dataset batched with "
                f"drop_remainder=True.")
    xp = _backends.graph_ops(name)
    natives = [a for a in _leaves(given) if kind_of(a) == name and not xp.is_traced(a)]
    device = xp.device_of(natives[0]) if natives else None  # (a trace's: where it runs)
    spec = normalize(inputs, wrt=wrt, dtype=dtype, nan_policy="propagate", xp=xp, device=device)
    options = backend_options or {}
    if device is not None:
        options = be.device_options(model, device, options)
    try:
        if nan_policy == "raise":
            _check_finite(spec)
        sig = Signature(layout=spec.layout, dtype=spec.dtype, unknown_shape=spec.unknown_shape,
                        ctx=spec.ctx_specs())
        bound = _backends.bind_differentiable(be, model, sig, options)
        v = _tangents(spec, tangents, xp, device) if kind == "hvp" else None
        return _compute(bound, spec, kind, v, mode=mode, chunk_size=chunk_size,
                        max_memory=max_memory, return_outputs=return_outputs,
                        return_jacobian=return_jacobian, explain=explain, xp=xp)
    except BatchJacError as e:
        raise add_context(e, context(spec, name)) from e


def _check_finite(spec: BatchSpec) -> None:
    """NaN or Inf in the inputs refused where their values are known (not inside a trace,
    whose values come later: there they propagate)."""
    xp = spec.xp
    for a, name in zip(spec.arrays, spec.names):
        if not xp.is_traced(a) and not xp.all_finite(a):
            check_finite_rows(xp.to_numpy(a), name, 0, whole=True)


def _tangents(spec: BatchSpec, v: Any, xp: Any, device: Any) -> Any:
    """``hvp``'s tangents as the framework's array of the unknowns' shape and dtype."""
    if v is None:
        raise InputError("hvp() needs the tangents `v`: one row per instance, shaped like the "
                         f"unknowns, i.e. ({spec.n}, {', '.join(map(str, spec.unknown_shape))}).")
    got = normalize((v,), wrt=None, dtype=spec.dtype, nan_policy="propagate", xp=xp,
                    device=device).arrays[0]
    want = (spec.n, *spec.unknown_shape)
    if tuple(int(d) for d in got.shape) != want:
        raise InputError(f"`v` has shape {tuple(got.shape)}, but the unknowns have shape {want}: "
                         f"it needs one tangent per instance, shaped like that instance's unknowns.")
    return xp.cast(got, spec.dtype)


def _compute(bound: _backends.BoundModel, spec: BatchSpec, kind: str, v: Any, *, mode: str,
             chunk_size: int | None, max_memory: int | str | None, return_outputs: bool,
             return_jacobian: bool, explain: bool, xp: Any) -> Any:
    if bound.output_shape is None:
        u, ctx = spec.chunk(0, min(spec.n, 1))
        bound.output_shape = bound.differentiable_output_shape(u, ctx)
    m = math.prod(bound.output_shape)
    k = spec.k
    in_elems = sum(math.prod(a.shape[1:]) for a in spec.arrays)
    budget = max(1, memory_budget(bound, max_memory) // BACKWARD_FACTOR)

    def plan(mode: str) -> tuple[str, int, str]:
        if kind == "jacobian":
            first = make_plan(n=spec.n, k=k, m=m, in_elems=in_elems, dtype=spec.dtype,
                              mode=mode, chunk_size=chunk_size, max_memory=budget,  # type: ignore[arg-type]
                              forward_bias=bound.forward_bias)
            return first.mode, first.chunk_size, first.reason
        second = make_second_plan(kind=kind, n=spec.n, k=k, m=m, in_elems=in_elems,  # type: ignore[arg-type]
                                  dtype=spec.dtype, order=mode, chunk_size=chunk_size,  # type: ignore[arg-type]
                                  max_memory=budget,
                                  reductions_over_forward=bound.reductions_over_forward,
                                  forward_hessian=bound.forward_hessian)
        return second.order, second.chunk_size, second.reason

    how, size, reason = plan(mode)
    forward = "forward" if kind == "jacobian" else "forward-over-forward"
    if spec.n > size and how != forward and not bound.rematerializes_reverse(kind):
        # chunks recomputed for the gradient, where this backend recomputes only forward orders of this kind
        if mode != "auto":
            raise InputError(
                f"mode={mode!r} cannot be recomputed chunk by chunk for the gradient in this "
                f"backend (its reverse-mode transforms refuse the hooks that recompute a "
                f"chunk), and the {spec.n} rows need {-(-spec.n // size)} "
                f"chunks of {size}. Pass mode='auto' (forward mode then), or a larger "
                f"max_memory / chunk_size for one chunk.")
        how, size, reason = plan(forward)
        reason = reason.replace(f"mode={forward!r} was asked for", "the order this backend "
                                "recomputes chunk by chunk for the gradient")
    if max_memory is not None and chunk_size is None:
        itemsize = np.dtype(spec.dtype).itemsize
        per_row = bytes_per_row(k, m, in_elems, itemsize) if kind == "jacobian" else \
            second_bytes_per_row(kind, how, k, m, in_elems, itemsize)  # type: ignore[arg-type]
        if per_row > budget:  # (not one row: the budget cannot hold, so it is not pretended)
            raise InputError(
                f"max_memory={max_memory!r} cannot be met: a differentiable call keeps a "
                f"chunk's derivatives until the loss's gradient is taken, so a chunk may use "
                f"a third of the budget ({budget:,} B), and one row needs ~{per_row:,} B by the "
                f"planner's estimate. Pass max_memory of at least "
                f"{per_row * BACKWARD_FACTOR:,} B, or none.")
    wanted = ("outputs",) * return_outputs + ("jacobians",) * (return_jacobian and kind != "jacobian")

    def run(how: str, size: int, reason: str) -> Any:
        return _run(how, size, reason, bound=bound, spec=spec, kind=kind, v=v, wanted=wanted,
                    explain=explain, xp=xp)

    try:
        return run(how, size, reason)
    except OrderFailedError:  # (raised while the first chunk is built: nothing is lost)
        if mode != "auto" or how != forward:
            raise
    reverse = "reverse" if kind == "jacobian" else "forward-over-reverse"
    how, size, reason = plan(reverse)
    reason = reason.replace(f"mode={reverse!r} was asked for",
                            f"{forward} cannot differentiate this model")
    return run(how, size, reason)


def _run(how: str, size: int, reason: str, *, bound: _backends.BoundModel, spec: BatchSpec,
         kind: str, v: Any, wanted: tuple[str, ...], explain: bool, xp: Any) -> Any:
    chunks = -(-spec.n // size) if spec.n else 0
    fn = bound.differentiable(kind, how, with_outputs="outputs" in wanted,
                              with_jacobian="jacobians" in wanted or kind == "jacobian",
                              recomputed=chunks > 1)
    if chunks > 1:  # each chunk's intermediates recomputed in the backward pass, not kept
        fn = bound.rematerialized(fn)
    if explain:
        sys.stderr.write(f"batchjac: differentiable: {reason}"
                         + (f"; {chunks} chunks, each recomputed for the gradient\n"
                            if chunks > 1 else "\n"))
    main = "jacobians" if kind == "jacobian" else SECOND_RESULT[kind]
    parts: dict[str, list[Any]] = {n: [] for n in (*wanted, main)}
    for lo in range(0, spec.n, size) if spec.n else ():
        hi = min(spec.n, lo + size)
        u, ctx = spec.chunk(lo, hi)
        out = fn(u, ctx, None if v is None else v[lo:hi])
        for n in parts:
            parts[n].append(out[n])
    if not spec.n:
        return _empty(bound, spec, kind, wanted, main, xp)
    joined = {n: p[0] if len(p) == 1 else xp.concat(p) for n, p in parts.items()}
    if not wanted:
        return joined[main]
    return (*(joined[n] for n in wanted), joined[main])


def _empty(bound: _backends.BoundModel, spec: BatchSpec, kind: str, wanted: tuple[str, ...],
           main: str, xp: Any) -> Any:
    """The results of no rows, as the framework's arrays of the right shapes."""
    assert bound.output_shape is not None
    y, unk = (0, *bound.output_shape), tuple(spec.unknown_shape)
    shapes = {"outputs": y, "jacobians": (*y, *unk), "hessians": (*y, *unk, *unk),
              "diagonals": (*y, *unk), "laplacians": y, "hvps": (*y, *unk)}
    out = {n: xp.from_numpy(np.zeros(shapes[n], spec.dtype)) for n in (*wanted, main)}
    return out[main] if not wanted else (*(out[n] for n in wanted), out[main])

