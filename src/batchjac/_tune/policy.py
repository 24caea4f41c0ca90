"""When a timing race is worth its cost: the rule every tuning decision follows.

The user of the original question calls once. A race (forward against reverse mode, a ladder
of chunk sizes, the builds of one kernel such as XLA against a plain TensorFlow graph) costs
compilations and timed runs, and can save at most a fraction of the work it speeds up. So a
race is run only when that fraction of the work at hand (this call's rows plus the work already
seen with the same bound model) exceeds the race's estimated cost; otherwise the cost model's
choice, and each kernel's default build, run untimed. Repeated calls accumulate work in the
bound model's :class:`Ledger`, and once it warrants a race the race runs, once, as a JIT tiers
up a hot function (the ski-rental rule: pay for tuning once the rent already paid matches it,
which never costs more than twice the better of the two choices made in hindsight).

Costs are estimated from what was measured: the first call of a new kernel (compilation plus
one chunk) prices one more compilation; the ledger's seconds per row price the work. A model
with no measurement yet is never raced. ``BATCHJAC_AUTOTUNE=off`` turns every race off.

A kernel's first call races its builds only where the call's budget says it may
(:class:`~batchjac._backends._base.CallBudget`, made by :func:`timed` and passed to the kernel's
calls): whether the call at hand may pay for it.

Every decision a race takes (the mode for a chunk size, the chunk size for a plan, a kernel's
build) is written to the on-disk cache (:mod:`batchjac._tune.cache`), keyed by the model's
computation (not its weights), the batch signature, the versions and the machine, and read
back by the first call of a later process: that call runs the tuned kernel, with one
compilation, and never races on this machine again. Stores never read it: their kernel is the
one recorded in their manifest.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._backends._base import UNTUNED, CallBudget
from .._config import autotune_enabled
from .._plan import Plan
from . import chooser
from .state import Ledger as Ledger

T = TypeVar("T")

#: the largest fraction of the work a race is assumed to save (the best choice measured was
#: twice as fast as the cost model's: docs/thresholds.md)
MAX_GAIN = 0.5
#: a race's timed runs, beyond its compilations, in seconds (mode and build races time a
#: chunk a handful of times: ~0.1-0.3 s)
TIMING_SECONDS = 0.25



def ledger(bound: Any) -> Ledger:
    """The ledger of ``bound``'s Jacobian calls, or ``bound`` itself where it is a ledger (the
    second-order calls pass theirs, :attr:`TuningState.second`)."""
    return bound if isinstance(bound, Ledger) else bound.tuning.ledger  # type: ignore[no-any-return]


def record(bound: Any, rows: int, seconds: float, *, new_kernel: bool) -> None:
    """A finished computation of ``rows`` rows that took ``seconds``; ``new_kernel`` when it
    included a kernel's first call (its compilation)."""
    book = ledger(bound)
    if new_kernel:
        book.compile_seconds = max(book.compile_seconds, seconds)
        book.first_rows = max(book.first_rows, rows)
    else:
        book.rows += rows
        book.seconds += seconds


# -- decisions remembered on disk ---------------------------------------------------------------

_MODES = {"mode": {"forward", "reverse"}}


def _key(bound: Any, backend: str, what: str, shape: str) -> Any:
    from .cache import TuneKey, default_cache

    cache = default_cache()
    if not cache.enabled:
        return None, None
    state = bound.tuning
    fingerprint = state.computation
    if fingerprint is None:
        from .._fingerprint import computation_fingerprint

        model = state.source() if state.source is not None else None
        fingerprint = state.computation = computation_fingerprint(model) if model is not None else ""
    if not fingerprint:
        return None, None
    return cache, TuneKey.make(fingerprint, repr(bound.signature), what, shape, framework=backend)


def recall(bound: Any, backend: str, plan: Plan, with_outputs: bool) -> None:
    """Fill the bound model's tuning tables from the disk cache for this plan: the mode for
    its chunk size, and the chunk size for its mode (races later calls would run)."""
    if not autotune_enabled():
        return
    mode_key = (plan.chunk_size, with_outputs)
    if plan.uncertain and mode_key not in bound.tuned:
        cache, key = _key(bound, backend, "mode", f"{plan.chunk_size}/{int(with_outputs)}")
        found = cache.get(key, validate=_MODES) if key is not None else None
        if found is not None:
            bound.tuned[mode_key] = (found["mode"], f"remembered: {found.get('timings', '')}")
            _persisted(bound).add(("mode", mode_key))


def recall_rows(bound: Any, backend: str, plan: Any, with_outputs: bool, *,
                mode: str | None = None) -> None:
    """Fill the bound model's table of chunk sizes from the disk cache for this plan;
    ``mode`` names the kernels where they are not the plan's Jacobian kernels (a Hessian's)."""
    name = plan.mode if mode is None else mode
    rows_key = ("rows", name, plan.chunk_size, with_outputs)
    if not autotune_enabled() or rows_key in bound.tuned_rows:
        return
    cache, key = _key(bound, backend, "rows", f"{name}/{plan.chunk_size}/{int(with_outputs)}")
    found = cache.get(key, validate={"chunk_size": int}) if key is not None else None
    if found is not None and 0 < found["chunk_size"] <= plan.chunk_size:
        bound.tuned_rows[rows_key] = (found["chunk_size"], f"remembered: {found.get('timings', '')}")
        _persisted(bound).add(rows_key)


def recalled(bound: Any, backend: str, mode: str, chunk_size: int, with_outputs: bool,
             variants: Any = str) -> dict[str, Any] | None:
    """The build an earlier race chose for the kernel of this mode, chunk size and outputs
    flag (``{"variant": ..., "timings": ...}``), from the disk cache; None if none did (or
    if it is not one of ``variants``: the cache's one warning says so)."""
    if not autotune_enabled():
        return None
    cache, key = _key(bound, backend, "variant", f"{mode}/{chunk_size}/{int(with_outputs)}")
    found = cache.get(key, validate={"variant": variants}) if key is not None else None
    return found  # type: ignore[no-any-return]


def recall_variant(bound: Any, backend: str, kernel: Any, found: Any = ...) -> None:
    """Before a kernel's first call: the build an earlier race chose, fixed (one compilation);
    ``found`` is what :func:`recalled` read for it already, where it did."""
    if not autotune_enabled() or len(kernel.variants) < 2 or kernel.variant is not None:
        return
    if found is ... or (found is not None and found["variant"] not in kernel.variants):
        # (read here, or again: a variant this kernel lacks is ignored with the cache's warning)
        found = recalled(bound, backend, kernel.tune_name, kernel.chunk_size, kernel.with_outputs,
                         variants=set(kernel.variants))
    if found is None:
        return
    why = f"remembered: {found.get('timings', '')}"
    cheap = getattr(kernel, "cheap_first", None)
    if cheap is not None and found["variant"] != cheap:
        # a faster build that costs more to make (TensorFlow's XLA against its graph: see
        # docs/thresholds.md): the first call takes the cheap one, and the remembered one replaces
        # it once the work repays one more build (settle), without a race
        kernel.remembered = (found["variant"], why)
        return
    kernel.use(found["variant"], why=why)


def persist(bound: Any, backend: str, kernel: Any | None = None) -> None:
    """Write the decisions races took on this bound model (and ``kernel``'s build) to disk."""
    done = _persisted(bound)
    for (size, wo), (mode, timings) in list(bound.tuned.items()):
        if ("mode", (size, wo)) not in done:
            done.add(("mode", (size, wo)))
            cache, key = _key(bound, backend, "mode", f"{size}/{int(wo)}")
            if key is not None:
                cache.put(key, {"mode": mode, "timings": timings})
    for rows_key, (best, timings) in list(bound.tuned_rows.items()):
        if rows_key not in done:
            done.add(rows_key)
            _, mode, size, wo = rows_key
            cache, key = _key(bound, backend, "rows", f"{mode}/{size}/{int(wo)}")
            if key is not None:
                cache.put(key, {"chunk_size": int(best), "timings": timings})
    if kernel is not None and getattr(kernel, "raced", False) and ("variant", id(kernel)) not in done:
        done.add(("variant", id(kernel)))
        cache, key = _key(bound, backend, "variant",
                          f"{kernel.tune_name}/{kernel.chunk_size}/{int(kernel.with_outputs)}")
        if key is not None and kernel.variant is not None:
            cache.put(key, {"variant": kernel.variant, "timings": kernel.note})


def recall_probes(bound: Any, backend: str) -> bool:
    """The verdict of the probes (passed, the output shape, and the working set of a row where
    the backend estimated it) an earlier process found for this model's computation and
    signature: connectivity, row independence, the output shape and the arrays a row holds are
    properties of the computation, not of the weights. True when found."""
    if not autotune_enabled():
        return False
    cache, key = _key(bound, backend, "probes", "")
    found = cache.get(key, validate={"output_shape": list}) if key is not None else None
    if found is None or not all(isinstance(s, int) and s >= 0 for s in found["output_shape"]):
        return False
    bound.output_shape = tuple(found["output_shape"])
    row_bytes = found.get("row_bytes")
    if isinstance(row_bytes, (int, float)) and not isinstance(row_bytes, bool) and row_bytes > 0:
        bound.row_bytes = float(row_bytes)
    bound.probed = True
    return True


def persist_probes(bound: Any, backend: str, *,
                   later: Callable[..., object] | None = None) -> None:
    """Write the probes' verdict; with ``later`` (an executor's ``submit``), the file is
    written there, into the cache directory of this moment."""
    if not autotune_enabled() or bound.output_shape is None:
        return
    cache, key = _key(bound, backend, "probes", "")
    if key is not None:
        decision: dict[str, Any] = {"output_shape": [int(s) for s in bound.output_shape]}
        if bound.row_bytes is not None:  # the planner's estimate, read by a later process
            decision["row_bytes"] = float(bound.row_bytes)
        if later is None:
            cache.put(key, decision)
        else:
            later(cache.put, key, decision)


def pending(bound: Any) -> bool:
    """Whether a race is still to come for ``bound`` as its work grows (one its last call
    skipped, in the ledger of its Jacobian calls or of its second-order calls) or rides on its
    calls now: the benchmark's steady state is measured once none is."""
    return any(book.next_check < math.inf for book in (bound.tuning.ledger, bound.tuning.second)) \
        or bool(bound.tuning.rows_races) or bool(bound.tuning.mode_races) \
        or any(getattr(k, "call_race", None) is not None for k in bound.kernels())


def racing_on_calls(bound: Any) -> bool:
    """Whether a race of ``bound``'s chunk sizes or modes runs on its calls now (the full path
    times them): not while the kernel a race of modes needs is made beside the calls."""
    state = bound.tuning
    return bool(state.rows_races) or any(race.ready() for race in state.mode_races.values())


def _persisted(bound: Any) -> set[Any]:
    """The decisions of ``bound`` that are on disk already (read from it, or written)."""
    return bound.tuning.persisted  # type: ignore[no-any-return]


def repeated(bound: Any, rows: int, seconds: float) -> bool:
    """Record a repeated call (the fast path's); True when a race skipped so far is now due."""
    book = ledger(bound)
    book.rows += rows
    book.seconds += seconds
    return book.seconds >= book.next_check


def begin(bound: Any) -> None:
    """A call through the full path: the races it skips set the next check anew."""
    ledger(bound).next_check = math.inf


def race_cost(bound: Any, compilations: float, timing: float = TIMING_SECONDS) -> float | None:
    """The estimated seconds of a race that compiles ``compilations`` more kernels and times
    them for ``timing`` seconds; None when nothing has been measured yet."""
    book = ledger(bound)
    if not book.compile_seconds:
        return None
    return compilations * book.compile_seconds + timing


def calls_timing(bound: Any, rows: int, calls: int) -> float:
    """What the timed calls of a race on the user's calls cost: at most ``calls`` calls of
    ``rows`` rows each lost to a slower contender (their results are kept: a contender as
    slow again loses one call's time), at the ledger's seconds per row; the fixed
    :data:`TIMING_SECONDS` before any is measured."""
    per_row = ledger(bound).seconds_per_row
    return TIMING_SECONDS if per_row is None else calls * rows * per_row


def worth(bound: Any, rows: int, compilations: float, timing: float = TIMING_SECONDS) -> bool:
    """Whether a race compiling ``compilations`` kernels (and timing them for ``timing``
    seconds) pays for itself on ``rows`` rows to come plus the work already seen with this
    bound model."""
    if not autotune_enabled():
        return False
    book = ledger(bound)
    cost = race_cost(bound, compilations, timing)
    per_row = book.seconds_per_row
    if cost is None or per_row is None or not book.rows:  # no steady call measured yet:
        book.next_check = 0.0  # the next call (with a measurement) decides
        return False
    if MAX_GAIN * (book.seconds + rows * per_row) > cost:
        return True
    # not yet: the work at which it will be (the fast path watches for it)
    book.next_check = min(book.next_check, cost / MAX_GAIN - rows * per_row)
    return False


def reuse(bound: Any, plan: Plan, n: int, with_outputs: bool) -> Plan:
    """The plan on a chunk size whose kernel exists already, when its padding costs less than
    compiling the planned size: a call with a new N (999 after 1,000, 37, 5,000) runs on the
    kernels compiled for earlier calls. The padding wasted per batch size is added up, and
    once it matches a compilation the planned size is compiled after all."""
    if bound.has_kernel(plan.mode, plan.chunk_size, with_outputs) or not n:
        return plan
    if not bound.compiles_kernels:  # an eager framework: a kernel of any size is free to make
        return plan
    book = ledger(bound)
    per_row = book.seconds_per_row
    if per_row is None or not book.compile_seconds:
        return plan
    options = [(-(-n // size) * size - n, size) for size in bound.kernel_sizes(plan.mode, with_outputs)
               if plan.budget_rows is None or size <= max(plan.budget_rows, plan.chunk_size)]
    if not options:  # (a size over this call's memory budget is not reused)
        return plan
    padded, size = min(options)
    waste = padded * per_row
    if book.waste.get(n, 0.0) + waste >= book.compile_seconds:
        return plan  # the padding has cost a compilation: this size gets its own kernel
    book.waste[n] = book.waste.get(n, 0.0) + waste
    chunks = -(-n // size)
    return dataclasses.replace(
        plan, chunk_size=size, n_chunks=chunks,
        reason=f"{plan.reason.split('; chunks of')[0]}; chunks of {size} rows (a compiled kernel "
               f"reused: padding {chunks * size - n} rows costs less than compiling {plan.chunk_size})")


def timed(bound: Any, kernel: Any, rows: int, run: Callable[[CallBudget], T], *, new: bool,
          built_seconds: float = 0.0, budget: CallBudget = UNTUNED) -> T:
    """Run the computation of ``rows`` rows on ``kernel`` (``run(budget)``, the kernel called
    with that budget) and record its time (with the ``built_seconds`` its construction took,
    for a ``new`` kernel: JAX compiles there); its first call may race the kernel's builds
    only when the work seen repays it. ``budget``: what the call says (its mode asked for),
    which the kernel's calls carry."""
    remembered = getattr(kernel, "remembered", None)
    if remembered is not None and kernel.variant is None and worth(bound, rows, 1):
        kernel.remembered = None  # this call repays the build an earlier race chose
        kernel.use(*remembered)
    builds = max(0, len(kernel.variants) - 1)
    race = kernel.variant is None and builds > 0 and kernel.fixed is None and \
        worth(bound, rows, builds)
    racing = chooser.before_call(kernel)  # (a race riding on the calls: this one's contender)
    called = dataclasses.replace(budget, rows=rows, race=race)
    with Stopwatch() as watch:
        try:
            out = run(called)
        except Exception as e:
            # (the runner's boundary wraps the framework's error: the kernel reads the cause)
            if not chooser.failed_call(kernel, racing, e.__cause__ or e):
                raise
            racing = None  # (answered again by the build in use before the race)
            out = run(called)
    chooser.after_call(kernel, racing, watch.seconds)
    record(bound, rows, watch.seconds + (built_seconds if new else 0.0), new_kernel=new)
    if race and not kernel.untimed:
        kernel.raced = True
    return out


def settle(bound: Any, kernel: Any, args: Callable[[], tuple[Any, Any]]) -> None:
    """After a call: race the builds a first call skipped, once the work seen repays it (or,
    where an earlier process raced them, take the build it chose, once the work repays one
    build)."""
    remembered = getattr(kernel, "remembered", None)
    if remembered is not None:
        if kernel.untimed and worth(bound, 0, min(1, kernel.race_compilations), 0.0):
            with kernel.building:
                if not kernel.make(remembered[0], args):  # (made beside the calls: not yet)
                    ledger(bound).next_check = 0.0  # the next call looks again
                    return
                kernel.remembered = None
                kernel.use(*remembered)
                kernel.untimed = False
        return
    if kernel.untimed and worth(bound, 0, kernel.race_compilations,
                                _timing(bound, kernel) + getattr(kernel, "race_setup_seconds", 0.0)):
        with kernel.building:  # (another thread's settle may have raced it meanwhile)
            if kernel.untimed:
                kernel.retune(*args())
                # (a race on the next calls decides later: chooser.after_call)
                kernel.raced = not kernel.untimed and kernel.call_race is None


def _timing(bound: Any, kernel: Any) -> float:
    """What the timed runs of ``kernel``'s later race cost. A race on one chunk (not riding
    on the calls): :data:`TIMING_SECONDS`, or, where a chunk is slow, the runs
    :func:`~batchjac._tune.chooser.race` gives each contender (``SLOW_RUNS``), each at least
    as long as a chunk in the build in use, the incumbent's included. A race riding on the
    calls (``races_on_calls``) whose contenders are made beside them (no compilation the calls
    wait for): only what its slower contenders' calls may lose, the calls each answers
    (``CallRace.SAMPLES`` and a first), each as long again as a chunk in the build in use.
    (Where the calls wait for compilations, JAX's beside them on cores they share, the fixed
    figure stands for what those slow down.)"""
    per_row = ledger(bound).seconds_per_row
    if per_row is None:
        return TIMING_SECONDS
    if not kernel.races_on_calls:  # (on the race's rows, where it takes fewer: race_rows)
        rows = min(kernel.chunk_size, getattr(kernel, "race_rows", None) or kernel.chunk_size)
        return max(TIMING_SECONDS, chooser.SLOW_RUNS * len(kernel.variants) * rows * per_row)
    if kernel.race_compilations:
        return TIMING_SECONDS
    return calls_timing(bound, kernel.chunk_size,
                        (chooser.CallRace.SAMPLES + 1) * max(1, len(kernel.variants) - 1))


class Stopwatch:
    """``with Stopwatch() as sw: ...; sw.seconds``."""

    seconds: float = 0.0

    def __enter__(self) -> Stopwatch:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
