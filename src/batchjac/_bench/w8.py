"""W8: a Hessian that does not fit in memory. The seed model (W1: MLP 8-64-64-4), its
per-instance Hessian w.r.t. the 5 unknowns (100 floats a row), 10,000,000 rows from ``.npy``
files on disk to a Zarr store with ``batchjac.hessian(..., out=store, max_memory="1GB")``,
beside the same at 1,000,000 rows: peak resident memory must not grow with N. Then the crash
test: the 1,000,000-row run is killed with SIGKILL once some of its chunks are recorded, run
again (it resumes), and its store is compared byte for byte with the uninterrupted one.

Every step is its own subprocess (``python -m batchjac._bench.w8 STEP ...``); peak RSS is each
process's ``ru_maxrss``. The inputs are written block by block (:func:`w5.write_inputs`).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from .w5 import _du, write_inputs

SIZES = (1_000_000, 10_000_000)
BACKEND = "jax"
CHECK_ROWS = 500
MAX_MEMORY = "1GB"


def run_hessian(folder: str, store: str) -> None:
    """``batchjac.hessian`` of the memory-mapped inputs into ``store``; prints a JSON summary
    and this process's peak RSS."""
    import batchjac
    from batchjac.examples import workload_model

    model = workload_model("W1", BACKEND)
    u = np.load(os.path.join(folder, "u.npy"), mmap_mode="r")
    k = np.load(os.path.join(folder, "k.npy"), mmap_mode="r")
    start = time.perf_counter()
    batchjac.hessian(model, u, k, out=store, max_memory=MAX_MEMORY)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sys.stdout.write("W8-JSON " + json.dumps({"seconds": seconds, "peak_rss_mb": rss,
                                               "rows_per_second": u.shape[0] / seconds}) + "\n")


def check(folder: str, store: str) -> dict[str, Any]:
    """Sampled stored rows against the float64 Hessian of the same weights (JAX, x64)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import zarr

    from batchjac.examples import mlp_weights

    group: Any = zarr.open_group(store, mode="r")
    name = next(iter(group.array_keys()))
    hess = group[name]
    n = hess.shape[0]
    rows = np.unique(np.random.default_rng(0).integers(0, n, CHECK_ROWS))
    rows[-1] = n - 1  # the padded last chunk
    u = np.load(os.path.join(folder, "u.npy"), mmap_mode="r")
    k = np.load(os.path.join(folder, "k.npy"), mmap_mode="r")
    layers = [(jnp.asarray(w), jnp.asarray(b)) for w, b in mlp_weights((8, 64, 64, 4))]

    def f(z: Any, h: Any) -> Any:
        a = jnp.concatenate([z, h])
        for i, (w, b) in enumerate(layers):
            a = a @ w + b
            if i < len(layers) - 1:
                a = jnp.tanh(a)
        return a

    ref = np.asarray(jax.vmap(jax.hessian(f))(jnp.asarray(u[rows], jnp.float64),
                                              jnp.asarray(k[rows], jnp.float64)))
    got = hess.get_orthogonal_selection((rows, slice(None), slice(None), slice(None)))
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    return {"array": name, "shape": list(hess.shape), "rows_checked": int(rows.size),
            "max_rel_err": err, "finite": bool(np.isfinite(got).all())}


def _python(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchjac._bench.w8", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})


def _summary(proc: subprocess.CompletedProcess[str]) -> dict[str, Any] | None:
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("W8-JSON ")), None)
    return None if line is None else json.loads(line[len("W8-JSON "):])


def measure(n: int, folder: str) -> dict[str, Any]:
    gen = _python(["inputs", folder, str(n)], timeout=1200)
    if gen.returncode:
        return {"n": n, "error": gen.stderr[-400:]}
    store = os.path.join(folder, "hess.zarr")
    proc = _python(["run", folder, store], timeout=3600)
    summary = _summary(proc)
    if proc.returncode or summary is None:
        return {"n": n, "error": (proc.stderr or proc.stdout)[-400:]}
    row: dict[str, Any] = {"n": n, **summary, "store_mb": _du(store) / 1e6}
    chk = _python(["check", folder, store], timeout=600)
    line = next((ln for ln in chk.stdout.splitlines() if ln.startswith("{")), None)
    row["check"] = json.loads(line) if line else {"error": chk.stderr[-300:]}
    return row


def _store_bytes_equal(a: str, b: str) -> bool:
    """Whether two Zarr stores hold the same arrays, bit for bit."""
    import zarr

    ga: Any = zarr.open_group(a, mode="r")
    gb: Any = zarr.open_group(b, mode="r")
    if sorted(ga.array_keys()) != sorted(gb.array_keys()):
        return False
    for name in ga.array_keys():
        xa, xb = ga[name], gb[name]
        if xa.shape != xb.shape or xa.dtype != xb.dtype:
            return False
        step = 1 << 16
        for lo in range(0, xa.shape[0], step):
            if xa[lo:lo + step].tobytes() != xb[lo:lo + step].tobytes():
                return False
    return True


def crash_resume(folder: str, reference: str) -> dict[str, Any]:
    """Kill a run of the same job once at least two chunks are recorded (and before it ends),
    run it again, compare the result with ``reference`` byte for byte."""
    store = os.path.join(folder, "resumed.zarr")
    done = store + ".partial/done"
    cmd = [sys.executable, "-m", "batchjac._bench.w8", "run", folder, store]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    recorded = 0
    deadline = time.monotonic() + 1800
    while proc.poll() is None and time.monotonic() < deadline:
        recorded = len(os.listdir(done)) if os.path.isdir(done) else 0
        if recorded >= 2:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    killed = proc.returncode == -signal.SIGKILL
    landed = killed and not os.path.exists(store) and os.path.isdir(store + ".partial")
    again = _python(["run", folder, store], timeout=3600)
    summary = _summary(again)
    if again.returncode or summary is None:
        return {"killed_after_chunks": recorded, "landed": landed,
                "error": (again.stderr or again.stdout)[-400:]}
    return {"killed_after_chunks": recorded, "landed": landed, "resume_seconds": summary["seconds"],
            "identical": _store_bytes_equal(store, reference)}


def section() -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    crash: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="batchjac-w8-") as tmp:
        for n in SIZES:
            folder = os.path.join(tmp, f"n{n}")
            os.makedirs(folder)
            rows.append(measure(n, folder))
            if n == min(SIZES) and "error" not in rows[-1]:
                crash = crash_resume(folder, os.path.join(folder, "hess.zarr"))
            shutil.rmtree(folder)  # free the disk before the next size
    return {"rows": rows, "crash": crash, "markdown": markdown(rows, crash)}


def markdown(rows: list[dict[str, Any]], crash: dict[str, Any]) -> list[str]:
    md = ["## W8: a Hessian that does not fit, 10,000,000 rows to Zarr", "",
          f"Seed workload W1 (MLP 8-64-64-4, 5 unknown + 3 known inputs), float32, {BACKEND}: "
          "`batchjac.hessian(model, u, k, out=\"hess.zarr\", max_memory=\"1GB\")` with `u`, `k` "
          "memory-mapped `.npy` files (32 bytes a row); the Hessians are 400 bytes a row (4 GB "
          "at 10M rows), written chunk by chunk, each chunk recorded for resume. Time is the "
          "call's own (compilation included, interpreter and framework import excluded); peak "
          "RSS is the whole process.", "",
          "| rows | time | rows/s | peak RSS | store on disk | check: max rel err vs float64 |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['n']:,} | failed: {r['error']!r} |||||")
            continue
        chk = r.get("check", {})
        err = f"{chk['max_rel_err']:.1e} ({chk['rows_checked']} rows)" if "max_rel_err" in chk else \
            f"failed: {chk.get('error', '?')!r}"
        md.append(f"| {r['n']:,} | {r['seconds']:.1f} s | {r['rows_per_second']:,.0f} | "
                  f"**{r['peak_rss_mb']:,.0f} MB** | {r['store_mb']:,.0f} MB | {err} |")
    ok = [r for r in rows if "error" not in r]
    if len(ok) == 2:
        a, b = ok
        md += ["", f"Peak RSS {a['peak_rss_mb']:,.0f} MB at {a['n']:,} rows and "
               f"{b['peak_rss_mb']:,.0f} MB at {b['n']:,} rows "
               f"({b['peak_rss_mb'] / a['peak_rss_mb']:.2f}x for 10x the rows)."]
    if crash:
        if "error" in crash:
            md += ["", f"Crash test failed: {crash['error']!r}"]
        else:
            md += ["", f"Crash test ({min(SIZES):,} rows): SIGKILL after "
                   f"{crash['killed_after_chunks']} recorded chunks (the kill landed mid-run: "
                   f"{'yes' if crash['landed'] else 'NO'}), then the same call again: it resumed "
                   f"in {crash['resume_seconds']:.1f} s and its store is "
                   f"**{'byte-identical' if crash['identical'] else 'DIFFERENT'}** to the "
                   "uninterrupted run's."]
    md.append("")
    return md


def main(argv: list[str]) -> None:
    what, *args = argv
    if what == "inputs":
        write_inputs(args[0], int(args[1]))
    elif what == "run":
        run_hessian(args[0], args[1])
    elif what == "check":
        sys.stdout.write(json.dumps(check(args[0], args[1])) + "\n")
    elif what == "section":
        res = section()
        sys.stdout.write("\n".join(res["markdown"]) + "\n")
    else:
        raise SystemExit(f"unknown step {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
