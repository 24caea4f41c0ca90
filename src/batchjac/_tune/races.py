"""Timing where the cost model cannot decide, once per model, signature and shape.

- **Mode**: when unknowns and outputs are of similar count, time one chunk in each mode and
  keep the winner (:func:`tune`).
- **Chunk size**: the memory budget bounds the chunk, but the fastest chunk is often much
  smaller than what fits, while TensorFlow's graph prefers its largest chunk (measured:
  docs/thresholds.md, "The chunk-size ladder"). Which size wins depends on the framework,
  the layers and the machine's caches and allocator; the planner's first guess cuts JAX
  chunks whose traced temporaries outgrow the cache (:func:`batchjac._plan.fit_cache`), and
  :func:`tune_rows` times a ladder of sizes (the planned one, then a quarter of it each
  step) on the call's own rows, counting
  the copy of each chunk into the result that one whole chunk does not need, and takes the
  largest size within ``NEAR`` of the fastest per row when it is faster per row than the
  planned one by more than ``ROWS_MARGIN`` (``COPY_MARGIN`` when the plan was one chunk of
  at least ``COPY_BYTES``: the copies then go to fresh pages of a large new result, which
  costs more than the timing shows), after timing the planned and that size again,
  interleaved. It runs for chunks of at least
  ``TUNE_MIN_ROWS`` rows (smaller ones are dispatch-bound: one chunk is best) and stops
  descending once a size is ``STOP_RATIO`` times slower than the best so far (the per-row
  cost is not monotonic in the size). The planned size's kernel chooses its implementation
  first (JAX: build and blocks, by timing); the smaller sizes run what it chose
  (``Kernel.provisional``), and only the size kept times its own. Its cost (a few
  chunks, and one compilation per size tried) is paid once per model and shape and reported
  as compile time; ``BATCHJAC_AUTOTUNE=off``, an explicit ``chunk_size`` or an ``out=``
  array (results larger than memory: the budget is what matters there, and trying sizes
  would hold more than one chunk's buffers) skip it. Stores do not tune chunk sizes (their
  plan is fixed by the cost model and recorded).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .._backends import BoundModel, CallBudget, Kernel, Mode, under
from .._plan import Plan, SecondPlan
from .._runner import pad_chunk
from .._sinks import new_result
from .._spec import BatchSpec
from . import chooser

REPEATS = 5
#: fast kernels: more repeats of the mode timing, up to this many or this long in all
MAX_MODE_REPEATS = 25
MODE_SECONDS = 0.1
#: the other mode must be this much faster than the cost model's: more than the chooser's
#: margin between builds, since a mode switch moves the whole plan (a kernel of the other
#: mode, its own ladder of chunk sizes), and the timings are minimums of few calls
MARGIN = 0.1
#: a smaller chunk size must be faster per row by the chooser's margin, as a build must
ROWS_MARGIN = chooser.MARGIN
#: ... and by this much when the plan is one chunk of at least COPY_BYTES of Jacobians:
#: chunking then adds copies into a large new result, which the timing leaves out
COPY_MARGIN = 0.25
COPY_BYTES = 64 << 20
#: timed runs of each chunk size (the median counts: an erratic size's fastest timing once
#: won against a steadily faster one; docs/thresholds.md)
TIMED_RUNS = 3
#: ... and runs more of the planned size and the fastest, interleaved, before choosing
CONFIRM_RUNS = 2
#: sizes this close to the fastest per row count as fast: the largest of them is taken
NEAR = 0.05
#: chunks smaller than this are not tuned
TUNE_MIN_ROWS = 1024
#: each size tried is this fraction of the previous one
ROWS_STEP = 4
#: ... down to this many rows
MIN_TUNED_ROWS = 64
#: a size this much slower per row than the best so far ends the descent. The landscape is
#: not monotonic, and a tighter stop missed the best size (docs/thresholds.md)
STOP_RATIO = 1.5
#: the clock every timing here reads: tests replace it with one their fake kernels advance,
#: to test the decisions on chosen timings rather than on sleeps a busy machine stretches
clock: Callable[[], float] = time.perf_counter


def tune(bound: BoundModel, spec: BatchSpec, plan: Plan, with_outputs: bool, *, rows: int = 0
         ) -> Plan:
    """The plan on the faster mode (:func:`time_modes`); ``rows``: the call's, where known."""
    u, ctx = pad_chunk(spec, 0, min(plan.chunk_size, spec.n), plan.chunk_size)
    mode, measured = time_modes(bound, u, ctx, with_outputs, plan.mode, rows=rows)
    return dataclasses.replace(
        plan, mode=mode,
        reason=f"{mode} mode (unknowns and outputs of similar count; timed one chunk: {measured})"
               + plan.reason[plan.reason.index(";"):],
    )


def time_modes(bound: BoundModel, u: np.ndarray, ctx: tuple[np.ndarray, ...], with_outputs: bool,
               prior: Mode, *, rows: int = 0) -> tuple[Mode, str]:
    """The faster mode for chunks of ``len(u)`` rows, timed on ``(u, ctx)`` once per bound
    model and chunk size (cached in ``bound.tuned``), and the timings. ``prior`` (the cost
    model's choice) stays unless the other mode is faster by more than ``MARGIN``. Fast
    kernels are timed more often (up to ``MODE_SECONDS`` in all): a single millisecond call
    jitters by tens of percent on a shared machine."""
    key = (u.shape[0], with_outputs)
    if key not in bound.tuned:
        # a mode that fails for this model loses, without a warning
        racing = CallBudget(rows=rows, mode_race=True)
        kernels = {mode: under(bound.kernel(mode, u.shape[0], with_outputs,  # type: ignore[arg-type]
                                            budget=racing), racing)
                   for mode in ("forward", "reverse")}
        for kernel in kernels.values():
            kernel.provisional(u, ctx)  # compile and warm up
        failing = [mode for mode, kernel in kernels.items()
                   if getattr(kernel, "computes", mode) != mode]  # (duck-typed kernels)
        if failing:
            other: Mode = "reverse" if failing[0] == "forward" else "forward"
            bound.tuned[key] = (other, f"{failing[0]} mode fails for this model")
            return other, bound.tuned[key][1]
        first = {}
        for mode, kernel in kernels.items():
            start = clock()
            kernel.provisional(u, ctx)
            first[mode] = clock() - start
        timings = dict(first)
        repeats = max(REPEATS, min(MAX_MODE_REPEATS,
                                   int(MODE_SECONDS / max(sum(first.values()), 1e-9))))
        for _ in range(repeats - 1):  # interleaved, minimum: robust to a busy machine
            for mode, kernel in kernels.items():
                start = clock()
                kernel.provisional(u, ctx)
                timings[mode] = min(timings[mode], clock() - start)
        other = "reverse" if prior == "forward" else "forward"
        bound.tuned[key] = (chooser.winner(timings, prior, [other], margin=MARGIN),
                            chooser.timings(timings))
    mode, measured = bound.tuned[key]
    return ("forward" if mode == "forward" else "reverse"), measured


#: compilations a chunk-size ladder costs, for the rule of :mod:`batchjac._tune.policy` (sizes of
#: 1/4, 1/16, ... of the planned one: three or four are built before the descent stops)
ROWS_COMPILATIONS = 3


#: a kernel for chunks of so many rows (the second-order verbs pass theirs: the ladder is the
#: same, the kernels are theirs)
KernelFor = Callable[[int], Kernel]
P = TypeVar("P", Plan, SecondPlan)


def tuned_rows(bound: BoundModel, plan: Plan | SecondPlan, with_outputs: bool, *,
               mode: str | None = None) -> bool:
    """Whether the chunk sizes for this plan were timed already (the answer is known);
    ``mode`` names the kernels when they are not the plan's Jacobian kernels."""
    name = mode if mode is not None else plan.mode  # type: ignore[union-attr]
    return ("rows", name, plan.chunk_size, with_outputs) in bound.tuned_rows


def tune_rows(bound: BoundModel, spec: BatchSpec, plan: P, with_outputs: bool, *,
              kernel_for: KernelFor | None = None, mode: str | None = None) -> P:
    """The plan with the fastest chunk size found by timing (at most the planned one).
    ``kernel_for`` and ``mode``: the kernels timed and their name in the tuning table, where
    they are not the plan's Jacobian kernels (a Hessian's, a Laplacian's)."""
    if plan.chunk_size < TUNE_MIN_ROWS or spec.n < TUNE_MIN_ROWS:
        return plan
    if kernel_for is None or mode is None:
        assert isinstance(plan, Plan)
        jac_mode: Mode = plan.mode

        def jacobians(size: int) -> Kernel:
            return bound.kernel(jac_mode, size, with_outputs)
        kernel_for, mode = jacobians, jac_mode
    key = ("rows", mode, plan.chunk_size, with_outputs)
    if key not in bound.tuned_rows:
        bound.tuned_rows[key] = _fastest_rows(bound, spec, plan, kernel_for)
    best, measured = bound.tuned_rows[key]
    if best >= plan.chunk_size:
        return dataclasses.replace(plan, reason=f"{plan.reason}; kept after timing {measured}")
    # the size timed, whose kernel exists: the sizes tried are the planned one over powers of
    # 4, and the planned one fits the rows, so the last chunk's padding stays small
    size = best
    return dataclasses.replace(
        plan, chunk_size=size, n_chunks=-(-spec.n // size),
        reason=f"{plan.reason.split('; chunks of')[0]}; chunks of {size} rows (timed per row: "
               f"{measured})")


def _fastest_rows(bound: BoundModel, spec: BatchSpec, plan: Plan | SecondPlan,
                  kernel_for: KernelFor) -> tuple[int, str]:
    sizes = [plan.chunk_size]
    while sizes[-1] // ROWS_STEP >= MIN_TUNED_ROWS:
        sizes.append(sizes[-1] // ROWS_STEP)
    runs: dict[int, list[float]] = {}
    per_row: dict[int, float] = {}
    for size in sizes:
        timed, row_bytes = _timer(spec, plan, kernel_for, size, first=size == sizes[0])
        runs[size] = [timed() for _ in range(TIMED_RUNS)]
        per_row[size] = float(np.median(runs[size])) / size
        if per_row[size] > STOP_RATIO * min(per_row.values()):
            break
    fastest = _pick(per_row)
    if fastest != sizes[0]:
        # the sizes were timed one after the other, minutes apart on a busy machine: time
        # the two that decide again, interleaved (a slow spell on the smaller sizes' turn once
        # kept the planned one; docs/thresholds.md, CONFIRM_RUNS)
        timers = {s: _timer(spec, plan, kernel_for, s, first=False)[0]
                  for s in (sizes[0], fastest)}
        for _ in range(CONFIRM_RUNS):
            for s, timed in timers.items():
                runs[s].append(timed())
        for s in timers:
            per_row[s] = float(np.median(runs[s])) / s
    # the fastest size tried, if clearly faster than the planned one. Where the plan is one
    # large chunk, chunking adds copies into a new result whose first writes (page faults)
    # the reused buffer above does not pay, so that case asks more; a small result does not
    # (measured: docs/thresholds.md, COPY_MARGIN)
    fastest = _pick(per_row)
    large = plan.n_chunks == 1 and row_bytes * spec.n >= COPY_BYTES
    margin = COPY_MARGIN if large else ROWS_MARGIN
    measured = ", ".join(f"{s} rows {t * 1e6:.2f} us" for s, t in per_row.items())
    return chooser.winner(per_row, sizes[0], [fastest], margin=margin), measured


def _pick(per_row: dict[int, float]) -> int:
    """The largest size within NEAR of the fastest per row: each chunk costs the runner some
    work the timing leaves out (slicing, padding, the copy's call): docs/thresholds.md, NEAR."""
    best = min(per_row.values())
    return max(s for s, t in per_row.items() if t <= (1 + NEAR) * best)


def _main(result: Any) -> Any:
    """The Jacobians of a kernel's ``(y, J)``, or the main result of a second-order kernel's
    mapping of named arrays (its first)."""
    return next(iter(result.values())) if isinstance(result, dict) else result[1]


def _timer(spec: BatchSpec, plan: Plan | SecondPlan, kernel_for: KernelFor, size: int, *,
           first: bool) -> tuple[Callable[[], float], float]:
    """A function timing one chunk of ``size`` rows (warmed up here, compiled if new), and
    the bytes of a row's Jacobians (a second-order kernel's main result)."""
    u, ctx = pad_chunk(spec, 0, min(size, spec.n), size)
    kernel = kernel_for(size)
    # several chunks are copied into the result, one chunk of all the rows is not: the
    # copy (and the fresh pages it writes) is part of the price of a smaller chunk
    copies = size < spec.n and plan.n_chunks == 1  # (several planned chunks: all copy)
    # the planned size's kernel chooses its implementation now (JAX: build and blocks,
    # timed); the smaller sizes run the build it chose, so that sizes are compared alike
    jac = _main(kernel(u, ctx) if first else kernel.provisional(u, ctx))
    # the copy the in-memory result makes of each chunk, in the result's kind
    # (:class:`batchjac._arrays.ChunkSink`): numpy, a torch tensor, a CPU JAX array's host
    # memory. Not priced: a kind joined once at the end (JAX off the CPU, TensorFlow)
    xp = spec.xp
    dst = xp.buffer(jac, tuple(jac.shape), new_result) if copies else None

    def timed() -> float:
        start = clock()
        jac = _main(kernel.provisional(u, ctx))
        if dst is not None:
            xp.write(dst, 0, jac)
        return clock() - start

    return timed, math.prod(jac.shape) * spec.dtype.itemsize / size
