"""The one chooser between builds: the state machine of a kernel's first call and of its
later race, the timing race, and the one margin rule every race decides by.

A kernel (a compiled function over chunks, :class:`batchjac._backends.Kernel`) may compute in
several builds (TensorFlow's XLA and plain graph, JAX's compiler options and blocks, PyTorch's
vmap and plain-autograd passes, the second-order rule sets). Each backend declares its builds
as :class:`Build` records and how to make, run and select one (the hooks of
:class:`~batchjac._backends.Kernel`); this module decides between them, the same way for all.
A kernel's first call (:func:`first_call`) takes the first of:

1. **fixed**: a build fixed with ``use`` (a store's record, a remembered decision) runs, untimed;
2. **known**: a build a race chose for another chunk size of the same model
   (``Kernel.known``) runs, untimed: the ladder of chunk sizes compares sizes on one build;
3. **only**: a kernel with one build runs it;
4. **race**: where the call's budget repays it (:class:`~batchjac._backends._base.CallBudget`,
   set by the tuning policy, :mod:`batchjac._tune.policy`), the builds are timed on the call's own
   rows (:func:`race_builds`) and the fastest kept by the stages of :func:`pick`;
5. **untimed**: else the kernel's cheapest build to make runs (``Kernel.untimed_first``), and
   the kernel is marked untimed: :func:`retune` runs the race later, once the work seen repays
   it (called by ``policy.settle``).

A build remembered by an earlier process enters as *fixed* (``policy.recall_variant``), or,
where it costs more to make than the cheap first one, replaces it once the work repays that.

The later race of a kernel that declares ``races_on_calls`` runs on the user's calls, not on
rows whose results are thrown away (:class:`CallRace`): once the work repays making its
contenders, :func:`retune` makes them, and each of the next calls runs one contender, in turn,
its result kept; the call's time is the contender's timing. The race costs the contenders'
making and whatever a slower contender's calls lose, never a computation nobody uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

#: how much faster than the build in use a challenger must time to replace it, in every race
#: of builds: a race's timings are a few calls' medians on a shared machine, and a switch on a
#: smaller difference is as likely noise as gain
MARGIN = 0.05

Step = Literal["fixed", "only", "race", "untimed"]
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Build:
    """One way a kernel computes its result: what the chooser picks from.

    ``stage``: when the build enters a race. Stage 0 is the incumbent, the build that runs
    without a race (at most one a kernel); each later stage's builds challenge the build the
    stages before kept (:func:`pick`). A kernel whose builds are all of one stage has no fixed
    incumbent: the one it runs untimed defends (``Kernel.incumbent``)."""

    name: str
    stage: int = 1


def pick(times: dict[str, float], builds: Sequence[Build], incumbent: str) -> str:
    """The build kept after a race: ``incumbent``, replaced at each stage (in order) by the
    fastest of the stage's builds where it beats the one kept by :data:`MARGIN`."""
    best = incumbent
    for stage in sorted({b.stage for b in builds if b.stage > 0}):
        best = winner(times, best, [b.name for b in builds if b.stage == stage])
    return best


def first_call(kernel: Any, u: Any, ctx: tuple[Any, ...], budget: Any) -> None:
    """Choose the build of ``kernel``'s first call, on its rows ``(u, ctx)``, and select it:
    the order of this module's docstring."""
    step = first_step(kernel, budget)
    if step == "fixed":
        kernel.take(kernel.fixed, kernel._forced_why, u, ctx)
        return
    known = kernel.known
    if known is not None and known in kernel.variants:
        kernel.take(known, "as timed for another chunk size", u, ctx)
        return
    if step == "only":
        kernel._select(kernel.variants[0], "")
    elif step == "race":
        race_builds(kernel, u, ctx)
    else:
        chosen = kernel.untimed_first(u, ctx, budget)
        if chosen is not None:  # (None: the kernel chose already, e.g. its only working build)
            name, note, later = chosen
            kernel._select(name, note)
            kernel.untimed = later


def retune(kernel: Any, u: Any, ctx: tuple[Any, ...]) -> None:
    """The race an untimed first call skipped, on ``(u, ctx)``, once the work repays it: timed
    now, or, for a kernel that ``races_on_calls``, its contenders made now and timed on the
    next calls (:class:`CallRace`)."""
    if not kernel.untimed or kernel.fixed is not None or not kernel.retunable:
        return
    kernel.untimed = False
    with kernel.timing(u, ctx) as (u, ctx):
        if not getattr(kernel, "races_on_calls", False):
            race_builds(kernel, u, ctx)
            return
        u, ctx = kernel.race_inputs(u, ctx)
        names = kernel.contenders_beside(u, ctx) or kernel.contenders(u, ctx)
        if len(names) >= 2:
            kernel.call_race = CallRace([kernel.build(name) for name in names],
                                        kernel.incumbent(names),
                                        prune=kernel.race_options.get("prune"),
                                        before=kernel.variant)


@dataclass
class CallRace:
    """A race whose rounds are the user's calls (:func:`before_call`, :func:`after_call`):
    each call runs one contender, in turn, and its result is the call's. A contender's first
    call is not counted (a new executable's first run pays for its page faults); then each is
    timed at least :attr:`SAMPLES` times, and the calls go on, in turn, until they add up to
    :attr:`SECONDS` or :attr:`MAX_SAMPLES` a contender. The medians decide, by the stages of
    :func:`pick`. With ``prune``, a contender slower than ``prune`` times the fastest leaves
    the race: at its first counted call where calls take :data:`SLOW_CALL` or more, else by
    the best of its first two (a fresh executable's second run can still be slow). A
    contender that fails on a call leaves the race, and that call is answered again by the
    build in use ``before`` the race (which has answered calls already): no contender is run
    beforehand to see whether it works."""

    builds: list[Build]
    incumbent: str
    prune: float | None = None
    before: str | None = None
    SAMPLES = 3
    MAX_SAMPLES = 15
    SECONDS = 0.1

    def __post_init__(self) -> None:
        self.samples: dict[str, list[float]] = {b.name: [] for b in self.builds}
        self.warm: set[str] = set()
        self.out: set[str] = set()  # pruned
        self.spent = 0.0

    def next(self, ready: Callable[[str], bool] = lambda name: True) -> str | None:
        """The contender the next call runs, once every contender left is ``ready`` (made: a
        kernel may make its contenders beside the calls, the incumbent of the race's stages
        among them); None before: a call timed while another build compiles beside it shares
        the cores with that compilation, and the builds timed first would lose to those timed
        after."""
        live = [name for name in self.samples if name not in self.out]
        if not all(ready(name) for name in live):
            return None
        cold = [name for name in live if name not in self.warm]
        if cold:
            return cold[0]
        return min(live, key=lambda name: len(self.samples[name]))

    def record(self, name: str, seconds: float) -> None:
        self.spent += seconds
        if name not in self.warm:
            self.warm.add(name)
            return
        self.samples[name].append(seconds)
        live = [n for n in self.samples if n not in self.out]
        if self.prune is None or not all(self.samples[n] for n in live):
            return
        fastest = {n: min(self.samples[n]) for n in live}
        floor = min(fastest.values())
        if floor < SLOW_CALL and any(len(self.samples[n]) < 2 for n in live):
            return  # (fast calls: the best of two each, as race's best of three)
        self.out |= {n for n in live if fastest[n] > self.prune * floor and n != self.incumbent}

    def drop(self, name: str) -> bool:
        """Contender ``name`` failed on a call: it leaves the race (the incumbent's place goes
        to the build in use before). False where it is that build: its failure is the call's."""
        if name == self.before or name not in self.samples:
            return False
        self.out.add(name)
        if name == self.incumbent and self.before is not None:
            self.incumbent = self.before
        return True

    @property
    def done(self) -> bool:
        counts = [len(t) for n, t in self.samples.items() if n not in self.out]
        if len(counts) < 2:
            return True
        return min(counts) >= self.SAMPLES and (self.spent >= self.SECONDS
                                                or min(counts) >= self.MAX_SAMPLES)

    def times(self) -> dict[str, float]:
        """The median call of each contender timed (pruned ones: their first timing)."""
        return {n: float(np.median(t)) for n, t in self.samples.items() if t}

    def result(self) -> str:
        live = {n: t for n, t in self.times().items() if n not in self.out}
        if self.incumbent not in live:  # (a race the failures ended before it timed it)
            return self.incumbent
        return pick(live, self.builds, self.incumbent)


def before_call(kernel: Any) -> str | None:
    """Before a call of ``kernel``: the contender it runs, selected, where a race rides on its
    calls and its contenders are made; else None."""
    race_ = getattr(kernel, "call_race", None)
    if race_ is None:
        return None
    with kernel.building:
        name = race_.next(kernel.ready)
        if name is not None:  # (else the build in use runs, untimed)
            kernel._select(name, f"{name} (racing on the calls)")
    return name


def calls_race_now(kernel: Any) -> bool:
    """Whether a race rides on ``kernel``'s calls and its next call runs a contender (they
    are made): the calls before, on the build in use, are untimed."""
    race_ = getattr(kernel, "call_race", None)
    return race_ is not None and race_.next(kernel.ready) is not None


def failed_call(kernel: Any, name: str | None, error: BaseException) -> bool:
    """A call of contender ``name`` raised ``error``: True where it left the race (the kernel
    told, :meth:`~batchjac._backends.Kernel.left_race`) and the build in use before it is
    selected again, to answer the call; False where the failure is the call's (no race, or
    the build in use failed)."""
    race_ = getattr(kernel, "call_race", None)
    if name is None or race_ is None:
        return False
    with kernel.building:
        if not race_.drop(name):
            return False
        assert race_.before is not None
        kernel.left_race(name, error)
        kernel._select(race_.before, f"{race_.before} ({name} failed for this model)")
        _finish(kernel, race_)
    return True


def after_call(kernel: Any, name: str | None, seconds: float) -> None:
    """After that call, its time: the race decides once it has seen enough. A contender the
    kernel no longer offers (it failed inside the call, and the kernel answered with another
    build: TensorFlow's XLA that cannot compile the model) leaves the race, its time unrecorded."""
    race_ = getattr(kernel, "call_race", None)
    if name is None or race_ is None:
        return
    with kernel.building:
        if name in kernel.variants:
            race_.record(name, seconds)
        for gone in [n for n in race_.samples if n not in kernel.variants]:
            race_.drop(gone)
        _finish(kernel, race_)


def _finish(kernel: Any, race_: CallRace) -> None:
    """The race's decision, once it has seen enough (under ``kernel.building``)."""
    if race_.done and kernel.call_race is race_:
        kernel.call_race = None
        kernel.raced_to(race_.result(), race_.times(), None)
        kernel.raced = True


def race_builds(kernel: Any, u: Any, ctx: tuple[Any, ...]) -> None:
    """Time ``kernel``'s builds on ``(u, ctx)`` and select the one :func:`pick` keeps. The
    kernel makes and warms up its contenders first (``Kernel.contenders``), dropping those
    that fail for this model; where fewer than two are left it has selected one already."""
    u, ctx = kernel.race_inputs(u, ctx)
    names = kernel.contenders(u, ctx)
    if len(names) < 2:
        return
    builds = [kernel.build(name) for name in names]
    incumbent = kernel.incumbent(names)  # (before the race: running a build may select it)
    times = race(lambda name: kernel.run_build(name, u, ctx), names, **kernel.race_options)
    kernel.raced_to(pick(times, builds, incumbent), times, u)


def first_step(kernel: Any, budget: Any, builds: int | None = None) -> Step:
    """What a kernel's first call does (the order above); ``builds``: how many it has where
    that is not ``len(kernel.variants)``."""
    if kernel.fixed is not None:
        return "fixed"
    if (len(kernel.variants) if builds is None else builds) < 2:
        return "only"
    return "race" if budget.may_race else "untimed"


def winner(times: dict[K, float], incumbent: K, challengers: Iterable[K] | None = None,
           margin: float | None = None) -> K:
    """The fastest of ``challengers`` (default: every other name timed) where it beats
    ``incumbent`` by ``margin``; else ``incumbent``. The incumbent is what runs without the
    race: a kernel's default build or the one a previous stage of the race kept, the cost
    model's mode, the planned chunk size. ``margin`` other than :data:`MARGIN` (the default)
    only where a switch costs more than the timing sees (the copies of a chunked result)."""
    margin = MARGIN if margin is None else margin
    rivals = [name for name in (times if challengers is None else challengers)
              if name != incumbent and name in times]
    if not rivals:
        return incumbent
    fastest = min(rivals, key=lambda name: times[name])
    return fastest if times[fastest] < (1 - margin) * times[incumbent] else incumbent


def timings(times: dict[str, float], names: Iterable[str] | None = None) -> str:
    """``name 1.23 ms, ...`` for a kernel's note (``explain=True``)."""
    return ", ".join(f"{name} {times[name] * 1e3:.2f} ms" for name in (names or times))


#: a call or run this long is slow: a race prunes on its first timing (shorter ones: the best
#: of a few first)
SLOW_CALL = 0.05
#: the runs :func:`race` gives each contender when a run takes 50 ms or more and none is
#: pruned: a first, a second (the best of the two), and two rounds
SLOW_RUNS = 4


def race(run: Callable[[str], object], names: Iterable[str], *, prune: float | None = None,
         round_seconds: float = 0.005, timing_seconds: float = 0.25, max_rounds: int = 7
         ) -> dict[str, float]:
    """Seconds per call of each implementation ``run(name)`` (a call that returns when the
    work is done; the kernel has made and warmed each), for choosing between kernel builds.
    First the best of a few calls each (three when all take under 50 ms: a fresh build's
    first calls are slow); with ``prune``, those slower than ``prune`` times the fastest keep
    that figure and are not raced (a slow chunk makes each round dear: where a run takes 50 ms
    or more, the first run prunes already). Then interleaved rounds (drifting load hits all
    alike) of back-to-back calls (several when a call is fast: about ``round_seconds`` a
    round), at least 2 and at most ``max_rounds`` rounds, about ``timing_seconds`` in all; the
    median of the rounds' means, which is what a loop of calls gets, thread wake-ups and all."""
    live = list(names)

    def timed(name: str) -> float:
        start = time.perf_counter()
        run(name)
        return time.perf_counter() - start

    def pruned() -> list[str]:
        if prune is None:
            return live
        return [name for name in live if times[name] <= prune * min(times.values())]

    times = {name: timed(name) for name in live}
    slow = max(times.values()) >= SLOW_CALL
    if slow:
        live = pruned()
    for _ in range(1 if slow else 2):
        times.update({name: min(times[name], timed(name)) for name in live})
    live = pruned()
    if len(live) < 2:
        return times
    slowest = max(times[name] for name in live)
    inner = max(1, int(round_seconds / max(slowest, 1e-9)))
    rounds = int(min(max_rounds, max(2, timing_seconds / (len(live) * inner * slowest))))
    means: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(rounds):
        for name in live:
            start = time.perf_counter()
            for _ in range(inner):
                run(name)
            means[name].append((time.perf_counter() - start) / inner)
    return {**times, **{name: float(np.median(t)) for name, t in means.items()}}
