"""`make demo`: the original question on the built-in seed model.

A Keras model takes ``concat([unknown, known], axis=-1)`` (5 unknown + 3 known inputs, 4
outputs); we need d output / d unknown for 1,000 instances. batchjac computes them, checks
them against float64 central finite differences, and times itself beside what people write.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

N = 1000
LOOP_ROWS = 100  # the naive loop is timed on a subset and scaled to N


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


#: calls of batchjac before its steady state is timed, at most this long: its races (XLA against
#: the plain graph here) run once the work seen repays them, as for a user calling repeatedly
SETTLE_SECONDS = 10.0


def _settle(model: Any, call: Callable[[], Any], budget: float = SETTLE_SECONDS) -> int:
    """Call until batchjac has no race left to run for ``model``; the number of calls."""
    from batchjac import _backends
    from batchjac._tune import policy as _tuning

    calls, start = 0, time.perf_counter()
    while any(_tuning.pending(b) for b in _backends._bound.get(model, {}).values()) \
            and time.perf_counter() - start < budget:
        call()
        calls += 1
    return calls


def main(n: int = N, out: Callable[[str], None] = print) -> dict[str, float]:
    import batchjac
    from batchjac._bench import tf_baselines as tfb
    from batchjac._examples.reference import mlp_forward
    from batchjac._finite_diff import central_differences, max_relative_error
    from batchjac.examples import seed_model, workload_inputs

    out(f"batchjac {batchjac.__version__}: per-instance Jacobians d output / d unknown")
    model = seed_model("tensorflow")
    unknown, maybe_known = workload_inputs("W1", n)
    assert maybe_known is not None  # W1 has known inputs
    known = maybe_known
    out(f"model: Keras MLP 8-64-64-4 (tanh) taking concat([unknown, known]); "
        f"unknown {unknown.shape}, known {known.shape}")

    start = time.perf_counter()
    jac = batchjac.jacobian(model, unknown, known)
    first = time.perf_counter() - start
    out(f"result: J of shape {jac.shape} (N, outputs, unknowns), {jac.dtype}")

    # Independent reference: central differences in float64 through a numpy forward pass of
    # the model's own (float32) weights -- no TensorFlow, no autodiff.
    weights = model.get_weights()
    layers = [(weights[i].astype(np.float64), weights[i + 1].astype(np.float64))
              for i in range(0, len(weights), 2)]
    known64 = known.astype(np.float64)
    ref = central_differences(
        lambda u: mlp_forward(layers, np.concatenate([u, known64], axis=1)), unknown)
    err = max_relative_error(jac, ref)
    verdict = "OK" if err <= 1e-4 else "FAILED"
    out(f"check: max |J - J_fd| / max |J_fd| = {err:.2e} against float64 central "
        f"differences ({verdict}, float32 tolerance 1e-4)")

    xla = tfb.xla_batch_jacobian(model)
    start = time.perf_counter()
    xla(unknown, known)  # the expert answer's first call: its compilation included
    first_xla = time.perf_counter() - start

    repeats = 20
    settled = _settle(model, lambda: batchjac.jacobian(model, unknown, known))
    t_bj = _median_time(lambda: batchjac.jacobian(model, unknown, known), repeats)
    t_xla = _median_time(lambda: xla(unknown, known), repeats)
    t_eager = _median_time(lambda: tfb.eager_batch_jacobian(model, unknown, known), 5)
    rows = min(LOOP_ROWS, n)
    t_loop_sub = _median_time(lambda: tfb.naive_loop(model, unknown[:rows], known[:rows]), 1)
    t_loop = t_loop_sub * n / rows

    out("")
    out(f"first call, compilation included (what a one-off user waits for; in this process, "
        f"batchjac first): batchjac {first * 1e3:.0f} ms, tape.batch_jacobian + XLA (B2) "
        f"{first_xla * 1e3:.0f} ms = {first / first_xla:.2f}x. Fresh processes: BENCHMARKS.md.")
    out(f"times for N={n} (median of repeats, after warm-up; batchjac after its tuning settled, "
        f"{settled} calls):")
    table = [
        ("batchjac.jacobian", t_bj, ""),
        ("tape.batch_jacobian + XLA (B2)", t_xla, ""),
        ("eager tape.batch_jacobian (B1)", t_eager, ""),
        ("loop of tape.jacobian (B0)", t_loop, f"timed on {rows} rows, scaled x{n / rows:g}"),
    ]
    for label, t, note in table:
        ratio = t / t_bj
        out(f"  {label:<32} {t * 1e3:10.2f} ms  {ratio:8.1f}x batchjac  {note}")
    if err > 1e-4:
        raise SystemExit("demo check failed: Jacobians disagree with finite differences")
    return {"batchjac": t_bj, "xla": t_xla, "eager": t_eager, "loop": t_loop, "error": err,
            "first": first, "first_xla": first_xla}


if __name__ == "__main__":
    main()
