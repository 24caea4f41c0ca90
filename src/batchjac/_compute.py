"""The one compute sequence of every derivative kind.

``jacobian`` and the second-order verbs (``hessian``, its diagonal, ``laplacian``, ``hvp``)
bind and probe the model and plan the call their own way (a mode, or an order of the two
differentiations); from there every call takes :func:`compute`: the plan fitted to the cache,
the races that pay for themselves (the mode, the ladder of chunk sizes), the kernel with the
build an earlier process chose, the run, the race its first call skipped once the work repays
it, and the decisions written to disk for the next process. What differs between the kinds
is data, a :class:`Derivative`: which kernel, which ledger, the name its decisions are kept
under, the passes and the bytes of a row.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from . import _backends
from ._backends._base import SECOND_RESULT, UNTUNED, CallBudget
from ._errors import InputError
from ._plan import Plan, SecondPlan, fit_cache, hessian_passes
from ._runner import pad_chunk
from ._spec import BatchSpec
from ._tune import policy as tuning
from ._tune.races import MODE_RUNS, ROWS_COMPILATIONS, Report, mode_plan, rows_plan
from ._tune.state import Ledger

log = logging.getLogger("batchjac")

P = TypeVar("P", Plan, SecondPlan)


@dataclass(frozen=True)
class Derivative:
    """What a call computes: ``"jacobian"``, or a second-order kind (its order is the plan's),
    with the outputs and (second order) the Jacobians of the same pass where asked."""

    kind: str
    with_outputs: bool
    with_jacobian: bool = False

    @property
    def first_order(self) -> bool:
        return self.kind == "jacobian"

    @property
    def result(self) -> str:
        """The name of the main result in a kernel's results."""
        return "jacobians" if self.first_order else SECOND_RESULT[self.kind]

    def ledger(self, bound: _backends.BoundModel) -> Ledger:
        """The work its races are priced by: a Hessian's seconds per row would price a
        Jacobian race wrongly, so the two kinds keep apart."""
        return bound.tuning.ledger if self.first_order else bound.tuning.second

    def name(self, plan: Plan | SecondPlan) -> str:
        """The name its kernels' decisions are kept under (the tuning tables, the disk)."""
        if isinstance(plan, Plan):
            return plan.mode
        return f"{self.kind}:{plan.order}:{int(self.with_jacobian)}"

    def kernel(self, bound: _backends.BoundModel, plan: Plan | SecondPlan, *,
               recalled: str | None = None, budget: CallBudget = UNTUNED,
               variant: str | None = None) -> _backends.Kernel:
        """The plan's kernel (made if new: ``recalled``, ``budget`` and ``variant`` as for
        :meth:`~batchjac._backends.BoundModel.kernel`)."""
        if isinstance(plan, Plan):
            return bound.kernel(plan.mode, plan.chunk_size, self.with_outputs, variant=variant,
                                recalled=recalled, budget=budget)
        kernel = bound.second_kernel(self.kind, plan.order, plan.chunk_size,  # type: ignore[arg-type]
                                     self.with_outputs, self.with_jacobian)
        if variant is not None and kernel.variant != variant and variant in kernel.variants:
            kernel.use(variant)
        return kernel

    def has_kernel(self, bound: _backends.BoundModel, plan: Plan | SecondPlan) -> bool:
        if isinstance(plan, Plan):
            return bound.has_kernel(plan.mode, plan.chunk_size, self.with_outputs)
        return bound.has_second_kernel(self.kind, plan.order,  # type: ignore[arg-type]
                                       plan.chunk_size, self.with_outputs, self.with_jacobian)

    def fit(self, bound: _backends.BoundModel, spec: BatchSpec, plan: P) -> P:
        """The plan's chunks cut to the cache (:func:`batchjac._plan.fit_cache`), for the kinds
        whose temporaries grow with the passes: a Jacobian's, a full Hessian's."""
        assert bound.output_shape is not None
        m = math.prod(bound.output_shape)
        item, k = spec.dtype.itemsize, spec.k
        if isinstance(plan, Plan):
            return fit_cache(plan, spec.n, row_bytes=bound.row_bytes,
                             passes=k if plan.mode == "forward" else m,
                             result_row_bytes=item * m * (k + self.with_outputs))
        if self.kind != "hessian":
            return plan
        return fit_cache(plan, spec.n, row_bytes=bound.row_bytes,
                         passes=hessian_passes(plan.order, k, m if bound.hessian_outputs_at_once else 1),
                         result_row_bytes=item * m * (k * k + k * self.with_jacobian + self.with_outputs))


def compute(bound: _backends.BoundModel, spec: BatchSpec, what: Derivative, plan: P, *,
            backend: str, rows_free: bool, run: Callable[[Any, P], Any],
            explain: bool, on_kernel: Callable[[P], object] | None = None,
            mode_asked: bool = False) -> Any:
    """``run(kernel, plan)`` on the kernel the tuning policy chooses for ``plan`` (as this
    call sees it: :meth:`~batchjac._backends.Kernel.under` its budget), timed into
    the ledger of ``what``; ``rows_free`` where the chunk size is the planner's to choose (no
    ``chunk_size=``, no ``out=`` array). ``on_kernel(plan)`` is told the plan taken, before the
    run (the fast path of repeated calls starts there). ``mode_asked``: the user asked for the
    plan's mode (:attr:`~batchjac._backends.CallBudget.mode_asked`): computed or refused."""
    book = what.ledger(bound)
    # what a kernel's first build weighs its cost against: this call's rows
    budget = CallBudget(rows=spec.n, mode_asked=mode_asked)
    plan, racing, planned = _choose(bound, spec, what, plan, book, budget, backend=backend,
                                    rows_free=rows_free)
    planned_build = planned.variant if planned is not None else None
    if racing is not None:
        # a contender of a race between plans: it builds what the race compares, and its
        # mode falling back to the other is no news to the user
        budget = dataclasses.replace(budget, plan_race=True)
    if explain:
        if bound.model_note:
            sys.stderr.write(f"batchjac: model: {bound.model_note}\n")
        sys.stderr.write(f"batchjac: {plan.reason}\n")
    log.debug("batchjac plan: %s", plan.reason)
    new = not what.has_kernel(bound, plan)
    # an earlier process's choice of build, which a new kernel may find compiled on disk
    found = tuning.recalled(bound, backend, what.name(plan), plan.chunk_size,
                            what.with_outputs) if new else ...
    with tuning.Stopwatch() as build:
        # (a new size of the ladder runs the planned size's build: the race compares sizes
        # alike, and its first call races no builds on rows it would drop)
        kernel = what.kernel(bound, plan, budget=budget, variant=planned_build if new else None,
                             recalled=found["variant"] if isinstance(found, dict) else None)
    if new and planned is not None and planned_build in kernel.variants:
        # (the race that chose it, for the note and the disk: the size kept keeps it)
        kernel.use(planned_build, why=f"as for the {planned.mode} mode's chunks of "
                                      f"{planned.chunk_size} rows: {planned.note}")
        kernel.raced = planned.raced
    tuning.recall_variant(bound, backend, kernel, found)
    if on_kernel is not None and racing is None:  # (a race's plans are not the next call's)
        on_kernel(plan)
    with tuning.Stopwatch() as call:
        result = tuning.timed(book, kernel, spec.n, lambda called: run(kernel.under(called), plan),
                              new=new, built_seconds=build.seconds, budget=budget)
    if racing is not None:
        racing(call.seconds, new)
    tuning.settle(book, kernel, lambda: pad_chunk(spec, 0, min(kernel.chunk_size, spec.n),
                                                   kernel.chunk_size))
    tuning.persist(bound, backend, kernel)
    if kernel.note:
        if explain:
            sys.stderr.write(f"batchjac: kernel: {kernel.note}\n")
        log.debug("batchjac kernel: %s", kernel.note)
    if explain:  # (what the estimates above came to: the build's making included when new)
        made = f"; making the kernel took {build.seconds:.3g} s before" if new else ""
        sys.stderr.write(f"batchjac: computed {spec.n} rows in {call.seconds:.3g} s "
                         f"({call.seconds / max(spec.n, 1) * 1e6:.3g} us a row){made}\n")
    return result


def _choose(bound: _backends.BoundModel, spec: BatchSpec, what: Derivative, plan: P, book: Ledger,
            budget: CallBudget, *, backend: str, rows_free: bool
            ) -> tuple[P, Report | None, _backends.Kernel | None]:
    """The cost model's plan, on a kernel compiled already where padding is cheaper than a new
    one, and the races that pay for themselves (:mod:`batchjac._tune.policy`): the mode (one more
    kernel to build) and, where the chunk size is free, the ladder of chunk sizes, which rides
    on the calls (its report takes this call's time; the kernel of the planned size, whose
    build its sizes run: it starts once that kernel has settled its build). Each reads first what an
    earlier process decided."""
    tuning.begin(book)  # the races this call skips set the next check anew
    wo = what.with_outputs
    if rows_free:  # with out= or chunk_size=, the size asked for is the constraint
        plan = what.fit(bound, spec, plan)
        if isinstance(plan, Plan):
            plan = cast(P, tuning.reuse(bound, plan, spec.n, wo))
    if isinstance(plan, Plan):
        tuning.recall(bound, backend, plan, wo)
        # the other mode's kernel takes the build of the one in use: the race of modes
        # compares them alike (TensorFlow's XLA against XLA, not its plain graph)
        prior = bound.kernel(plan.mode, plan.chunk_size, wo) \
            if plan.uncertain and bound.has_kernel(plan.mode, plan.chunk_size, wo) else None
        moded, report = mode_plan(bound, spec, plan, wo, start=lambda: tuning.worth(
            bound, spec.n, compilations=bound.mode_race_builds(plan.mode, plan.chunk_size, wo),
            timing=tuning.calls_timing(bound, spec.n, MODE_RUNS)),
            build=prior.variant if prior is not None else None)
        if report is not None:  # (the modes race first: the ladder of sizes is the mode's)
            return cast(P, moded), report, prior
        plan = cast(P, moded)
    if not rows_free:
        return plan, None, None
    name = what.name(plan)
    tuning.recall_rows(bound, backend, plan, wo, mode=name)
    planned = what.kernel(bound, plan) if what.has_kernel(bound, plan) else None
    settled = planned is not None and planned.variant is not None and planned.call_race is None \
        and not (planned.untimed and planned.retunable)

    def start() -> bool:
        if not tuning.worth(book, spec.n, compilations=ROWS_COMPILATIONS):
            return False
        if not settled:  # due, once the planned size's build is: the next call asks again
            book.next_check = 0.0
        return settled

    sized, report = rows_plan(bound, spec, plan, wo, mode=name, start=start)
    return sized, report, (planned if report is not None else None)


def context(spec: BatchSpec, backend: str) -> str:
    """What the error boundary of a public call adds to an error: backend and inputs."""
    shapes = ", ".join(f"{n} {a.shape} {a.dtype}" for n, a in zip(spec.names, spec.arrays))
    return f"backend={backend}; inputs: {shapes}; compute dtype {spec.dtype}"


def check_out(out: Any, shape: tuple[int, ...], dtype: np.dtype, name: str = "Jacobians") -> None:
    """``out=`` as a writable array of the result's ``shape`` and ``dtype`` (``name`` says
    which result), or a clear error: slice assignment would cast silently (int32 truncates,
    bool is all True, float16 rounds)."""
    got = getattr(out, "shape", None)
    want = np.dtype(dtype)
    if got is None or not hasattr(out, "__setitem__"):
        raise InputError(
            f"`out` must be a writable array of shape {shape} (e.g. np.empty or np.memmap) for "
            f"the {name}; got {type(out).__name__}.")
    if tuple(got) != shape:
        raise InputError(f"`out` has shape {tuple(got)} but the {name} have shape {shape}; "
                         f"allocate it as np.empty({shape}, dtype=np.{want.name}) or a memmap "
                         f"of that shape.")
    out_dtype = getattr(out, "dtype", None)
    try:
        same = out_dtype is not None and np.dtype(out_dtype) == want
    except TypeError:  # not a numpy dtype (a framework's tensor)
        same = False
    if not same:
        shown = np.dtype(out_dtype).name if isinstance(out_dtype, np.dtype) else out_dtype
        raise InputError(
            f"`out` has dtype {shown}, but the {name} are computed in {want.name}; they would "
            f"be cast into it silently (losing values or precision). Allocate `out` with "
            f"dtype=np.{want.name} (np.empty({shape}, dtype=np.{want.name}) or a memmap of that "
            f"dtype), or pass dtype= to compute in another floating dtype.")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise InputError("`out` is read-only; open the memmap with mode='r+' or 'w+'.")
