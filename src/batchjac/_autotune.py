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

REPEATS = 5
MARGIN = 0.1


def tune(bound: BoundModel, spec: BatchSpec, plan: Plan, with_outputs: bool) -> Plan:
    key = (plan.chunk_size, with_outputs)
    if key not in bound.tuned:
        u, ctx = pad_chunk(spec, 0, min(plan.chunk_size, spec.n), plan.chunk_size)
        kernels = {mode: bound.kernel(mode, plan.chunk_size, with_outputs)  # type: ignore[arg-type]
                   for mode in ("forward", "reverse")}
        for kernel in kernels.values():
            kernel(u, ctx)  # compile and warm up
        timings = {mode: float("inf") for mode in kernels}
        for _ in range(REPEATS):  # interleaved, minimum: robust to a busy machine
            for mode, kernel in kernels.items():
                start = time.perf_counter()
                kernel(u, ctx)
                timings[mode] = min(timings[mode], time.perf_counter() - start)
        other = "reverse" if plan.mode == "forward" else "forward"
        # keep the cost model's choice unless the other mode is clearly faster
        winner = other if timings[other] < (1 - MARGIN) * timings[plan.mode] else plan.mode
        bound.tuned[key] = (winner, ", ".join(f"{m} {t * 1e3:.2f} ms" for m, t in timings.items()))
    mode, measured = bound.tuned[key]
    return dataclasses.replace(
        plan, mode="forward" if mode == "forward" else "reverse",
        reason=f"{mode} mode (unknowns and outputs of similar count; timed one chunk: {measured})"
               + plan.reason[plan.reason.index(";"):],
    )
