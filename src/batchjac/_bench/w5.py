"""W5: the seed workload (W1: MLP 8-64-64-4, 5 unknown + 3 known inputs) over 10,000,000 rows,
streamed from ``.npy`` files on disk to a Zarr store with ``batchjac compute``, and the same at
1,000,000 rows: throughput, and peak resident memory side by side (it must not grow with N).

Every step runs in its own subprocess: writing the seed model to a ``.keras`` file, writing the
inputs block by block (never the whole array in memory), the two ``batchjac compute`` runs
(peak RSS is each process's ``ru_maxrss``: Python, TensorFlow, the model and the chunks in
flight), and a check of 2,000 stored rows spread over the 10M against the float64 closed form.
"""

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

SIZES = (1_000_000, 10_000_000)
BLOCK = 1 << 20
CHECK_ROWS = 2000


def write_inputs(folder: str, n: int) -> None:
    """``u.npy`` (n, 5) and ``k.npy`` (n, 3), float32, written block by block."""
    u = np.lib.format.open_memmap(os.path.join(folder, "u.npy"), mode="w+", dtype=np.float32, shape=(n, 5))
    k = np.lib.format.open_memmap(os.path.join(folder, "k.npy"), mode="w+", dtype=np.float32, shape=(n, 3))
    for lo in range(0, n, BLOCK):
        rows = min(BLOCK, n - lo)
        x = np.random.default_rng([1, lo]).standard_normal((rows, 8), dtype=np.float32)
        u[lo:lo + rows] = x[:, :5]
        k[lo:lo + rows] = x[:, 5:]
        u.flush()
        k.flush()
    del u, k


def write_model(path: str) -> None:
    from batchjac.examples import seed_model

    seed_model("tensorflow").save(path)


def run_compute(args: list[str]) -> None:
    """``batchjac compute ARGS`` in this process, then this process's peak RSS."""
    from batchjac.cli.compute import compute

    try:
        compute.main(args, prog_name="batchjac compute", standalone_mode=False)
    finally:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        sys.stdout.write(f"W5-RSS {rss}\n")


def check(folder: str, store: str) -> dict[str, Any]:
    """Relative error of sampled stored rows against the float64 closed-form Jacobian."""
    import zarr

    from batchjac.examples import mlp_jacobian, mlp_weights

    jac: Any = zarr.open_group(store, mode="r")["jacobians"]
    n = jac.shape[0]
    rows = np.unique(np.random.default_rng(0).integers(0, n, CHECK_ROWS))
    rows[-1] = n - 1  # the padded last chunk
    u = np.load(os.path.join(folder, "u.npy"), mmap_mode="r")
    k = np.load(os.path.join(folder, "k.npy"), mmap_mode="r")
    x = np.concatenate([u[rows], k[rows]], axis=1).astype(np.float64)
    ref = mlp_jacobian(mlp_weights((8, 64, 64, 4)), x)[..., :5]
    got = jac.get_orthogonal_selection((rows, slice(None), slice(None)))
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    return {"rows_checked": int(rows.size), "max_rel_err": err, "finite": bool(np.isfinite(got).all())}


def _python(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, "-m", "batchjac._bench.w5", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure(n: int, folder: str, model: str) -> dict[str, Any]:
    gen = _python(["inputs", folder, str(n)], timeout=1200)
    if gen.returncode:
        return {"n": n, "error": gen.stderr[-400:]}
    store = os.path.join(folder, "jac.zarr")
    start = time.perf_counter()
    proc = _python(["compute", model, "-i", os.path.join(folder, "u.npy"), "-k",
                    os.path.join(folder, "k.npy"), "-o", store, "--json", "-q"], timeout=3600)
    wall = time.perf_counter() - start
    summary = next((json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
    rss = next((float(ln.split()[1]) for ln in proc.stdout.splitlines() if ln.startswith("W5-RSS")), None)
    if proc.returncode or summary is None:
        return {"n": n, "error": (proc.stderr or proc.stdout)[-400:]}
    row: dict[str, Any] = {"n": n, "peak_rss_mb": rss, "process_seconds": wall, **summary,
                           "store_mb": _du(store) / 1e6,
                           "input_mb": 32 * n / 1e6}
    if n == max(SIZES):
        chk = _python(["check", folder, store], timeout=600)
        line = next((ln for ln in chk.stdout.splitlines() if ln.startswith("{")), None)
        row["check"] = json.loads(line) if line else {"error": chk.stderr[-300:]}
    return row


def section() -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="batchjac-w5-") as tmp:
        model = os.path.join(tmp, "seed.keras")
        made = _python(["model", model], timeout=600)
        if made.returncode:
            rows = [{"n": n, "error": made.stderr[-400:]} for n in SIZES]
        else:
            for n in SIZES:
                folder = os.path.join(tmp, f"n{n}")
                os.makedirs(folder)
                rows.append(measure(n, folder, model))
                for name in os.listdir(folder):  # free the disk before the next size
                    path = os.path.join(folder, name)
                    if os.path.isdir(path):
                        import shutil

                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
    return {"rows": rows, "markdown": markdown(rows)}


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    md = ["## W5: 10,000,000 rows streamed to Zarr (`batchjac compute`)", "",
          "Seed workload W1 (MLP 8-64-64-4, 5 unknown + 3 known inputs), float32, TensorFlow. "
          "The inputs are two `.npy` files on disk (32 bytes a row), read chunk by chunk; the "
          "Jacobians (80 bytes a row) go to a Blosc-compressed Zarr store chunk by chunk, each "
          "chunk fsynced and recorded for resume. Default options (memory budget from the "
          "machine, `--mode auto`). Time is the command's own (model loading and compilation "
          "included, interpreter and TensorFlow import excluded); peak RSS is the whole process.",
          "", "| rows | time | rows/s | peak RSS | mode, chunk | store on disk |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['n']:,} | failed: {r['error']!r} |||||")
            continue
        md.append(f"| {r['n']:,} | {r['seconds']:.1f} s | {r['rows_per_second']:,.0f} | "
                  f"**{r['peak_rss_mb']:,.0f} MB** | {r['mode']}, {r['chunks']} x {r['chunk_size']:,} "
                  f"| {r['store_mb']:,.0f} MB |")
    ok = [r for r in rows if "error" not in r]
    if len(ok) == 2:
        a, b = ok
        md += ["", f"Peak RSS {a['peak_rss_mb']:,.0f} MB at {a['n']:,} rows and "
               f"{b['peak_rss_mb']:,.0f} MB at {b['n']:,} rows "
               f"({b['peak_rss_mb'] / a['peak_rss_mb']:.2f}x for 10x the rows)."]
        chk = b.get("check", {})
        if "max_rel_err" in chk:
            md.append(f"Check: {chk['rows_checked']:,} stored rows spread over the 10M (and the "
                      f"last) against the float64 closed form: max relative error "
                      f"{chk['max_rel_err']:.1e}.")
    md.append("")
    return md


def main(argv: list[str]) -> None:
    what, *args = argv
    if what == "inputs":
        write_inputs(args[0], int(args[1]))
    elif what == "model":
        write_model(args[0])
    elif what == "compute":
        run_compute(args)
    elif what == "check":
        sys.stdout.write(json.dumps(check(args[0], args[1])) + "\n")
    elif what == "section":
        res = section()
        sys.stdout.write("\n".join(res["markdown"]) + "\n")
        sys.stdout.write("W5-JSON " + json.dumps(res["rows"]) + "\n")
    else:
        raise SystemExit(f"unknown step {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
