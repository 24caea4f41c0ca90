"""Peak memory of an out-of-core run: W2 with N=100,000 written to an ``np.memmap`` with
``max_memory="1GB"`` (issue: peak resident memory at most 1.5 GB). One subprocess per backend;
figures are the process's peak RSS (``ru_maxrss``)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

N = 100_000


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(backend: str, n: int, path: str) -> dict[str, Any]:
    import batchjac
    from batchjac.examples import workload_inputs, workload_model

    model = workload_model("W2", backend)
    x, _ = workload_inputs("W2", n)
    rss_before = _rss_mb()
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, 10, 784))
    start = time.perf_counter()
    batchjac.jacobian(model, x, out=out, max_memory="1GB")
    wall = time.perf_counter() - start
    check = np.load(path, mmap_mode="r")[-3:]
    ref = batchjac.jacobian(model, x[-3:])
    err = float(np.abs(check - ref).max() / np.abs(ref).max())
    return {"backend": backend, "n": n, "rss_before_mb": rss_before, "peak_rss_mb": _rss_mb(),
            "seconds": wall, "input_mb": x.nbytes / 1e6, "result_mb": out.nbytes / 1e6, "tail_err": err}


def section() -> dict[str, Any]:
    from .run import installed_backends

    rows: list[dict[str, Any]] = []
    for backend in installed_backends():
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "jac.npy")
            proc = subprocess.run([sys.executable, "-m", "batchjac._bench.memory", backend, path],
                                  capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MEM-JSON ")), None)
        rows.append(json.loads(line[9:]) if line else {"backend": backend, "error": proc.stderr[-300:]})
    md = ["## Memory: W2, N=100,000, out= np.memmap, max_memory=\"1GB\"", "",
          "The result (3.1 GB) is written chunk by chunk into a memory-mapped .npy file; the inputs "
          "(314 MB) are in memory. Peak RSS is the whole process (framework, model, inputs, chunks).",
          "", "| backend | peak RSS | RSS before the call | time | rows/s | tail check (rel err) |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['backend']} | failed: {r['error']!r} |||||")
            continue
        md.append(f"| {r['backend']} | **{r['peak_rss_mb'] / 1024:.2f} GB** | "
                  f"{r['rss_before_mb'] / 1024:.2f} GB"
                  f" | {r['seconds']:.1f} s | {r['n'] / r['seconds']:,.0f} | {r['tail_err']:.1e} |")
    md.append("")
    return {"rows": rows, "markdown": md}


if __name__ == "__main__":
    res = measure(sys.argv[1], int(sys.argv[3]) if len(sys.argv) > 3 else N, sys.argv[2])
    sys.stdout.write("MEM-JSON " + json.dumps(res) + "\n")
