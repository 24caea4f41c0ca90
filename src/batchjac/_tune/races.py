"""Timing where the cost model cannot decide, once per model, signature and shape.

- **Mode**: when unknowns and outputs are of similar count, the two modes race on the user's
  calls (:class:`ModeRace`, planned by :func:`mode_plan`): the other mode's kernel is made on
  one call, then the calls alternate between the modes, each returning its rows, and the
  medians decide. The race costs the other kernel's build and what its calls lose while
  slower, never a computation nobody uses. :func:`time_modes` times one chunk in each mode
  at once instead, for a caller whose calls are not the user's (the solver's iterates).
- **Chunk size**: the memory budget bounds the chunk, but the fastest chunk is often much
  smaller than what fits, while TensorFlow's graph prefers its largest chunk (measured:
  docs/thresholds.md, "The chunk-size ladder"). Which size wins depends on the framework,
  the layers and the machine's caches and allocator; the planner's first guess cuts JAX
  chunks whose traced temporaries outgrow the cache (:func:`batchjac._plan.fit_cache`), and
  the ladder (:class:`RowsRace`, planned by :func:`rows_plan`) times sizes on the user's
  calls: the planned size, then a quarter of it each step, each call computing all its rows
  in chunks of the size under test and returning them, so the race computes nothing that is
  thrown away, and its timings are what the calls pay (the copies of each chunk into the
  result, the fresh pages of a large result, the padding of the last chunk). It runs for
  chunks of at least ``TUNE_MIN_ROWS`` rows (smaller ones are dispatch-bound: one chunk is
  best), once the work seen repays its compilations (``ROWS_COMPILATIONS``, by the rule of
  :mod:`batchjac._tune.policy`); ``BATCHJAC_AUTOTUNE=off``, an explicit ``chunk_size`` or
  an ``out=`` array (results larger than memory: the budget is what matters there) skip it.
  Stores do not tune chunk sizes (their plan is fixed by the cost model and recorded).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .._backends import BoundModel, CallBudget, Mode, under
from .._plan import Plan, SecondPlan
from .._runner import pad_chunk
from .._spec import BatchSpec
from . import chooser

REPEATS = 5
#: fast kernels: more repeats of the mode timing, up to this many or this long in all
MAX_MODE_REPEATS = 25
MODE_SECONDS = 0.1
#: calls of each mode the race on the calls times (the other mode's first call not counted);
#: a mode this much slower per row at its first timed call loses at once
MODE_RUNS, MODE_STOP_RATIO = 3, 1.5
#: a smaller chunk size must be faster per row by the chooser's margin, as a build must
ROWS_MARGIN = chooser.MARGIN
#: calls of each chunk size in the ladder's descent (the median counts: an erratic size's
#: fastest timing once won against a steadily faster one; docs/thresholds.md)
TIMED_RUNS = 2
#: ... and calls more of the planned size and the fastest, in turn, before choosing
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
    return _moded(plan, mode, f"timed: {measured}")


def _moded(plan: Plan, mode: Mode, why: str) -> Plan:
    return dataclasses.replace(
        plan, mode=mode,
        reason=f"{mode} mode (unknowns and outputs of similar count; {why})"
               + plan.reason[plan.reason.index(";"):])


def time_modes(bound: BoundModel, u: np.ndarray, ctx: tuple[np.ndarray, ...], with_outputs: bool,
               prior: Mode, *, rows: int = 0) -> tuple[Mode, str]:
    """The faster mode for chunks of ``len(u)`` rows, timed on ``(u, ctx)`` once per bound
    model and chunk size (cached in ``bound.tuned``), and the timings. ``prior`` (the cost
    model's choice) stays unless the other mode is faster by more than the chooser's margin
    (:func:`chooser.winner`, as every race decides). Fast
    kernels are timed more often (up to ``MODE_SECONDS`` in all): a single millisecond call
    jitters by tens of percent on a shared machine."""
    key = (u.shape[0], with_outputs)
    if key not in bound.tuned:
        # a mode that fails for this model loses, without a warning
        racing = CallBudget(rows=rows, plan_race=True)
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
        bound.tuned[key] = (chooser.winner(timings, prior, [other]),
                            chooser.timings(timings))
    mode, measured = bound.tuned[key]
    return ("forward" if mode == "forward" else "reverse"), measured


P = TypeVar("P", Plan, SecondPlan)
#: what a call of a race reports when it is done: its seconds, and whether it made the
#: kernel it ran (a compilation, where the framework compiles: not counted)
Report = Callable[[float, bool], None]


class ModeRace:
    """The race of the two modes on the user's calls (``prior``: the cost model's choice).
    The other mode's kernel is made first: beside the calls where the backend does that
    (``making``, its future: the calls run the prior mode meanwhile, untimed, since they share
    the cores with the making), else by the race's first call. That kernel's first call is not
    counted (a new executable's first run pays its page faults). Then the calls alternate,
    prior first, each computing its rows in the mode of its turn and returning them, until each
    mode has ``MODE_RUNS`` timed calls (or one mode's first is ``MODE_STOP_RATIO`` times the
    other's per row). The medians decide by the one margin (:func:`chooser.winner`): both
    kernels are made by then, so a switch costs no more than the timing sees. A mode whose
    kernel computes in the other one (it fails for the model) loses at once."""

    def __init__(self, prior: Mode) -> None:
        self.prior: Mode = prior
        self.other: Mode = "reverse" if prior == "forward" else "forward"
        self.samples: dict[Mode, list[float]] = {self.prior: [], self.other: []}
        self.made = False  # the other mode's kernel made and run once (its first call)
        #: the other mode's kernel being made beside the calls, where it is
        self.making: concurrent.futures.Future[Any] | None = None
        self.decided: Mode | None = None
        self.why = ""

    def ready(self) -> bool:
        """Whether the race's calls may go on: the other mode's kernel is not being made."""
        return self.making is None or self.making.done()

    def next(self) -> Mode:
        """The mode the next call of the race runs."""
        if self.decided is not None:
            return self.decided
        if not self.made:
            return self.other
        prior, other = (len(self.samples[m]) for m in (self.prior, self.other))
        return self.prior if prior <= other else self.other

    def record(self, mode: Mode, per_row: float, *, failed: bool = False) -> None:
        """A call of the race in ``mode`` took ``per_row`` seconds a row; ``failed``: its
        kernel computed in the other mode (the mode fails for the model)."""
        if self.decided is not None or mode != self.next():
            return  # (a call another thread planned before)
        if failed:
            self.decided = self.prior if mode == self.other else self.other
            self.why = f"{mode} mode fails for this model"
            return
        if mode == self.other and not self.made:
            self.made = True  # (its first call: not counted)
            return
        self.samples[mode].append(per_row)
        per = self.per_row()
        if len(per) < 2:
            return
        fastest: Mode = self.prior if per[self.prior] <= per[self.other] else self.other
        if min(len(t) for t in self.samples.values()) == 1 and \
                max(per.values()) > MODE_STOP_RATIO * min(per.values()):
            self.decided, self.why = fastest, self.measured()  # (clearly: no more slow calls)
        elif all(len(t) >= MODE_RUNS for t in self.samples.values()):
            kept: Mode = chooser.winner(per, self.prior, [self.other])
            self.decided, self.why = kept, self.measured()

    def per_row(self) -> dict[Mode, float]:
        """The median seconds per row of each mode timed."""
        return {m: float(np.median(t)) for m, t in self.samples.items() if t}

    def measured(self) -> str:
        return ", ".join(f"{m} {t * 1e6:.3g} us a row" for m, t in self.per_row().items())


def mode_plan(bound: BoundModel, spec: BatchSpec, plan: Plan, with_outputs: bool, *,
              start: Callable[[], bool], build: str | None = None
              ) -> tuple[Plan, Report | None]:
    """The plan on the mode chosen for it: decided (raced earlier, or remembered from disk),
    or the mode the race on the calls runs this call in (:class:`ModeRace`; ``build``: that
    of the kernel in use, which the other mode's kernel takes where it is made beside the calls),
    with the report its time goes to; ``start()`` says whether a race not begun yet is worth
    beginning now. A plan whose mode is not in doubt is returned as it is."""
    key = (plan.chunk_size, with_outputs)
    if not plan.uncertain:
        return plan, None
    if key in bound.tuned:
        mode, measured = bound.tuned[key]
        return _moded(plan, "forward" if mode == "forward" else "reverse", f"timed: {measured}"), None
    races = bound.tuning.mode_races
    found: ModeRace | None = races.get(key)
    if found is None and not start():
        return plan, None
    race: ModeRace = found if found is not None else races.setdefault(key, ModeRace(plan.mode))
    if found is None:
        race.making = bound.make_beside(race.other, plan.chunk_size, with_outputs,
                                        CallBudget(rows=spec.n, plan_race=True), variant=build)
    if not race.ready():  # (the prior mode's calls meanwhile, untimed: on the fast path)
        waiting = _moded(plan, plan.mode, f"racing the modes on the calls once the {race.other} "
                                          f"mode's kernel is made beside them")
        if bound.has_kernel(plan.mode, plan.chunk_size, with_outputs):
            return waiting, None
        # (a race from a kernel's first call: that kernel is a contender too, which a mode
        # failing for the model makes no news of; its report is the wait's: nothing timed)
        return waiting, lambda seconds, made: None
    mode = race.next()

    def report(seconds: float, made: bool) -> None:
        kernel = bound.kernel(mode, plan.chunk_size, with_outputs)
        race.record(mode, seconds / max(spec.n, 1),
                    failed=getattr(kernel, "computes", mode) != mode)
        if race.decided is not None and races.get(key) is race:
            del races[key]
            bound.tuned[key] = (race.decided, race.why)

    return _moded(plan, mode, f"racing the modes on the calls, their results kept: "
                              f"{race.measured() or 'first'}"), report


#: compilations a chunk-size ladder costs, for the rule of :mod:`batchjac._tune.policy` (sizes of
#: 1/4, 1/16, ... of the planned one: three or four are built before the descent stops)
ROWS_COMPILATIONS = 3


def rows_plan(bound: BoundModel, spec: BatchSpec, plan: P, with_outputs: bool, *, mode: str,
              start: Callable[[], bool]) -> tuple[P, Report | None]:
    """The plan on the chunk size chosen for it: decided (timed earlier, or remembered), or
    the size the ladder's race runs this call on (:class:`RowsRace`), with the report its
    time goes to; ``start()`` says whether a race not begun yet is worth beginning now.
    ``mode``: the kernels' name in the tuning table (a plan's mode, or a second-order
    kind's)."""
    if plan.chunk_size < TUNE_MIN_ROWS or spec.n < TUNE_MIN_ROWS:
        return plan, None
    key = ("rows", mode, plan.chunk_size, with_outputs)
    if key in bound.tuned_rows:
        best, measured = bound.tuned_rows[key]
        if best >= plan.chunk_size:
            return dataclasses.replace(plan, reason=f"{plan.reason}; kept after timing {measured}"), None
        return _sized(plan, spec.n, best, f"timed per row: {measured}"), None
    races = bound.tuning.rows_races
    found = races.get(key)
    if found is None and not start():
        return plan, None
    race: RowsRace = found if found is not None else races.setdefault(key, RowsRace(plan.chunk_size))
    size = race.next()

    def report(seconds: float, made: bool) -> None:
        # (an eager framework's new kernel compiles nothing: its first call counts)
        race.record(size, seconds / spec.n, counted=not (made and bound.compiles_kernels))
        if race.decided is not None and races.get(key) is race:
            del races[key]
            bound.tuned_rows[key] = (race.decided, race.measured())

    why = f"racing chunk sizes on the calls, its result kept: {race.measured() or 'first'}"
    return _sized(plan, spec.n, size, why), report


def _sized(plan: P, n: int, size: int, why: str) -> P:
    if size >= plan.chunk_size:
        return dataclasses.replace(plan, reason=f"{plan.reason}; {why}")
    # a size of the ladder: the planned one over powers of 4, and the planned one fits the
    # rows, so the last chunk's padding stays small
    return dataclasses.replace(plan, chunk_size=size, n_chunks=-(-n // size),
                               reason=f"{plan.reason.split('; chunks of')[0]}; chunks of {size} "
                                      f"rows ({why})")


class RowsRace:
    """The ladder of chunk sizes, raced on the user's calls: each call of the race computes
    all its rows in chunks of one size, its results the call's, and its seconds per row are
    that size's sample (the copies into the result and the padding of the last chunk
    included, as the user's calls pay them). A call that compiled its size's kernel is not
    counted. The sizes descend from the planned one by ``ROWS_STEP``, each timed on
    ``TIMED_RUNS`` calls, until a size is ``STOP_RATIO`` times slower per row than the best
    so far (at its first call already: each call of a slow size costs a whole call's rows)
    or the next would be under ``MIN_TUNED_ROWS``; then, where a
    smaller size was fastest (the largest within ``NEAR`` of the fastest: :func:`_pick`),
    ``CONFIRM_RUNS`` more calls of the planned size and of it, in turn, and the medians
    decide by ``ROWS_MARGIN`` (:func:`chooser.winner`). The race costs the smaller sizes'
    compilations and what their calls lose while slower, never a computation nobody uses."""

    def __init__(self, planned: int) -> None:
        self.planned = planned
        self.samples: dict[int, list[float]] = {planned: []}
        #: the sizes still to run in turn before the decision (the last phase)
        self.confirming: list[int] | None = None
        self.decided: int | None = None

    def next(self) -> int:
        """The size the next call of the race runs."""
        if self.decided is not None:
            return self.decided
        if self.confirming:
            return self.confirming[0]
        return list(self.samples)[-1]

    def record(self, size: int, per_row: float, *, counted: bool = True) -> None:
        """A call of ``size`` rows a chunk took ``per_row`` seconds a row."""
        if not counted or self.decided is not None or size != self.next():
            return  # (a compilation's call; or a call another thread planned before)
        self.samples[size].append(per_row)
        if self.confirming is not None:
            self.confirming.pop(0)
            if not self.confirming:
                self.decided = chooser.winner(self.per_row(), self.planned, [self.fastest()],
                                              margin=ROWS_MARGIN)
            return
        per = self.per_row()
        slow = per[size] > STOP_RATIO * min(per.values())
        if len(self.samples[size]) < TIMED_RUNS and not slow:
            return  # (a size clearly slower at its first call ends the descent at once)
        smaller = size // ROWS_STEP
        if not slow and smaller >= MIN_TUNED_ROWS:
            self.samples[smaller] = []  # the descent goes on
            return
        fastest = self.fastest()
        if fastest == self.planned:
            self.decided = self.planned
        else:
            # the sizes were timed one after the other, on calls a busy machine may slow
            # unevenly: the two that decide again, in turn (a slow spell on the smaller sizes'
            # turn once kept the planned one; docs/thresholds.md, CONFIRM_RUNS)
            self.confirming = [self.planned, fastest] * CONFIRM_RUNS

    def per_row(self) -> dict[int, float]:
        """The median seconds per row of each size timed."""
        return {s: float(np.median(t)) for s, t in self.samples.items() if t}

    def fastest(self) -> int:
        return _pick(self.per_row())

    def measured(self) -> str:
        return ", ".join(f"{s} rows {t * 1e6:.2f} us" for s, t in self.per_row().items())


def _pick(per_row: dict[int, float]) -> int:
    """The largest size within NEAR of the fastest per row: each chunk costs the runner some
    work the timing leaves out (slicing, padding, the copy's call): docs/thresholds.md, NEAR."""
    best = min(per_row.values())
    return max(s for s, t in per_row.items() if t <= (1 + NEAR) * best)
