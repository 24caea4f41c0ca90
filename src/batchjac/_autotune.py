"""When the cost model cannot tell forward from reverse mode (unknowns and outputs of similar
count), time one chunk in each mode once and remember the winner for this model, signature
and chunk size."""

from __future__ import annotations

import dataclasses
import time

from ._backends import BoundModel
from ._plan import Plan
from ._runner import pad_chunk
from ._spec import BatchSpec


def tune(bound: BoundModel, spec: BatchSpec, plan: Plan, with_outputs: bool) -> Plan:
    key = (plan.chunk_size, with_outputs)
    if key not in bound.tuned:
        u, ctx = pad_chunk(spec, 0, min(plan.chunk_size, spec.n), plan.chunk_size)
        timings: dict[str, float] = {}
        for mode in ("forward", "reverse"):
            kernel = bound.kernel(mode, plan.chunk_size, with_outputs)  # type: ignore[arg-type]
            kernel(u, ctx)  # compile and warm up
            best = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                kernel(u, ctx)
                best = min(best, time.perf_counter() - start)
            timings[mode] = best
        winner = min(timings, key=timings.__getitem__)
        bound.tuned[key] = (winner, ", ".join(f"{m} {t * 1e3:.2f} ms" for m, t in timings.items()))
    mode, measured = bound.tuned[key]
    return dataclasses.replace(
        plan, mode=mode,
        reason=f"{mode} mode (unknowns and outputs of similar count; timed one chunk: {measured})"
               + plan.reason[plan.reason.index(";"):],
    )
