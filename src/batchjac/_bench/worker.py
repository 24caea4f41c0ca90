"""Time batchjac beside the baselines of one framework on one workload, in this process.

Run by :mod:`batchjac._bench.run` in a fresh subprocess per (workload, backend), so that
frameworks' thread pools and memory do not mix and each peak-memory figure is its own.
Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Case:
    name: str  # e.g. "B2 batch_jacobian+XLA"
    fn: Callable[[], np.ndarray]
    role: str  # "batchjac" | "expert" | "user" | "forward"
    scale: float = 1.0  # time multiplier (B0 is timed on a subset of rows)
    rows: int | None = None  # rows the result covers, when a subset


#: a timing sample of a fast case lasts at least about this long (several calls)
SAMPLE_SECONDS = 0.02
MAX_INNER = 50


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _forward_hopeless(unknown: np.ndarray, w: Any) -> bool:
    """jacfwd with k >= 8 m (W2, W4: 784 unknowns, 10 outputs) carries 784 tangent copies of
    every activation for the whole batch: 8+ GB on W2 (the process is killed on this 24 GB
    machine) and several times slower than jacrev where it fits. Such a baseline is left out
    and the report says so; the better expert baseline (jacrev) is always timed."""
    k = int(np.prod(unknown.shape[1:]))
    m = w.sizes[-1] if w.kind == "mlp" else 10
    return k >= 8 * m


@contextlib.contextmanager
def _plan_log(lines: list[str]) -> Iterator[None]:
    """Collect what batchjac logs about its choices (mode, chunk size, kernel) meanwhile."""
    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage().removeprefix("batchjac "))

    log = logging.getLogger("batchjac")
    handler, level = Collect(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def build_second_cases(workload: str, backend: str, n: int) -> tuple[list[Case], dict[str, Any]]:
    """W6, W7, W7H: batchjac's Hessian or Laplacian beside the framework's native answer
    (:mod:`batchjac._bench.second`), and the forward pass."""
    from . import second

    sw = second.SECOND[workload]
    model, unknown, known = second.model_and_inputs(workload, backend, n)
    data = (unknown,) if known is None else (unknown, known)
    nat = second.native(workload, backend, model)
    fwd: Callable[[np.ndarray, np.ndarray | None], np.ndarray]
    if backend == "tensorflow":
        from . import tf_baselines

        fwd = tf_baselines.xla_forward(model)
    elif backend == "torch":
        from . import torch_baselines

        fwd = torch_baselines.forward(model)
    else:
        from . import jax_baselines

        fwd = jax_baselines.forward(model)
    cases = [Case("batchjac", lambda: second.batchjac_call(workload, model, data), "batchjac"),
             Case(second.native_name(workload, backend), lambda: nat(unknown, known), "expert"),
             Case("F forward", lambda: fwd(unknown, known), "forward")]
    from batchjac.examples import WORKLOADS

    meta = {"workload": workload, "backend": backend, "n": n, "k": int(unknown[0].size),
            "m": WORKLOADS[sw.base].sizes[-1], "order": 2, "kind": sw.kind,
            "description": sw.description, "model": model}
    return cases, meta


def build_cases(workload: str, backend: str, n: int, loop_rows: int) -> tuple[list[Case], dict[str, Any]]:
    from . import second

    if second.is_second(workload):
        return build_second_cases(workload, backend, n)
    import batchjac
    from batchjac.examples import WORKLOADS, workload_inputs, workload_model

    w = WORKLOADS[workload]
    model = workload_model(workload, backend)
    unknown, known = workload_inputs(workload, n)
    data = (unknown,) if known is None else (unknown, known)
    cases = [Case("batchjac", lambda: batchjac.jacobian(model, *data), "batchjac")]
    sub = min(loop_rows, n)
    if backend == "tensorflow":
        from . import tf_baselines as b

        xla = b.xla_batch_jacobian(model)
        fwd, fwd_graph = b.xla_forward(model), b.xla_forward(model, jit_compile=False)
        ks = None if known is None else known[:sub]
        cases += [
            Case("B2 batch_jacobian+XLA", lambda: xla(unknown, known), "expert"),
            Case("B1 eager batch_jacobian", lambda: b.eager_batch_jacobian(model, unknown, known), "user"),
            Case(f"B0 loop (x{n / sub:g} of {sub} rows)", lambda: b.naive_loop(model, unknown[:sub], ks),
                 "user", scale=n / sub, rows=sub),
            Case("F forward (XLA)", lambda: fwd(unknown, known), "forward"),
            Case("F forward (graph)", lambda: fwd_graph(unknown, known), "forward"),
        ]
    elif backend == "torch":
        from . import torch_baselines as tb

        rev, fwdj, fwd = tb.vmap_jac(model, "jacrev"), tb.vmap_jac(model, "jacfwd"), tb.forward(model)
        cases += [Case("B3 vmap(jacrev)", lambda: rev(unknown, known), "expert")]
        if not _forward_hopeless(unknown, w):
            cases += [Case("B3 vmap(jacfwd)", lambda: fwdj(unknown, known), "expert")]
        cases += [Case("F forward", lambda: fwd(unknown, known), "forward")]
    elif backend == "jax":
        from . import jax_baselines as jb

        rev, fwdj, fwd = jb.vmap_jac(model, "jacrev"), jb.vmap_jac(model, "jacfwd"), jb.forward(model)
        cases += [Case("B4 jit(vmap(jacrev))", lambda: rev(unknown, known), "expert")]
        if not _forward_hopeless(unknown, w):
            cases += [Case("B4 jit(vmap(jacfwd))", lambda: fwdj(unknown, known), "expert")]
        cases += [Case("F forward (jit)", lambda: fwd(unknown, known), "forward")]
    else:
        raise SystemExit(f"unknown backend {backend!r}")
    k = unknown[0].size
    meta = {"workload": workload, "backend": backend, "n": n, "k": int(k), "description": w.description,
            "model": model}
    return cases, meta


#: the steady state is measured once batchjac's tuning has settled: its races run when the work
#: seen repays them (batchjac._tune.policy), so a user calling repeatedly reaches the tuned kernels
#: after some calls; the benchmark calls until no race is due, for at most this long
SETTLE_SECONDS = 30.0


def settle(case: Case, model: Any, budget: float = SETTLE_SECONDS) -> dict[str, Any]:
    """Call batchjac until none of its bound models has a race to come (or ``budget`` s)."""
    from batchjac import _backends
    from batchjac._tune import policy as _tuning

    def due() -> bool:
        return any(_tuning.pending(b) for b in _backends._bound.get(model, {}).values())

    start, calls = time.perf_counter(), 0
    while due() and time.perf_counter() - start < budget:
        case.fn()
        calls += 1
    return {"calls": calls, "seconds": time.perf_counter() - start, "settled": not due()}


def measure(workload: str, backend: str, n: int, repeats: int, loop_rows: int,
            slow_seconds: float = 2.0) -> dict[str, Any]:
    cases, meta = build_cases(workload, backend, n, loop_rows)
    model = meta.pop("model")
    first: dict[str, float] = {}
    results: dict[str, np.ndarray] = {}
    rss_batchjac = None
    plan: list[str] = []
    for case in cases:  # warm-up: compile, and keep each result for the correctness check
        start = time.perf_counter()
        with _plan_log(plan) if case.role == "batchjac" else contextlib.nullcontext():
            results[case.name] = np.asarray(case.fn())
        first[case.name] = time.perf_counter() - start
        if case.role == "batchjac":
            with _plan_log(plan):
                tuning = settle(case, model)
            rss_batchjac = _peak_rss_mb()
    # a sample of a fast case is the mean of several back-to-back calls (at least ~20 ms in
    # all), as timeit does: single millisecond calls on a shared 2-core machine jitter by
    # +-50%, which medians of 11 do not tame
    inner: dict[str, int] = {}
    for case in cases:
        if case.role == "user" and first[case.name] > slow_seconds:
            inner[case.name] = 1
            continue
        start = time.perf_counter()
        case.fn()
        inner[case.name] = int(min(MAX_INNER, max(1, math.ceil(SAMPLE_SECONDS /
                                                              (time.perf_counter() - start)))))
    times: dict[str, list[float]] = {c.name: [] for c in cases}
    for r in range(repeats):  # interleaved, so drifting machine load hits every case alike
        for case in cases:
            if r >= 2 and case.role == "user" and first[case.name] > slow_seconds:
                continue  # what users write is slow: two timed repeats are enough
            start = time.perf_counter()
            for _ in range(inner[case.name]):
                case.fn()
            times[case.name].append((time.perf_counter() - start) / inner[case.name])
    med = {c.name: statistics.median(times[c.name]) * c.scale for c in cases}
    # the best baseline of the framework: the fastest of B1-B4 (B1, eager batch_jacobian, is
    # a baseline too, and beats XLA on convolutions here); B0, the per-instance loop, never is
    baselines = [c for c in cases if c.role == "expert" or (c.role == "user" and
                                                            not c.name.startswith("B0"))]
    best = min(baselines, key=lambda c: med[c.name])
    ref = results[best.name].astype(np.float64)
    scale = float(np.abs(ref).max()) or 1.0
    errors = {}
    for c in cases:
        if c.role == "forward":
            continue
        res = results[c.name].astype(np.float64)
        errors[c.name] = float(np.abs(res - ref[: res.shape[0]]).max() / scale)
    m = meta.pop("m", None) or int(np.prod(results[best.name].shape[1:], dtype=np.int64)) // meta["k"]
    return {
        **meta,
        "m": m,
        "repeats": repeats,
        "cases": [
            {"name": c.name, "role": c.role, "median_s": med[c.name], "calls_per_sample": inner[c.name],
             "compile_s": max(0.0, first[c.name] * c.scale - med[c.name]) if c.scale == 1 else None,
             "n_timed": len(times[c.name]), "max_rel_err_vs_best": errors.get(c.name),
             "all_s": times[c.name]}
            for c in cases
        ],
        "best_expert": best.name,
        "batchjac_plan": plan,
        "batchjac_tuning": tuning,
        "peak_rss_mb_after_batchjac": rss_batchjac,
        "peak_rss_mb_end": _peak_rss_mb(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("workload")
    p.add_argument("backend")
    p.add_argument("n", type=int)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--loop-rows", type=int, default=100)
    args = p.parse_args(argv)
    out = measure(args.workload, args.backend, args.n, args.repeats, args.loop_rows)
    sys.stdout.write("BENCH-JSON " + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
