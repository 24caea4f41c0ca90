"""Dask scale-out figures: W2 (MLP 784-256-256-10, N=100,000) written to Zarr by the local path
(one process, the framework's own threads on both cores) and by 2 single-threaded Dask worker
processes (same total cores), in one run; plus the per-task overhead of the Dask path.

Each measurement runs in its own subprocess, so the local run and the cluster do not share
thread pools. The model is the TensorFlow one (the W2 model of every backend is the same).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

N = 100_000
CHUNK = 2000
TINY_TASKS = 200


def _local(path: str, n: int) -> dict[str, Any]:
    import batchjac
    from batchjac.examples import workload_inputs, workload_model

    model = workload_model("W2", "tensorflow")
    x, _ = workload_inputs("W2", n)
    batchjac.jacobian(model, x[:CHUNK], chunk_size=CHUNK)  # compile outside the timing
    start = time.perf_counter()
    batchjac.jacobian(model, x, out=path, chunk_size=CHUNK)
    return {"seconds": time.perf_counter() - start}


def _cluster(path: str, n: int) -> dict[str, Any]:
    import batchjac
    from batchjac._dask import make_client
    from batchjac.examples import workload_inputs, workload_model

    client = make_client("local:2")
    try:
        model = workload_model("W2", "tensorflow")
        x, _ = workload_inputs("W2", n)
        # warm-up: workers import TensorFlow and compile, as a long-running cluster would have
        batchjac.jacobian(model, x[: 4 * CHUNK], client=client, rows_per_task=CHUNK)
        start = time.perf_counter()
        batchjac.jacobian(model, x, out=path, chunk_size=CHUNK, client=client)
        seconds = time.perf_counter() - start
        # per-task overhead: many tiny tasks of the seed workload (10 rows each)
        from batchjac.examples import seed_model, workload_inputs as wi

        seed = seed_model("tensorflow")
        u, maybe_h = wi("W1", TINY_TASKS * 10)
        assert maybe_h is not None  # W1 has known inputs
        h = maybe_h
        batchjac.jacobian(seed, u[:40], h[:40], client=client, rows_per_task=10)  # warm-up
        t0 = time.perf_counter()
        batchjac.jacobian(seed, u, h, client=client, rows_per_task=10)
        tiny = time.perf_counter() - t0
        batchjac.jacobian(seed, u[:10], h[:10], chunk_size=10)  # compile the local 10-row kernel
        t0 = time.perf_counter()
        for i in range(20):  # the same 10-row work, local and serial, to subtract
            batchjac.jacobian(seed, u[i * 10:(i + 1) * 10], h[i * 10:(i + 1) * 10], chunk_size=10)
        local_tiny = (time.perf_counter() - t0) / 20
        workers = 2
        overhead = tiny * workers / TINY_TASKS - local_tiny
        return {"seconds": seconds, "task_overhead_s": overhead, "tiny_wall_s": tiny}
    finally:
        client.close()
        client.cluster.close()


def section(n: int = N) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="batchjac-dask-") as tmp:
        for which in ("local", "cluster"):
            path = os.path.join(tmp, f"{which}.zarr")
            proc = subprocess.run([sys.executable, "-m", "batchjac._bench.dask_bench", which, path, str(n)],
                                  capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("DASK-JSON ")), None)
            results[which] = json.loads(line[10:]) if line else {"error": proc.stderr[-400:]}
        if all("error" not in r for r in results.values()):
            import zarr

            a: Any = zarr.open_group(os.path.join(tmp, "local.zarr"), mode="r")["jacobians"]
            b: Any = zarr.open_group(os.path.join(tmp, "cluster.zarr"), mode="r")["jacobians"]
            idx = np.linspace(0, n - 1, 200).astype(int)
            ra, rb = a.get_orthogonal_selection((idx,)), b.get_orthogonal_selection((idx,))
            results["max_rel_diff"] = float(np.abs(ra - rb).max() / np.abs(ra).max())
    md = [f"## Dask: W2, N={n:,}, written to Zarr, local path vs 2 single-threaded workers", ""]
    loc, clu = results["local"], results["cluster"]
    if "error" in loc or "error" in clu:
        md += [f"failed: {loc.get('error') or clu.get('error')!r}", ""]
        return {"rows": [results], "markdown": md}
    r_loc, r_clu = n / loc["seconds"], n / clu["seconds"]
    md += [
        f"Chunks of {CHUNK:,} rows (one task each); warm workers (imported and compiled before the timing, "
        "as on a long-running cluster). The cluster is a `LocalCluster` of 2 worker processes with "
        "1 thread each (`batchjac compute --scheduler local:2`); the local path is one process "
        "using both cores.", "",
        "| path | time | rows/s | ratio to local |", "|---|---|---|---|",
        f"| local (1 process, 2 threads) | {loc['seconds']:.1f} s | {r_loc:,.0f} | 1.00 |",
        f"| Dask (2 workers x 1 thread) | {clu['seconds']:.1f} s | {r_clu:,.0f} | **{r_clu / r_loc:.2f}** |",
        "",
        f"Results agree: max |J_dask - J_local| / max |J_local| = {results['max_rel_diff']:.1e} on 200 "
        "rows spread over the store.",
        "",
        f"Per-task overhead of the Dask path: {clu['task_overhead_s'] * 1e3:.1f} ms per task "
        f"({TINY_TASKS} tasks of 10 rows of W1 in {clu['tiny_wall_s']:.2f} s on 2 workers, minus the "
        "same 10-row work done locally).", "",
    ]
    return {"rows": [results], "markdown": md}


if __name__ == "__main__":
    which, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    res = _local(path, n) if which == "local" else _cluster(path, n)
    sys.stdout.write("DASK-JSON " + json.dumps(res) + "\n")
