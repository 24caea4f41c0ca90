"""Native arrays in and out (issue 17): W2 (MLP 784-256-256-10, every input unknown) with the
framework's own arrays given to batchjac, against the native baseline that keeps its arrays
native too (torch: ``vmap(jacrev)`` of the per-instance function on a tensor; JAX:
``jit(vmap(jacrev))`` on a JAX array, waited for with ``block_until_ready``). Both return the
framework's arrays; nothing is copied to the host by either.

Call :func:`measure` from the bench (one row per framework), or run
``python -m batchjac._bench.arrays [torch|jax] [N]`` for a quick look. Timings are interleaved
(batchjac, baseline, batchjac, ...) in one process after warm-up calls and calls until
batchjac's tuning has settled (no race due), and the medians compared.
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
    _settle(lambda: wait(ours()))
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


def _settle(call: Callable[[], object]) -> None:
    """Call batchjac until no bound model has a race to come, as the steady table does
    (:func:`batchjac._bench.worker.settle`): a build chosen untimed for the first calls (torch's
    looped pass) is raced once the work repays it, and the row compares the settled choice."""
    from batchjac import _backends
    from batchjac._tune import policy as _tuning

    from .worker import SETTLE_SECONDS

    def due() -> bool:
        return any(_tuning.pending(b) for models in list(_backends._bound.values())
                   for b in models.values())

    start = time.perf_counter()
    while due() and time.perf_counter() - start < SETTLE_SECONDS:
        call()


FRAMEWORKS = ("torch", "jax")
REPEATS = 11


def section() -> dict[str, Any]:
    """The bench's "native arrays" section: one fresh process per framework (its own empty
    tuning cache), :func:`measure` on W2 with N=10,000."""
    import json
    import os
    import subprocess
    import tempfile

    rows = []
    for fw in FRAMEWORKS:
        with tempfile.TemporaryDirectory(prefix="batchjac-bench-cache-") as cache:
            proc = subprocess.run([sys.executable, "-m", "batchjac._bench.arrays", fw, "10000", "--json"],
                                  capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "BATCHJAC_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ARRAYS-JSON ")), None)
        rows.append(json.loads(line[len("ARRAYS-JSON "):]) if line else
                    {"framework": fw, "error": (proc.stderr or proc.stdout)[-300:]})
    return {"rows": rows, "markdown": markdown(rows)}


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    md = ["## Native arrays in and out: W2, N=10,000", "",
          "The framework's own arrays into batchjac (a torch tensor, a JAX array on its default "
          "device) against the native baseline that keeps its arrays native too (torch "
          "`vmap(jacrev)` on the tensor; JAX `jit(vmap(jacrev))` waited for with "
          "`block_until_ready`). batchjac's result is the framework's array (the kind column), "
          "with no copy to the host. Medians of "
          f"{REPEATS} interleaved calls after warm-up and calls until batchjac's tuning settled "
          "(no race due), one fresh process per framework.", "",
          "| framework | batchjac result kind | batchjac | native baseline | batchjac / native |",
          "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['framework']} | failed: {r['error']!r} ||||")
            continue
        md.append(f"| {r['framework']} | {r['result_kind']} | {r['batchjac_s'] * 1e3:.1f} ms | "
                  f"{r['baseline_s'] * 1e3:.1f} ms | **{r['ratio']:.2f}** |")
    md.append("")
    return md


if __name__ == "__main__":  # pragma: no cover - a manual look
    fw = sys.argv[1] if len(sys.argv) > 1 else "torch"
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    if "--json" in sys.argv:
        import json

        res = measure(fw, rows, repeats=REPEATS)
        sys.stdout.write("ARRAYS-JSON " + json.dumps({k: v for k, v in res.items() if k != "runs"}) + "\n")
        raise SystemExit(0)
    r = measure(fw, rows)
    print(f"{fw} W2 N={rows}: batchjac {r['batchjac_s'] * 1e3:.0f} ms, native baseline "
          f"{r['baseline_s'] * 1e3:.0f} ms, ratio {r['ratio']:.2f}x (result: {r['result_kind']})")
