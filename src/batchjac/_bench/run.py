"""`batchjac bench`: every workload in every installed backend, one subprocess each, then
BENCHMARKS.md and a PNG chart of the ratios from that one run."""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Job:
    workload: str
    n: int


FULL = [Job("W1", 1000), Job("W1", 100_000), Job("W2", 10_000), Job("W3", 1000), Job("W4", 2000)]
QUICK = [Job("W1", 1000), Job("W2", 1000), Job("W3", 250), Job("W4", 500)]
BACKENDS = ("tensorflow", "torch", "jax")


def installed_backends() -> list[str]:
    return [b for b in BACKENDS if importlib.util.find_spec(b) is not None]


def run_job(job: Job, backend: str, *, repeats: int, loop_rows: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "batchjac._bench.worker", job.workload, backend, str(job.n),
           "--repeats", str(repeats), "--loop-rows", str(loop_rows)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH-JSON "):
            return json.loads(line[len("BENCH-JSON "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"workload": job.workload, "backend": backend, "n": job.n, "error": " | ".join(tail)}


def machine() -> dict[str, str]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    versions = {}
    for mod in ("numpy", "tensorflow", "keras", "torch", "jax"):
        try:
            versions[mod] = __import__("importlib.metadata").metadata.version(mod if mod != "tensorflow"
                                                                            else "tensorflow-cpu")
        except Exception:
            try:
                versions[mod] = __import__("importlib.metadata").metadata.version(mod)
            except Exception:
                continue
    return {"cpu": cpu, "cores": str(os.cpu_count()), "memory": mem, "python": platform.python_version(),
            "platform": platform.platform(), "versions": ", ".join(f"{k} {v}" for k, v in versions.items())}


def _case(res: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    return next((c for c in res["cases"] if c["name"].startswith(prefix)), None)


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    ours = _case(res, "batchjac")
    assert ours is not None
    best = _case(res, res["best_expert"])
    fwd = min((c for c in res["cases"] if c["role"] == "forward"), key=lambda c: c["median_s"])
    b1, b0 = _case(res, "B1"), _case(res, "B0")
    t = ours["median_s"]
    return {
        "t": t,
        "best_name": res["best_expert"],
        "t_best": best["median_s"] if best else None,
        "ratio_best": t / best["median_s"] if best else None,
        "vs_b1": b1["median_s"] / t if b1 else None,
        "vs_b0": b0["median_s"] / t if b0 else None,
        "bound": t / (fwd["median_s"] * (1 + min(res["k"], res["m"]))),
        "err": ours["max_rel_err_vs_best"],
        "rss": res.get("peak_rss_mb_after_batchjac"),
        "compile": ours["compile_s"],
    }


def _fmt_t(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3g} ms" if s < 10 else f"{s:.3g} s"


def _fmt_x(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write_markdown(path: Path, results: list[dict[str, Any]], extra: list[dict[str, Any]], *,
                   command: str, started: str, wall: float, chart: str | None) -> None:
    info = machine()
    lines = [
        "# Benchmarks",
        "",
        f"Produced by `{command}` on {started} (UTC), one run, {wall / 60:.1f} min wall time.",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory']} memory, no GPU; "
        f"Python {info['python']}; {info['versions']}.",
        "",
        "Method: each (workload, backend) runs in its own process. Every case is called once to "
        "compile and warm up (that first call minus the steady median is the compile time), then "
        "all cases are timed in interleaved rounds; figures are medians of the rounds, and a "
        "round of a fast case is the mean of as many back-to-back calls as fill ~20 ms (at most "
        "50), as timeit does. Every case takes numpy "
        "inputs and returns a numpy Jacobian. B0 (the per-instance loop) is timed on a subset of "
        "rows and scaled to N. The best baseline is the fastest of B1-B4 in the same framework; "
        "errors are max |J - J_best| / max |J_best| against it. Forward-mode baselines (jacfwd) are left out "
        "where the unknowns outnumber the outputs 8 to 1 or more (W2, W4: 784 vs 10): there "
        "they need 8+ GB and are several times slower than jacrev, which is always timed. "
        "The autodiff-bound ratio is "
        "T_jac / (T_F * (1 + min(k, m))) with T_F one compiled forward pass of the same batch "
        "(for TensorFlow the faster of XLA and a plain graph). "
        "Peak RSS is the process's peak resident memory right after batchjac's first call "
        "(framework import, model, data and batchjac's work included).",
        "",
        "## Summary",
        "",
        "| workload | N | backend | batchjac | best baseline | batchjac / best | speed-up vs B1 | "
        "speed-up vs B0 | autodiff-bound ratio | max rel err | compile | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        if "error" in res:
            lines.append(f"| {res['workload']} | {res['n']:,} | {res['backend']} | failed: "
                         f"{res['error'][:200]} |||||||||")
            continue
        s = summarise(res)
        lines.append(
            f"| {res['workload']} | {res['n']:,} | {res['backend']} | {_fmt_t(s['t'])} | "
            f"{s['best_name']}: {_fmt_t(s['t_best'])} | **{_fmt_x(s['ratio_best'])}** | "
            f"{_fmt_x(s['vs_b1'], 1)}{'x' if s['vs_b1'] else ''} | "
            f"{_fmt_x(s['vs_b0'], 0)}{'x' if s['vs_b0'] else ''} | {_fmt_x(s['bound'])} | "
            f"{s['err']:.1e} | {s['compile']:.2f} s | {s['rss']:.0f} MB |"
        )
    if chart:
        lines += ["", f"![ratios]({chart})"]
    lines += ["", "## All cases", ""]
    for res in results:
        if "error" in res:
            continue
        lines += [f"### {res['workload']} ({res['description']}), N={res['n']:,}, {res['backend']}, "
                  f"k={res['k']}, m={res['m']}", "",
                  "| case | median | compile | time / batchjac | max rel err vs best | timed repeats |",
                  "|---|---|---|---|---|---|"]
        t_ours = _case(res, "batchjac")["median_s"]  # type: ignore[index]
        for c in res["cases"]:
            err = c["max_rel_err_vs_best"]
            comp = "-" if c["compile_s"] is None else f"{c['compile_s']:.2f} s"
            lines.append(f"| {c['name']} | {_fmt_t(c['median_s'])} | {comp} | "
                         f"{c['median_s'] / t_ours:.2f} | {'-' if err is None else f'{err:.1e}'} | "
                         f"{c['n_timed']} |")
        lines.append("")
        if res.get("batchjac_plan"):
            lines += ["batchjac's choices (its debug log): " +
                      "; ".join(res["batchjac_plan"]), ""]
    for block in extra:
        lines += block["markdown"]
    path.write_text("\n".join(lines) + "\n")


def write_chart(path: Path, results: list[dict[str, Any]]) -> bool:
    """Grouped bars: one group per workload and N, one bar per backend (colour, legend)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if "error" not in r]
    groups = list(dict.fromkeys((r["workload"], r["n"]) for r in ok))
    backends = list(dict.fromkeys(r["backend"] for r in ok))
    colors = {"tensorflow": "#ff8f00", "torch": "#ee4c2c", "jax": "#4285f4"}
    labels = [f"{w}\nN={n:,}" for w, n in groups]
    width = 0.8 / max(1, len(backends))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))

    def grouped(ax: Any, value: Callable[[dict[str, Any]], float | None]) -> None:
        for j, backend in enumerate(backends):
            xs, hs = [], []
            for r in ok:
                v = value(summarise(r)) if r["backend"] == backend else None
                if v is not None:
                    xs.append(groups.index((r["workload"], r["n"])) + (j - (len(backends) - 1) / 2) * width)
                    hs.append(v)
            ax.bar(xs, hs, width, label=backend, color=colors.get(backend, "grey"))
        ax.set_xticks(range(len(groups)), labels, fontsize=9)

    grouped(axes[0], lambda s: s["ratio_best"])
    axes[0].axhline(1.0, color="black", lw=1, ls="--")
    axes[0].set_title("batchjac time / best baseline, same framework\n(goal <= 1)")
    axes[0].legend(fontsize=8)
    grouped(axes[1], lambda s: s["bound"])
    axes[1].axhline(1.0, color="black", lw=1, ls="--")
    axes[1].set_title("autodiff-bound ratio T_jac / (T_F (1 + min(k, m)))\n(goal <= 1)")
    tf_runs = [r for r in ok if r["backend"] == "tensorflow"]
    tf_sums = [summarise(r) for r in tf_runs]
    axes[2].bar([i - 0.2 for i in range(len(tf_runs))], [s["vs_b1"] for s in tf_sums], 0.4,
                label="vs B1 eager batch_jacobian", color="#ffb74d")
    axes[2].bar([i + 0.2 for i in range(len(tf_runs))], [s["vs_b0"] for s in tf_sums], 0.4,
                label="vs B0 per-instance loop", color="#e65100")
    axes[2].set_yscale("log")
    axes[2].set_xticks(range(len(tf_runs)), [f"{r['workload']}\nN={r['n']:,}" for r in tf_runs],
                       fontsize=9)
    axes[2].set_title("TensorFlow: batchjac speed-up over what users write (log)")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(*, quick: bool, output: Path, backends: list[str] | None, workloads: list[str] | None,
         log: Callable[[str], None], command: str, extras: list[Callable[[], dict[str, Any]]] | None = None
         ) -> list[dict[str, Any]]:
    started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    t0 = time.perf_counter()
    jobs = [j for j in (QUICK if quick else FULL) if not workloads or j.workload in workloads]
    chosen = [b for b in installed_backends() if not backends or b in backends]
    repeats, loop_rows = (3, 10) if quick else (11, 100)
    results = []
    for job in jobs:
        for backend in chosen:
            log(f"bench {job.workload} N={job.n:,} {backend} ...")
            res = run_job(job, backend, repeats=repeats, loop_rows=loop_rows, timeout=1200)
            if "error" in res:
                log(f"  failed: {res['error']}")
            else:
                s = summarise(res)
                log(f"  batchjac {_fmt_t(s['t'])}, best {s['best_name']} {_fmt_t(s['t_best'])}, "
                    f"ratio {s['ratio_best']:.2f}, bound {s['bound']:.2f}")
            results.append(res)
    extra_blocks = []
    for fn in extras or []:
        log(f"section {fn.__module__.rsplit('.', 1)[-1]} ...")
        extra_blocks.append(fn())
    output.parent.mkdir(parents=True, exist_ok=True)
    chart = output.with_name(output.stem.lower() + "-ratios.png")
    has_chart = write_chart(chart, results)
    write_markdown(output, results, extra_blocks, command=command, started=started,
                   wall=time.perf_counter() - t0, chart=chart.name if has_chart else None)
    log(f"wrote {output}" + (f" and {chart}" if has_chart else ""))
    return results
