"""Shared machinery of the analyses built on Jacobians (check, propagate): bind a model, stream
``(y, J)`` chunk by chunk, and evaluate the model's forward pass on many rows at once.

Like the rest of batchjac this module sees numpy arrays and the backend interface only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from . import _backends
from ._bind import plan_for, prepare
from ._config import default_max_memory, parse_bytes
from ._errors import BatchJacError, InputError, add_context
from ._plan import ModeArg, Plan
from ._runner import chunks, iter_results, model_call, pad_args
from ._spec import BatchSpec

#: most rows one forward call of an analysis gets (fixed per call, so one trace per shape)
MAX_BLOCK = 16384
MIN_BLOCK = 64


def budget(max_memory: int | str | None) -> int:
    return default_max_memory() if max_memory is None else parse_bytes(max_memory)


def context(spec: BatchSpec, backend: str) -> str:
    """The boundary context batchjac adds to errors (as :func:`batchjac.jacobian` does)."""
    shapes = ", ".join(f"{n} {a.shape} {a.dtype}" for n, a in zip(spec.names, spec.arrays))
    return f"backend={backend}; inputs: {shapes}; compute dtype {spec.dtype}"


def subset(spec: BatchSpec, rows: np.ndarray) -> BatchSpec:
    """The batch restricted to ``rows`` (a copy of those rows only)."""
    return dataclasses.replace(spec, arrays=[a[rows] for a in spec.arrays], n=len(rows))


def with_dtype(spec: BatchSpec, dtype: Any) -> BatchSpec:
    return dataclasses.replace(spec, dtype=np.dtype(dtype))


def output_size(bound: _backends.BoundModel) -> int:
    assert bound.output_shape is not None
    return int(np.prod(bound.output_shape, dtype=np.int64))


def in_elems(spec: BatchSpec) -> int:
    return sum(int(np.prod(a.shape[1:], dtype=np.int64)) for a in spec.arrays)


R = TypeVar("R")


def reduce_jacobians(
    bound: _backends.BoundModel, spec: BatchSpec, backend: str, *, mode: ModeArg,
    chunk_size: int | None, max_memory: int | str | None, with_outputs: bool,
    consume: Callable[[Iterator[tuple[int, int, Any, Any]], Plan], R],
    extra_bytes_per_row: int = 0,
) -> R:
    """``consume`` of the ``(lo, hi, y or None, J)`` of every chunk, in order, and of the plan
    they are computed by (its mode, its chunk size), computed by the
    one compute sequence of :func:`batchjac.jacobian` (:func:`batchjac._compute.compute`): the
    kernel's build remembered or raced on the calls as there, the chunk size raced below the
    budget's where ``chunk_size`` is free, the decisions kept on disk; for the analyses that
    reduce each chunk as it comes (``propagate``'s ``J Sigma J^T``, the divergence, ``check``'s
    comparison with finite differences), which were served with a kernel's untimed first build
    every call before. ``extra_bytes_per_row`` is what the caller keeps per instance beside the
    Jacobian (a finite difference reference, a covariance): the memory budget is shrunk to leave
    room for it. A ``mode`` asked for (not "auto") is computed or refused, never swapped for the
    other. ``backend`` names the decisions on disk."""
    from ._compute import Derivative, compute

    total = budget(max_memory)
    if chunk_size is None and extra_bytes_per_row:
        from ._plan import bytes_per_row

        base = bytes_per_row(spec.k, output_size(bound), in_elems(spec), spec.dtype.itemsize)
        total = max(1, total * base // (base + extra_bytes_per_row))
    plan = plan_for(spec, bound, mode=mode, chunk_size=chunk_size, max_memory=total)

    def run(kernel: Any, planned: Plan) -> R:
        return consume(((chunk.lo, chunk.hi, out.get("outputs"), out["jacobians"])
                        for chunk, out, _ in iter_results(kernel, spec)), planned)

    result: R = compute(bound, spec, Derivative("jacobian", with_outputs), plan, backend=backend,
                        rows_free=chunk_size is None, run=run, explain=False,
                        mode_asked=mode != "auto")
    return result


def block_rows(spec: BatchSpec, m: int, max_memory: int | str | None) -> int:
    """Rows per forward call: a quarter of the memory budget at a guessed cost per row (inputs,
    outputs and activations in float64), between MIN_BLOCK and MAX_BLOCK."""
    per_row = 8 * (3 * (in_elems(spec) + m) + 512)
    return int(min(MAX_BLOCK, max(MIN_BLOCK, budget(max_memory) // 4 // per_row)))


class Evaluator:
    """The bound model's forward pass over any number of rows, in blocks of exactly ``block``
    rows (the last padded): every call has the same shape, so a backend traces it once."""

    def __init__(self, bound: _backends.BoundModel, block: int) -> None:
        self.bound = bound
        self.block = int(block)
        self.calls = 0

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        """``u``: (rows, *unknown_shape) in the compute dtype; returns (rows, *output_shape)
        as float64."""
        rows = u.shape[0]
        out: np.ndarray | None = None
        for chunk in chunks(rows, self.block):
            lo, hi = chunk.lo, chunk.hi
            ub, cb = pad_args(u[lo:hi], tuple(c[lo:hi] for c in ctx), self.block)
            with model_call(f"a forward pass of rows {lo}:{hi}"):
                y = self.bound.forward(ub, cb)
            self.calls += 1
            if out is None:
                out = np.empty((rows, *y.shape[1:]), np.float64)
            out[lo:hi] = y[: hi - lo]
        if out is None:
            assert self.bound.output_shape is not None
            return np.empty((0, *self.bound.output_shape), np.float64)
        return out


def bind(model: Any, spec: BatchSpec, backend: str | None,
         options: dict[str, Any] | None) -> tuple[str, _backends.BoundModel]:
    """Detect the backend and bind (and probe) the model for ``spec``."""
    name = backend or _backends.detect(model)
    try:
        return name, prepare(model, spec, name, options or {})
    except BatchJacError as e:
        raise add_context(e, context(spec, name)) from e


def repeat_rows(ctx: tuple[np.ndarray, ...], times: int) -> tuple[np.ndarray, ...]:
    """Each row of each ctx array repeated ``times`` times in place (row-major blocks)."""
    return tuple(np.repeat(c, times, axis=0) for c in ctx)


def check_out(out: Any, shape: tuple[int, ...], what: str) -> None:
    got = getattr(out, "shape", None)
    if got is None or not hasattr(out, "__setitem__"):
        raise InputError(f"`out` {what} must be a writable array of shape {shape} (np.empty or an "
                         f"np.memmap); got {type(out).__name__}.")
    if tuple(got) != shape:
        raise InputError(f"`out` {what} has shape {tuple(got)}; it must be {shape}.")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise InputError(f"`out` {what} is read-only; open the memmap with mode='r+' or 'w+'.")
