"""The one chooser between builds: the order of a kernel's first call, the timing race and the
one margin rule every race decides by.

A kernel (a compiled function over chunks, :class:`batchjac._backends.Kernel`) may compute in
several builds (TensorFlow's XLA and plain graph, JAX's compiler options and blocks, PyTorch's
vmap and plain-autograd passes, the second-order rule sets). Each backend declares what its
builds are and how to run one; this module decides between them, the same way for all:

1. **fixed**: a build fixed with ``use`` (a store's record, a remembered decision) runs, untimed;
2. **only**: a kernel with one build runs it;
3. **race**: where the call's budget repays it (:class:`~batchjac._backends._base.CallBudget`,
   set by the tuning policy, :mod:`batchjac._tune.policy`), the builds are timed on the call's own
   rows (:func:`race`) and the fastest kept by :func:`winner`;
4. **untimed**: else the cheapest build to make runs, and the kernel is marked untimed: the
   race runs later, once the work seen repays it (``retune``, called by ``_tuning.settle``).

A build remembered by an earlier process enters as *fixed* (``_tuning.recall_variant``), or,
where it costs more to make than the cheap first one, replaces it once the work repays that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Literal, TypeVar

import numpy as np

#: how much faster than the build in use a challenger must time to replace it, in every race
#: of builds: a race's timings are a few calls' medians on a shared machine, and a switch on a
#: smaller difference is as likely noise as gain
MARGIN = 0.05

Step = Literal["fixed", "only", "race", "untimed"]
K = TypeVar("K", bound=Hashable)


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
    only where a switch costs more than the timing sees (the mode race, the copies of a
    chunked result)."""
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


def race(run: Callable[[str], object], names: Iterable[str], *, prune: float | None = None,
         round_seconds: float = 0.005, timing_seconds: float = 0.25, max_rounds: int = 7
         ) -> dict[str, float]:
    """Seconds per call of each implementation ``run(name)`` (a call that returns when the
    work is done), for choosing between kernel builds. First the best of a few calls each
    (three when all take under 50 ms: a fresh build's first calls are slow); with ``prune``,
    those slower than ``prune`` times the fastest keep that figure and are not raced (a slow
    chunk makes each round dear). Then interleaved rounds (drifting load hits all alike) of
    back-to-back calls (several when a call is fast: about ``round_seconds`` a round), at
    least 2 and at most ``max_rounds`` rounds, about ``timing_seconds`` in all; the median of
    the rounds' means, which is what a loop of calls gets, thread wake-ups and all."""
    names = list(names)

    def timed(name: str) -> float:
        start = time.perf_counter()
        run(name)
        return time.perf_counter() - start

    times = {name: timed(name) for name in names}
    for _ in range(2 if max(times.values()) < 0.05 else 1):
        times = {name: min(t, timed(name)) for name, t in times.items()}
    if prune is not None:
        names = [name for name in names if times[name] <= prune * min(times.values())]
    if len(names) < 2:
        return times
    slowest = max(times[name] for name in names)
    inner = max(1, int(round_seconds / max(slowest, 1e-9)))
    rounds = int(min(max_rounds, max(2, timing_seconds / (len(names) * inner * slowest))))
    means: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            start = time.perf_counter()
            for _ in range(inner):
                run(name)
            means[name].append((time.perf_counter() - start) / inner)
    return {**times, **{name: float(np.median(t)) for name, t in means.items()}}
