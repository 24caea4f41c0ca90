"""Planning: forward or reverse mode, and the chunk size, from shapes and a memory budget."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from ._backends._base import user_stacklevel
from ._config import cache_bytes, parse_bytes
from ._errors import ChunkMemoryWarning as ChunkMemoryWarning, InputError

ModeArg = Literal["auto", "forward", "reverse"]

#: upper bound on rows per chunk: beyond this, larger chunks buy no speed on any backend we
#: measured, and fixed chunk shapes keep the number of compilations small (no figures were
#: recorded: docs/thresholds.md)
MAX_CHUNK = 131072
#: below this ratio of max(k, m) / min(k, m), mode="auto" times both modes once
UNSURE_RATIO = 4
#: a chunk_size up to this many times the rows is kept (one compiled shape, reused by calls
#: with other N, is worth that much padding); a larger one is capped at the rows
MAX_PADDING_FACTOR = 4


@dataclass(frozen=True)
class Plan:
    mode: Literal["forward", "reverse"]
    chunk_size: int
    n_chunks: int
    reason: str
    #: the cost model cannot tell the modes apart; time both once (see _autotune)
    uncertain: bool = False
    #: the most rows a chunk may have within the memory budget (None: a chunk_size was given)
    budget_rows: int | None = None
    #: why the chunk size the caller asked for needs more memory than the budget ("" if not)
    memory_note: str = ""


#: a first- or second-order plan (:func:`fit_cache` takes either)
AnyPlan = TypeVar("AnyPlan", bound="Plan | SecondPlan")


def choose_mode(mode: ModeArg, k: int, m: int, forward_bias: float = 1.0
                ) -> tuple[Literal["forward", "reverse"], str]:
    """Forward mode while ``k < forward_bias * m``: ``k`` tangent passes against ``m``
    backward ones, a backward pass weighing ``forward_bias`` tangent passes for the backend
    (:attr:`~batchjac._backends.BoundModel.forward_bias`; 1 unless measured otherwise)."""
    if mode == "forward" or mode == "reverse":
        return mode, f"mode={mode!r} was asked for"
    if mode != "auto":
        raise InputError(f"`mode` must be 'auto', 'forward' or 'reverse'; got {mode!r}.")
    if k < m:
        return "forward", f"{k} unknowns < {m} outputs: forward mode needs {k} tangent passes"
    if k < forward_bias * m:
        return "forward", (f"{k} unknowns against {m} outputs: {k} tangent passes cost less "
                           f"than {m} backward passes here (each ~{forward_bias:g} tangent "
                           f"passes to build and run)")
    return "reverse", f"{m} outputs <= {k} unknowns: reverse mode needs {m} backward passes"


def check_chunk_size(chunk_size: Any) -> None:
    """A chunk size is a positive integer (None: chosen from the memory budget)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, (int, np.integer)) or chunk_size < 1):
        raise InputError(f"`chunk_size` must be a positive integer; got {chunk_size!r}.")


def check_options(mode: Any, chunk_size: Any, max_memory: Any) -> None:
    """The planning options, checked before anything is created (a store made before a bad
    option was found would be left behind)."""
    choose_mode(mode, 1, 1)
    check_chunk_size(chunk_size)
    if max_memory is not None:
        parse_bytes(max_memory)


def bytes_per_row(k: int, m: int, in_elems: int, itemsize: int, basis: int | None = None) -> int:
    """An estimate of the memory one instance needs during a chunk: the Jacobian (the kernel's
    output and its copy into the result) plus activations carried once per basis vector, with
    activations guessed from the input and output widths, times 2 for allocator slack and
    framework temporaries. Measured: TensorFlow's reverse mode on W2 uses ~160 kB a row, the
    estimate without the factor 2 (~155 kB); with it, max_memory="1GB" keeps TensorFlow's
    working set near 0.5 GB above the process's idle size. ``basis``: the passes a row holds
    at once where not ``min(k, m)`` (mixed mode: its widest piece's, :mod:`batchjac._chain`)."""
    basis = min(k, m) if basis is None else basis
    activations = 2 * (in_elems + m) + 512
    return 2 * itemsize * (2 * m * k + (1 + basis) * activations)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


#: chunk sizes of one octave of N: calls with ever new N compile at most this many shapes an
#: octave (see :func:`granule`)
GRANULES = 1 << 10


def granule(n: int) -> int:
    """Round chunk sizes to multiples of this, so that a sequence of calls with different N
    compiles a bounded number of shapes (at most ``GRANULES`` per octave), while padding wastes
    < 0.1% and round batch sizes (1,000, 10,000) need none: padding copies the inputs, which
    costs more than the 0.1% on large inputs."""
    return 1 << max(0, int(math.log2(max(n, 1))) - (GRANULES.bit_length() - 1))


def make_plan(
    *, n: int, k: int, m: int, in_elems: int, dtype: np.dtype, mode: ModeArg,
    chunk_size: int | None, max_memory: int, forward_bias: float = 1.0,
    basis: int | None = None,
) -> Plan:
    """The mode and chunk size for ``n`` rows. A ``chunk_size`` more than MAX_PADDING_FACTOR
    times the rows is capped at them (rounded up as the planner rounds one chunk of all rows);
    one whose estimated memory exceeds ``max_memory`` is kept, with a
    :class:`ChunkMemoryWarning`. ``forward_bias``: see :func:`choose_mode`."""
    plan = _make_plan(n=n, k=k, m=m, in_elems=in_elems, dtype=dtype, mode=mode,
                      chunk_size=chunk_size, max_memory=max_memory, forward_bias=forward_bias,
                      basis=basis)
    if plan.memory_note:  # outside the cache: every such call says so
        warnings.warn(f"batchjac: {plan.memory_note}.", ChunkMemoryWarning, stacklevel=user_stacklevel())
    return plan


@functools.lru_cache(maxsize=256)  # called on every jacobian(); the inputs are small and hashable
def _make_plan(
    *, n: int, k: int, m: int, in_elems: int, dtype: np.dtype, mode: ModeArg,
    chunk_size: int | None, max_memory: int, forward_bias: float = 1.0, basis: int | None = None,
) -> Plan:
    chosen, why = choose_mode(mode, k, m, forward_bias)
    per_row = bytes_per_row(k, m, in_elems, dtype.itemsize, basis)
    size, budget_rows, source, note = _chunking(n, per_row, chunk_size, max_memory)
    n_chunks = -(-n // size) if n else 0
    uncertain = mode == "auto" and max(k, m) <= UNSURE_RATIO * min(k, m)
    return Plan(mode=chosen, chunk_size=size, n_chunks=n_chunks, uncertain=uncertain,
                budget_rows=budget_rows, reason=f"{chosen} mode ({why}); chunks of {size} rows ({source})",
                memory_note=note)


def _chunking(n: int, per_row: int, chunk_size: int | None, max_memory: int
              ) -> tuple[int, int | None, str, str]:
    """The chunk size for ``n`` rows at ``per_row`` bytes each: ``(size, budget_rows, why,
    memory note)``. Shared by the first- and second-order plans."""
    budget_rows: int | None = None
    note = ""
    if chunk_size is not None:
        check_chunk_size(chunk_size)
        # padding rows are computed for nothing: a chunk far beyond the rows is the rows
        all_rows = max(1, _ceil_div(n, granule(n)) * granule(n))
        size = int(chunk_size)
        source = "chunk_size was given"
        if size > MAX_PADDING_FACTOR * all_rows:
            size = all_rows
            source = (f"chunk_size was given as {chunk_size}, more than {MAX_PADDING_FACTOR} "
                      f"times the rows: capped at the {n} rows")
        if size * per_row > max_memory:
            note = (f"chunk_size={size} needs ~{size * per_row / 1e6:,.0f} MB by the "
                    f"planner's estimate (~{per_row} B per row), more than the memory budget "
                    f"(max_memory) of {max_memory / 1e6:,.0f} MB: pass a smaller chunk_size "
                    f"(at most {max(1, max_memory // per_row)} rows), a larger max_memory, or "
                    f"no chunk_size to let batchjac choose")
            source += f"; {note}"
    else:
        budget_rows = int(max(1, min(MAX_CHUNK, max_memory // per_row)))
        if n <= budget_rows:
            size = max(1, _ceil_div(n, granule(n)) * granule(n))
            source = f"all {n} rows fit the memory budget in one chunk"
        else:
            # balance the chunks so the last one is not mostly padding
            rows = _ceil_div(n, _ceil_div(n, budget_rows))
            size = min(budget_rows, _ceil_div(rows, granule(rows)) * granule(rows))
            source = f"memory budget {max_memory / 1e6:.0f} MB at ~{per_row} B per row"
    return size, budget_rows, source, note


# -- the CPU's cache (its size: batchjac._config.cache_bytes) ----------------------------------

#: a Jacobian kernel's temporaries a row, per tangent or backward pass, against those of the
#: forward derivative with one tangent (``BoundModel.row_bytes``, from a trace): set to keep
#: the estimate above what XLA's buffer assignment keeps (measured: docs/thresholds.md)
PASS_FACTOR = 0.75
#: chunks are cut to the cache only where the temporaries outweigh the results that many
#: times: more chunks copy their results into the whole array, which costs more than the
#: cache saves where the results are as large as the temporaries (docs/thresholds.md)
TEMP_RESULT_RATIO = 4
#: fewer rows a chunk are dispatch-bound (each chunk is a call of the kernel)
MIN_CACHE_ROWS = 64


def fit_cache(plan: AnyPlan, n: int, *, row_bytes: float | None, passes: int,
              result_row_bytes: int) -> AnyPlan:
    """The plan in chunks whose temporaries fit the CPU's cache, where the backend estimated
    them (``row_bytes``: :meth:`~batchjac._backends.BoundModel.row_working_set`) and they
    outweigh the results (:data:`TEMP_RESULT_RATIO`); else the plan as it is. A chunk whose
    temporaries outgrow the cache runs them from memory: on the benchmark workloads where
    this applies, Jacobians and Hessians alike, one chunk ran two to three times slower than
    chunks cut to the cache (measured: docs/thresholds.md, ``_config.CACHE_FALLBACK``).
    ``passes``: of the kernel, where each holds about what the one tangent does (a
    Jacobian's ``k`` tangents or ``m`` backward passes). The ladder of
    chunk sizes (``batchjac._tune.races.tune_rows``) times sizes below this one later, when the
    work repays it."""
    if row_bytes is None or n == 0:
        return plan
    temp = PASS_FACTOR * max(1, passes) * row_bytes
    if temp < TEMP_RESULT_RATIO * result_row_bytes:
        return plan
    fit = max(MIN_CACHE_ROWS, int(cache_bytes() // temp))
    if fit >= plan.chunk_size:
        return plan
    rows = _ceil_div(n, _ceil_div(n, fit))  # balanced, as the memory budget's chunks are
    size = min(fit, _ceil_div(rows, granule(rows)) * granule(rows))
    why = (f"chunks of {size} rows (the temporaries of a chunk within the CPU's "
           f"{cache_bytes() / 2**20:.0f} MB cache: ~{temp / 1e3:.0f} KB a row by the trace)")
    return dataclasses.replace(plan, chunk_size=size, n_chunks=_ceil_div(n, size),
                               reason=f"{plan.reason.split('; chunks of')[0]}; {why}")


#: the share of the CPU's cache a chunk's Jacobians take in mixed mode, where the rows take
#: several chunks anyway: such chunks are bound by writing their Jacobians (a piece's Jacobians
#: are narrow), and in chunks of a few rows those stay in the cache until they are copied out,
#: where chunks of the memory budget's rows ran about twice as long; rows that fit one chunk
#: stay one, whose Jacobians are the result, not copied (docs/thresholds.md, "Mixed mode")
MIXED_CACHE_SHARE = 0.5


def in_mixed_mode(plan: Plan, n: int, *, result_row_bytes: int, why: str) -> Plan:
    """``plan`` computed in mixed mode (:mod:`batchjac._chain`; ``why``: the bracketing in
    words): no race of the pure modes, and where the chunk size is the planner's and the rows
    take several chunks, chunks whose Jacobians take at most :data:`MIXED_CACHE_SHARE` of
    the cache."""
    size = plan.chunk_size
    chunks = "chunks of" + plan.reason.partition("; chunks of")[2]
    if plan.budget_rows is not None and plan.n_chunks > 1:
        fit = max(1, int(MIXED_CACHE_SHARE * cache_bytes() // max(1, result_row_bytes)))
        if fit < size:
            rows = _ceil_div(n, _ceil_div(n, fit))
            size = min(fit, _ceil_div(rows, granule(rows)) * granule(rows))
            chunks = (f"chunks of {size} rows (a chunk's Jacobians within {MIXED_CACHE_SHARE:g} "
                      f"of the CPU's {cache_bytes() / 2**20:.0f} MB cache)")
    return dataclasses.replace(plan, chunk_size=size, n_chunks=_ceil_div(n, size) if n else 0,
                               uncertain=False, reason=f"{why}; {chunks}")


# -- second order ---------------------------------------------------------------------------

def hessian_passes(order: str, k: int, m: int) -> int:
    """The passes of a full Hessian's kernel for :func:`fit_cache`: forward over reverse, the
    ``k`` tangents of the primal and of each of the ``m`` backward passes; forward over
    forward, ``k`` tangents of ``k`` tangents and of the primal. ``PASS_FACTOR`` times these
    passes stays above what XLA's buffer assignment keeps (measured: docs/thresholds.md)."""
    return k * (m + 1) if order == "forward-over-reverse" else k * (k + 1)


SecondKindArg = Literal["hessian", "diagonal", "laplacian", "hvp"]
OrderArg = Literal["auto", "forward-over-reverse", "forward-over-forward"]
ORDERS = ("forward-over-reverse", "forward-over-forward")


@dataclass(frozen=True)
class SecondPlan:
    """The order of the two differentiations and the chunk size of a second-order call."""

    order: Literal["forward-over-reverse", "forward-over-forward"]
    chunk_size: int
    n_chunks: int
    reason: str
    budget_rows: int | None = None
    memory_note: str = ""


def choose_order(order: OrderArg, kind: SecondKindArg, k: int, m: int,
                 reductions_over_forward: bool = True, forward_hessian: bool = False
                 ) -> tuple[Literal["forward-over-reverse", "forward-over-forward"], str]:
    """Forward over reverse (``jacfwd(jacrev)``) by default; forward over forward where the
    shapes favour it: the diagonal and the Laplacian (``k`` passes of a second-order tangent
    along each unknown, no ``k x k`` block per output, where forward over reverse pushes
    ``k`` tangents through ``m`` gradients), and full Hessians of more outputs than unknowns
    (``k^2`` tangent pairs against ``m k``). A backend whose second forward pass is dear
    (``reductions_over_forward=False``: PyTorch, TensorFlow) takes forward over reverse for
    the reductions of at most as many outputs as unknowns. A backend that pushes a full
    Hessian forward in one pass (``forward_hessian``: JAX's rule set, ``1 + k + k(k+1)/2``
    terms a value) takes it where those are fewer than forward over reverse's
    ``(1 + k)(1 + m)`` (the primal and ``m`` gradients, each with ``k`` tangents): W6's 5
    unknowns and 4 outputs, 21 against 30."""
    if order in ORDERS:
        return order, f"mode={order!r} was asked for"  # type: ignore[return-value]
    if order != "auto":
        raise InputError(f"`mode` of a second-order call must be 'auto', "
                         f"'forward-over-reverse' or 'forward-over-forward'; got {order!r}.")
    if kind in ("diagonal", "laplacian") and not reductions_over_forward and m <= k:
        return "forward-over-reverse", (f"{m} outputs <= {k} unknowns: {m} gradients pushed "
                                        f"along {k} tangents cost this backend less than "
                                        f"{k} second-order tangents")
    if kind in ("diagonal", "laplacian"):
        return "forward-over-forward", (f"{k} second-order tangents, one per unknown, and no "
                                        f"{k}x{k} block per output")
    terms = 1 + k + k * (k + 1) // 2
    if kind == "hessian" and forward_hessian and terms < (1 + k) * (1 + m):
        return "forward-over-forward", (f"{terms} second-order Taylor terms a value, one pass, "
                                        f"< {(1 + k) * (1 + m)} of {m} gradients along {k} "
                                        f"tangents")
    if kind == "hessian" and k < m:
        return "forward-over-forward", f"{k} unknowns < {m} outputs: {k * k} tangent pairs < {m * k}"
    if kind == "hvp":
        return "forward-over-reverse", "one tangent per instance pushed through the reverse-mode Jacobian"
    return "forward-over-reverse", (f"{m} outputs <= {k} unknowns: {m} gradients, each pushed "
                                    f"along {k} tangents")


def second_bytes_per_row(kind: SecondKindArg, order: str, k: int, m: int, in_elems: int,
                         itemsize: int) -> int:
    """The estimate of :func:`bytes_per_row` for a second-order kernel: its results (the
    kind's, ``k*k`` per output for a full Hessian, plus the Jacobian and outputs of the same
    pass), the temporaries of the inner derivative (each of the outer tangents carries one),
    and activations once per pass, times 2."""
    result = {"hessian": m * k * k, "diagonal": m * k, "laplacian": m, "hvp": m * k}[kind] + m * k + m
    tangents = 1 if kind == "hvp" else k
    if order == "forward-over-reverse":
        temporaries, passes = tangents * m * k, (1 + m) * (1 + tangents)
    elif kind == "hessian":
        temporaries, passes = k * k * m, 2 * k * k + 1
    else:
        temporaries, passes = 2 * k * m, 2 * k + 1
    activations = 2 * (in_elems + m) + 512
    return 2 * itemsize * (2 * result + temporaries + passes * activations)


def make_second_plan(*, kind: SecondKindArg, n: int, k: int, m: int, in_elems: int,
                     dtype: np.dtype, order: OrderArg, chunk_size: int | None,
                     max_memory: int, reductions_over_forward: bool = True,
                     forward_hessian: bool = False) -> SecondPlan:
    """The order and chunk size of a second-order call; a chunk_size over the memory budget
    is kept with a :class:`ChunkMemoryWarning`, as :func:`make_plan` does."""
    chosen, why = choose_order(order, kind, k, m, reductions_over_forward, forward_hessian)
    per_row = second_bytes_per_row(kind, chosen, k, m, in_elems, dtype.itemsize)
    size, budget_rows, source, note = _chunking(n, per_row, chunk_size, max_memory)
    if note:
        warnings.warn(f"batchjac: {note}.", ChunkMemoryWarning, stacklevel=user_stacklevel())
    return SecondPlan(order=chosen, chunk_size=size, n_chunks=-(-n // size) if n else 0,
                      reason=f"{kind}: {chosen} ({why}); chunks of {size} rows ({source})",
                      budget_rows=budget_rows, memory_note=note)
