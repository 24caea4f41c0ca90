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

from . import cold as _cold


@dataclass(frozen=True)
class Job:
    workload: str
    n: int


FULL = [Job("W1", 1000), Job("W1", 100_000), Job("W2", 10_000), Job("W3", 1000), Job("W4", 2000),
        Job("W6", 10_000), Job("W7", 100_000), Job("W7H", 100_000)]
QUICK = [Job("W1", 1000), Job("W2", 1000), Job("W3", 250), Job("W4", 500), Job("W6", 1000),
         Job("W7", 2000), Job("W7H", 2000)]
BACKENDS = ("tensorflow", "torch", "jax")


def installed_backends() -> list[str]:
    return [b for b in BACKENDS if importlib.util.find_spec(b) is not None]


def installed_keras_cases() -> list[str]:
    """The Keras 3 cases (a Keras model on the JAX or PyTorch Keras backend) whose Keras and
    framework are installed."""
    if importlib.util.find_spec("keras") is None:
        return []
    return [case for case, framework in _cold.KERAS.items()
            if importlib.util.find_spec(framework) is not None]


def run_job(job: Job, backend: str, *, repeats: int, loop_rows: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "batchjac._bench.worker", job.workload, backend, str(job.n),
           "--repeats", str(repeats), "--loop-rows", str(loop_rows)]
    import tempfile

    # a fresh tuning cache per case: the steady state is what this process's own tuning
    # reaches, not decisions earlier runs on this machine left in the user's cache
    with tempfile.TemporaryDirectory(prefix="batchjac-bench-cache-") as cache:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore",
               "BATCHJAC_CACHE_DIR": cache}
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
        # the bound counts first-order passes; second-order workloads (W6, W7) have none
        "bound": None if res.get("order") == 2 else t / (fwd["median_s"] * (1 + min(res["k"], res["m"]))),
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


def summary_rows(results: list[dict[str, Any]],
                 cold_summaries: dict[tuple[str, int, str], dict[str, Any]]) -> list[str]:
    """The rows of the summary table: every steady-state result with its cold and warm-cache
    cells, then the cold results that have no steady-state row (``--only-cold``)."""
    lines = []
    seen = set()
    for res in results:
        key = (res["workload"], res["n"], res["backend"])
        seen.add(key)
        cold, warm = _cold.headline_cells(cold_summaries.get(key))
        if "error" in res:
            lines.append(f"| {res['workload']} | {res['n']:,} | {res['backend']} | failed: "
                         f"{res['error'][:200]} ||| {cold} | {warm} ||||||")
            continue
        s = summarise(res)
        lines.append(
            f"| {res['workload']} | {res['n']:,} | {res['backend']} | {_fmt_t(s['t'])} | "
            f"{s['best_name']}: {_fmt_t(s['t_best'])} | **{_fmt_x(s['ratio_best'])}** | "
            f"{cold} | {warm} | "
            f"{_fmt_x(s['vs_b1'], 1)}{'x' if s['vs_b1'] else ''} | "
            f"{_fmt_x(s['vs_b0'], 0)}{'x' if s['vs_b0'] else ''} | {_fmt_x(s['bound'])} | "
            f"{s['err']:.1e} | {s['compile']:.2f} s | {s['rss']:.0f} MB |"
        )
    for key, cs in cold_summaries.items():
        if key not in seen:
            cold, warm = _cold.headline_cells(cs)
            lines.append(f"| {key[0]} | {key[1]:,} | {key[2]} | - | - | - | {cold} | {warm} "
                         "| - | - | - | - | - | - |")
    return lines


def write_markdown(path: Path, results: list[dict[str, Any]], extra: list[dict[str, Any]], *,
                   command: str, started: str, wall: float, chart: str | None,
                   cold: list[dict[str, Any]] | None = None) -> None:
    cold_summaries = _cold.by_key(cold or [])
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
        "| workload | N | backend | batchjac | best baseline | batchjac / best | cold: first call "
        "/ native first call | warm cache | speed-up vs B1 | "
        "speed-up vs B0 | autodiff-bound ratio | max rel err | compile | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += summary_rows(results, cold_summaries)
    if cold_summaries:
        lines += ["", "batchjac / best is steady state (the same framework's best baseline); "
                  "cold is the first call of each in a fresh process (compilation, probes and "
                  "tuning included) and warm cache a second fresh batchjac process with the same "
                  "`BATCHJAC_CACHE_DIR`: see \"First call in a fresh process\" below."]
        lines += _cold.closure_lines(cold_summaries)
    if chart:
        lines += ["", f"![ratios]({chart})"]
    if cold:
        lines += ["", *_cold.section(cold)]
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
                      "; ".join(dict.fromkeys(res["batchjac_plan"])), ""]
        if res.get("batchjac_tuning"):
            t = res["batchjac_tuning"]
            lines += [f"Steady state measured after batchjac's tuning settled: {t['calls']} calls, "
                      f"{t['seconds']:.1f} s" + ("" if t["settled"] else
                                                 " (stopped at the time limit, races still due)"), ""]
    for block in extra:
        lines += block["markdown"]
    path.write_text("\n".join(lines) + "\n")


#: bar styles of the cold panel: (label, hatch, alpha)
_KINDS = {"steady": ("steady state", "", 1.0), "cold": ("first call, fresh process", "//", 0.75),
          "warm": ("first call, warm cache", "..", 0.5),
          "closure_1": ("JAX fresh closure, call 1", "xx", 0.75),
          "closure_rest": ("JAX fresh closure, calls 2+", "--", 0.5)}
_COLORS = {"tensorflow": "#ff8f00", "torch": "#ee4c2c", "jax": "#4285f4"}


def cold_bars(results: list[dict[str, Any]], cold_summaries: dict[tuple[str, int, str], dict[str, Any]]
              ) -> tuple[list[str], list[tuple[float, float, str, str]], float]:
    """The cold panel's groups (one per workload and N with cold results) and bars
    ``(x, ratio, backend, kind)``: per backend steady, cold and warm-cache ratios side by side,
    and for JAX the fresh-closure ratios."""
    steady = {(r["workload"], r["n"], r["backend"]): summarise(r)["ratio_best"]
              for r in results if "error" not in r}
    groups = list(dict.fromkeys((w, n) for w, n, _ in cold_summaries))
    backends = list(dict.fromkeys(b for _, _, b in cold_summaries))
    slots = [(b, kind) for b in backends for kind in ("steady", "cold", "warm")]
    if "jax" in backends:
        at = slots.index(("jax", "warm")) + 1
        slots[at:at] = [("jax", "closure_1"), ("jax", "closure_rest")]
    width = 0.85 / len(slots)
    bars = []
    for (w, n, b), cs in cold_summaries.items():
        lp = cs["loop"] or {}
        values = {"steady": steady.get((w, n, b)), "cold": cs["ratio"], "warm": cs["ratio_warm"],
                  "closure_1": lp.get("ratio_1"), "closure_rest": lp.get("ratio_rest")}
        for j, (sb, kind) in enumerate(slots):
            v = values[kind]
            if sb == b and v is not None and v > 0:
                bars.append((groups.index((w, n)) + (j - (len(slots) - 1) / 2) * width, v, b, kind))
    return [f"{w}\nN={n:,}" for w, n in groups], bars, width


def write_chart(path: Path, results: list[dict[str, Any]],
                cold: list[dict[str, Any]] | None = None) -> bool:
    """Grouped bars: one group per workload and N, one bar per backend (colour, legend); with
    cold results a second row: steady, cold and warm-cache ratios side by side (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    ok = [r for r in results if "error" not in r]
    cold_summaries = _cold.by_key(cold or [])
    groups = list(dict.fromkeys((r["workload"], r["n"]) for r in ok))
    backends = list(dict.fromkeys(r["backend"] for r in ok))
    colors = _COLORS
    labels = [f"{w}\nN={n:,}" for w, n in groups]
    width = 0.8 / max(1, len(backends))
    curves = [(key, s["kth"]) for key, s in cold_summaries.items() if s.get("kth")]
    if cold_summaries:
        rows = 3 if curves else 2
        fig = plt.figure(figsize=(18, 5.5 * rows))
        grid = fig.add_gridspec(rows, 3)
        axes = [fig.add_subplot(grid[0, i]) for i in range(3)]
        ax_cold = fig.add_subplot(grid[1, :])
    else:
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
    if backends:
        axes[0].legend(fontsize=8)
    grouped(axes[1], lambda s: s["bound"])
    axes[1].axhline(1.0, color="black", lw=1, ls="--")
    axes[1].set_title("autodiff-bound ratio T_jac / (T_F (1 + min(k, m)))\n(goal <= 1)")
    tf_runs = [r for r in ok if r["backend"] == "tensorflow"]
    tf_sums = [summarise(r) for r in tf_runs]
    axes[2].bar([i - 0.2 for i in range(len(tf_runs))], [s["vs_b1"] or 0 for s in tf_sums], 0.4,
                label="vs B1 eager batch_jacobian", color="#ffb74d")
    axes[2].bar([i + 0.2 for i in range(len(tf_runs))], [s["vs_b0"] or 0 for s in tf_sums], 0.4,
                label="vs B0 per-instance loop", color="#e65100")
    if any(s["vs_b1"] or s["vs_b0"] for s in tf_sums):
        axes[2].set_yscale("log")
        axes[2].legend(fontsize=8)
    axes[2].set_xticks(range(len(tf_runs)), [f"{r['workload']}\nN={r['n']:,}" for r in tf_runs],
                       fontsize=9)
    axes[2].set_title("TensorFlow: batchjac speed-up over what users write (log)")
    if cold_summaries:
        cold_labels, bars, slot_w = cold_bars(results, cold_summaries)
        for x, v, b, kind in bars:
            _, hatch, alpha = _KINDS[kind]
            ax_cold.bar(x, v, slot_w * 0.95, color=colors.get(b, "grey"), alpha=alpha, hatch=hatch,
                        edgecolor="black", linewidth=0.5)
            ax_cold.annotate(_cold.fmt_ratio(v), (x, v), ha="center", va="bottom", fontsize=7)
        ax_cold.set_yscale("log")
        if bars:  # headroom for the legend above the tallest bar
            ax_cold.set_ylim(min(0.5, min(v for _, v, _, _ in bars) / 1.5),
                             max(2.0, max(v for _, v, _, _ in bars)) * 6)
        ax_cold.axhline(1.0, color="black", lw=1, ls="--")
        ax_cold.set_xticks(range(len(cold_labels)), cold_labels, fontsize=9)
        ax_cold.set_title("batchjac / best native code, same framework: steady state beside the "
                          "first call in a fresh process (log; goal <= 1)")
        shown = list(dict.fromkeys(b for _, _, b, _ in bars))
        kinds = list(dict.fromkeys(k for _, _, _, k in bars))
        handles = [Patch(color=colors.get(b, "grey"), label=b) for b in shown] + [
            Patch(facecolor="white", edgecolor="black", hatch=_KINDS[k][1], label=_KINDS[k][0])
            for k in kinds]
        ax_cold.legend(handles=handles, fontsize=8, ncol=4, loc="upper center")
    if cold_summaries and curves:
        _kth_panels(fig, grid, curves)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _kth_panels(fig: Any, grid: Any, curves: list[tuple[tuple[str, int, str], dict[int, float]]]
                ) -> None:
    """The third row: time to the K-th answer / native's, one panel per backend, a line per
    workload (fresh cache), log-log."""
    backends = list(dict.fromkeys(b for (_, _, b), _ in curves))
    for i, backend in enumerate(backends[:3]):
        ax = fig.add_subplot(grid[2, i])
        for (w, n, b), ratios in curves:
            if b == backend:
                ks = sorted(ratios)
                ax.plot(ks, [ratios[k] for k in ks], marker="o", ms=3, label=f"{w} N={n:,}")
        ax.axhline(1.0, color="black", lw=1, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("K (calls in one process)")
        ax.set_title(f"{backend}: time to the K-th answer / native's (goal <= 1)")
        ax.legend(fontsize=7)


def cold_jobs(quick: bool, workloads: list[str] | None) -> dict[str, int]:
    """Workload -> N of the cold cases: W1-W4 at the steady run's N (W1 at 1,000); the quick
    run does W1 only unless workloads are named."""
    jobs: dict[str, int] = {}
    for job in QUICK if quick else FULL:
        if job.workload not in jobs and (job.workload in (workloads or []) or
                                         (not workloads and (not quick or job.workload == "W1"))):
            jobs[job.workload] = job.n
    return jobs


def main(*, quick: bool, output: Path, backends: list[str] | None, workloads: list[str] | None,
         log: Callable[[str], None], command: str, extras: list[Callable[[], dict[str, Any]]] | None = None,
         cold: bool = True, only_cold: bool = False, cold_rounds: int | None = None
         ) -> list[dict[str, Any]]:
    """The whole run. ``cold``: also the first calls in fresh processes (W1 only with
    ``quick``); ``only_cold``: those alone (no steady-state cases, no extra sections)."""
    import tempfile

    # nothing in the run reads decisions earlier runs left in the user's tuning cache: every
    # case has a fresh cache directory of its own (this one for the extra sections)
    os.environ["BATCHJAC_CACHE_DIR"] = tempfile.mkdtemp(prefix="batchjac-bench-cache-")
    started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    t0 = time.perf_counter()
    jobs = [j for j in (QUICK if quick else FULL) if not workloads or j.workload in workloads]
    chosen = [b for b in installed_backends() if not backends or b in backends]
    # the Keras cases: W1's first calls only (the steady table times each framework's own
    # models; a Keras model's steady state is its framework's plus Keras's call)
    keras_cases = [b for b in installed_keras_cases() if not backends or b in backends]
    repeats, loop_rows = (3, 10) if quick else (11, 100)
    results = []
    for job in [] if only_cold else jobs:
        for backend in chosen:
            log(f"bench {job.workload} N={job.n:,} {backend} ...")
            res = run_job(job, backend, repeats=repeats, loop_rows=loop_rows, timeout=1200)
            if "error" in res:
                log(f"  failed: {res['error']}")
            else:
                s = summarise(res)
                log(f"  batchjac {_fmt_t(s['t'])}, best {s['best_name']} {_fmt_t(s['t_best'])}, "
                    f"ratio {s['ratio_best']:.2f}, bound {_fmt_x(s['bound'])}")
            results.append(res)
    cold_results: list[dict[str, Any]] = []
    if cold or only_cold:
        rounds = cold_rounds or (_cold.QUICK_ROUNDS if quick else _cold.FULL_ROUNDS)
        seconds = _cold.KTH_QUICK_SECONDS if quick else _cold.KTH_SECONDS
        jobs_cold = cold_jobs(quick, workloads)
        cold_results = _cold.run_all(jobs_cold, chosen, rounds=rounds, log=log,
                                     seconds=seconds) if chosen else []
        if keras_cases and "W1" in jobs_cold:
            cold_results += _cold.run_all({"W1": jobs_cold["W1"]}, keras_cases, rounds=rounds,
                                          log=log, seconds=seconds)
        for key, cs in _cold.by_key(cold_results).items():
            log(f"cold {' '.join(map(str, key))}: batchjac {_cold.fmt_s(cs['t'])}, "
                f"{cs['best_name']} {_cold.fmt_s(cs['t_best'])}, ratio {_cold.fmt_ratio(cs['ratio'])}, "
                f"warm cache {_cold.fmt_ratio(cs['ratio_warm'])}, K-th answer "
                + ", ".join(f"{k}: {r:.2f}" for k, r in cs["kth"].items()))
    extra_blocks = []
    for fn in [] if only_cold else extras or []:
        log(f"section {fn.__module__.rsplit('.', 1)[-1]} ...")
        extra_blocks.append(fn())
    output.parent.mkdir(parents=True, exist_ok=True)
    chart = output.with_name(output.stem.lower() + "-ratios.png")
    has_chart = write_chart(chart, results, cold_results)
    write_markdown(output, results, extra_blocks, command=command, started=started,
                   wall=time.perf_counter() - t0, chart=chart.name if has_chart else None,
                   cold=cold_results)
    log(f"wrote {output}" + (f" and {chart}" if has_chart else ""))
    return results
