"""Native arrays in and out (issue 17): W2 (MLP 784-256-256-10, every input unknown) with the
framework's own arrays given to batchjac, against the native baseline that keeps its arrays
native too (torch: ``vmap(jacrev)`` of the per-instance function on a tensor; JAX:
``jit(vmap(jacrev))`` on a JAX array, waited for with ``block_until_ready``). Both return the
framework's arrays; nothing is copied to the host by either.

Call :func:`measure` from the bench (one row per framework), or run
``python -m batchjac._bench.arrays [torch|jax] [N]`` for a quick look. Timings are interleaved
(batchjac, baseline, batchjac, ...) in one process after warm-up calls (which let batchjac's
tuning settle), and the medians compared.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import batchjac
from batchjac._arrays import kind_of
from batchjac.examples import workload_inputs, workload_model


def _torch_case(n: int) -> tuple[Callable[[], Any], Callable[[], Any], Callable[[Any], Any]]:
    import torch
    from torch.func import jacrev, vmap

    model = workload_model("W2", "torch")
    x, _ = workload_inputs("W2", n)
    xt = torch.from_numpy(x)

    def baseline() -> Any:
        with torch.no_grad():
            return vmap(jacrev(lambda r: model(r[None])[0]))(xt)

    return (lambda: batchjac.jacobian(model, xt)), baseline, lambda a: a


def _jax_case(n: int) -> tuple[Callable[[], Any], Callable[[], Any], Callable[[Any], Any]]:
    import jax

    model = workload_model("W2", "jax")
    x, _ = workload_inputs("W2", n)
    xj = jax.device_put(x, jax.devices()[0])
    fn = jax.jit(jax.vmap(jax.jacrev(lambda r: model(r[None])[0])))
    return (lambda: batchjac.jacobian(model, xj)), (lambda: fn(xj)), jax.block_until_ready


def measure(framework: str, n: int = 10_000, repeats: int = 5, warmup: int = 3) -> dict[str, Any]:
    """Seconds per call (medians of ``repeats`` interleaved calls after ``warmup`` each) of
    batchjac with ``framework``'s arrays in and out, and of the native baseline, on W2 with
    ``n`` rows; ``ratio`` is batchjac / baseline. The result's kind is checked: a host copy
    would show as a numpy array."""
    case = _torch_case if framework == "torch" else _jax_case
    ours, base, wait = case(n)
    kind = kind_of(ours())
    if kind == "numpy":
        raise AssertionError("batchjac returned numpy for native inputs")
    for _ in range(warmup):
        wait(ours())
        wait(base())
    times: dict[str, list[float]] = {"batchjac": [], "baseline": []}
    for _ in range(repeats):
        for name, run in (("batchjac", ours), ("baseline", base)):
            start = time.perf_counter()
            wait(run())
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"framework": framework, "workload": "W2", "n": n, "result_kind": kind,
            "batchjac_s": med["batchjac"], "baseline_s": med["baseline"],
            "ratio": med["batchjac"] / med["baseline"], "runs": times}


if __name__ == "__main__":  # pragma: no cover - a manual look
    fw = sys.argv[1] if len(sys.argv) > 1 else "torch"
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    r = measure(fw, rows)
    print(f"{fw} W2 N={rows}: batchjac {r['batchjac_s'] * 1e3:.0f} ms, native baseline "
          f"{r['baseline_s'] * 1e3:.0f} ms, ratio {r['ratio']:.2f}x (result: {r['result_kind']})")
