"""What one bound model has measured and decided, declared in one object.

Every bound model carries one :class:`TuningState` (``bound.tuning``), made with it; the
tuning policy (:mod:`batchjac._tune.policy`), the binding (:mod:`batchjac._bind`), the
second-order path and the backends' second-order kernels read and write its fields, and
nothing else is written onto a bound model from outside.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Ledger:
    """What one bound model has computed: rows, seconds of kernel work (calls to kernels that
    existed already), and the slowest first call of a new kernel (a compilation's price)."""

    rows: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0
    #: rows of the first calls (compilation included): an upper bound of the cost per row
    #: before any steady call was seen
    first_rows: int = 0
    #: seconds of padded rows computed to reuse a kernel, per batch size: once they add up to
    #: a compilation, that size gets a kernel of its own
    waste: dict[int, float] = field(default_factory=dict)
    #: the work (seconds) at which a race skipped so far becomes worth its cost: the fast path
    #: of repeated calls compares against it and hands the next call to the full path
    next_check: float = math.inf

    @property
    def seconds_per_row(self) -> float | None:
        if self.rows and self.seconds > 0:
            return self.seconds / self.rows
        if self.first_rows and self.compile_seconds > 0:
            return self.compile_seconds / self.first_rows
        return None


@dataclass
class TuningState:
    """The tuning state of one bound model."""

    #: the work of its Jacobian calls
    ledger: Ledger = field(default_factory=Ledger)
    #: the work of its second-order calls, apart (a Hessian's seconds per row would price a
    #: Jacobian race wrongly)
    second: Ledger = field(default_factory=Ledger)
    #: the model it was bound for (a weak reference), which the disk cache fingerprints
    source: Callable[[], Any] | None = None
    #: that fingerprint, once computed ("" where the model has none: nothing kept on disk)
    computation: str | None = None
    #: the decisions on disk already (read from it, or written)
    persisted: set[Any] = field(default_factory=set)
    #: the code key of a plain function (new function objects of one code share decisions)
    code_key: tuple[str, str, str] | None = None
    #: the build a second-order race chose per (kind, order), which kernels of other chunk
    #: sizes take without a race of their own (the ladder of chunk sizes compares sizes on
    #: one build)
    builds: dict[tuple[str, str], str] = field(default_factory=dict)
    #: the second-order orders that failed for the model (``OrderFailedError``): ``"auto"``
    #: plans the other one from then on
    failed_orders: set[str] = field(default_factory=set)
    #: the ladders of chunk sizes racing on the calls, by their key in ``bound.tuned_rows``
    #: (:class:`batchjac._tune.races.RowsRace`), until they decide
    rows_races: dict[Any, Any] = field(default_factory=dict)
    #: the races of the modes on the calls, by their key in ``bound.tuned``
    #: (:class:`batchjac._tune.races.ModeRace`), until they decide
    mode_races: dict[Any, Any] = field(default_factory=dict)
