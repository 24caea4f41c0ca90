"""``batchjac.solve`` against per-instance ``scipy.optimize.least_squares`` loops and Optimistix.

Problem sets (N = 1,000 each; true unknowns drawn, targets computed from them with the float64
numpy forward pass of the model), on a purpose-made MLP 5-32-32-8: 3 unknowns + 2 known
inputs -> 8 outputs (k < m, identifiable), weights from numpy (``mlp_weights``), built the same
in every framework:

- ``identifiable``: x ~ U(-1, 1)^3, exact targets, x0 = 0;
- ``bounded``: bounds [-1, 1]^3 with 25% of the true unknowns exactly on a bound, x0 = 0;
- ``noisy``: targets plus Gaussian noise (sigma = 0.02), passed as ``sigma``, x0 = 0.

"Recovered" is judged the same way for every solver, by the numpy reference at the x it
returned: within 1e-5 of the truth (exact sets), or a cost at least as low as the truth's
(noisy set: the truth is not the minimiser, but the minimiser's cost is never above it).
Each runner works in its own subprocess (JAX needs x64 mode; timings do not share caches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

N = 1000
SIZES = (5, 32, 32, 8)
SEED = 3
K = 3
SIGMA = 0.02
RECOVER_TOL = 1e-5
KERAS_SUBSET = 100  # a Keras model called eagerly per evaluation is slow: timed on a subset

RUNNERS = ("batchjac-tensorflow", "batchjac-torch", "batchjac-jax", "scipy-fd-numpy",
           "scipy-exact-numpy", "scipy-fd-torch", "scipy-fd-keras", "scipy-fd-jax",
           "optimistix-lm-vmap")
#: the scipy loop a user of each framework writes: least_squares (finite differences) calling
#: their model, one instance at a time
SAME_FRAMEWORK = {"batchjac-tensorflow": "scipy-fd-keras", "batchjac-torch": "scipy-fd-torch",
                  "batchjac-jax": "scipy-fd-jax"}


def _layers() -> list[tuple[np.ndarray, np.ndarray]]:
    from ..examples import mlp_weights

    return mlp_weights(SIZES, SEED)


def problem_sets(n: int = N) -> dict[str, dict[str, Any]]:
    from ..examples import mlp_forward

    layers = _layers()
    rng = np.random.default_rng(2024)
    sets: dict[str, dict[str, Any]] = {}
    for name in ("identifiable", "bounded", "noisy"):
        x_true = rng.uniform(-1, 1, (n, K))
        known = rng.normal(size=(n, 2))
        bounds = None
        if name == "bounded":
            on = rng.random((n, K)) < 0.25
            x_true[on] = np.sign(rng.uniform(-1, 1, int(on.sum())))
            bounds = (-1.0, 1.0)
        y = mlp_forward(layers, np.concatenate([x_true, known], axis=1))
        sigma = None
        if name == "noisy":
            y = y + SIGMA * rng.normal(size=y.shape)
            sigma = SIGMA
        sets[name] = {"x_true": x_true, "known": known, "targets": y, "x0": np.zeros((n, K)),
                      "bounds": bounds, "sigma": sigma}
    return sets


def _score(runner: str, name: str, p: dict[str, Any], x: np.ndarray, flagged: np.ndarray,
           seconds: float, **extra: Any) -> dict[str, Any]:
    from ..examples import mlp_forward

    layers = _layers()
    n = len(x)
    scale = p["sigma"] or 1.0

    def cost(z: np.ndarray) -> np.ndarray:
        r = (mlp_forward(layers, np.concatenate([z, p["known"][:n]], axis=1)) - p["targets"][:n])
        return 0.5 * ((r / scale) ** 2).sum(axis=1)

    c = cost(np.asarray(x, np.float64))
    err = np.abs(x - p["x_true"][:n]).max(axis=1)
    if p["sigma"] is None:
        recovered = err <= RECOVER_TOL
    else:
        c_true = cost(p["x_true"][:n])
        recovered = c <= c_true + 1e-9 * np.maximum(1.0, c_true)
    inside = np.ones(n, bool)
    if p["bounds"] is not None:
        inside = ((x >= p["bounds"][0]) & (x <= p["bounds"][1])).all(axis=1)
    residual = np.sqrt(2 * c)
    return {"runner": runner, "set": name, "n": n, "seconds": seconds,
            "recovered": float(np.mean(recovered)), "flagged_converged": float(np.mean(flagged)),
            "false_converged": float(np.mean(flagged & ~recovered)),
            "median_residual": float(np.median(residual)), "max_residual": float(residual.max()),
            "median_x_err": float(np.median(err)), "inside_bounds": float(np.mean(inside)),
            **extra}


# -- runners (each in its own process) ------------------------------------------------------------
def _model(framework: str) -> Any:
    if framework == "tensorflow":
        from .._examples import keras as impl
    elif framework == "torch":
        from .._examples import torch as impl  # type: ignore[no-redef]
    else:
        from .._examples import jax as impl  # type: ignore[no-redef]
    return impl.mlp(SIZES, seed=SEED, dtype="float64")


def run_batchjac(backend: str, sets: dict[str, dict[str, Any]], repeats: int = 19
                 ) -> list[dict[str, Any]]:
    """Cold (first) call, second call, and the steady state: the median of the last eleven of
    ``repeats`` calls, once the ski rental of ``_Evaluator`` has compiled the smaller chunk
    kernels the tail of slow instances wants (as in a session that solves batch after batch)."""
    if backend == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    import batchjac

    model = _model(backend)
    rows = []
    for first, (name, p) in enumerate(sets.items()):
        def call(p: dict[str, Any] = p) -> Any:
            return batchjac.solve(model, p["targets"], p["known"], x0=p["x0"], bounds=p["bounds"],
                                  sigma=p["sigma"], dtype="float64")

        start = time.perf_counter()
        call()
        cold = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            res = call()
            times.append(time.perf_counter() - start)
        rows.append(_score(f"batchjac-{backend}", name, p, res.x, res.success,
                           float(np.median(times[-11:])), second_seconds=times[0],
                           **({"cold_seconds": cold} if first == 0 else {}),
                           compiled_chunk_sizes=res.info["compiled_chunk_sizes"],
                           iterations_max=int(res.iterations.max()),
                           iterations_mean=float(res.iterations.mean()),
                           kernel_calls=res.info["kernel_calls"], mode=res.info["mode"]))
    return rows


def _numpy_fun(p: dict[str, Any], i: int) -> tuple[Callable[[np.ndarray], np.ndarray],
                                                     Callable[[np.ndarray], np.ndarray]]:
    from ..examples import mlp_forward, mlp_jacobian

    layers = _layers()
    h, t, s = p["known"][i], p["targets"][i], p["sigma"] or 1.0

    def fun(x: np.ndarray) -> np.ndarray:
        return (mlp_forward(layers, np.concatenate([x, h])[None])[0] - t) / s

    def jac(x: np.ndarray) -> np.ndarray:
        return mlp_jacobian(layers, np.concatenate([x, h])[None])[0][:, :K] / s

    return fun, jac


def run_scipy(variant: str, sets: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    from scipy.optimize import least_squares

    framework_fun: Callable[[dict[str, Any], int], Callable[[np.ndarray], np.ndarray]] | None = None
    limit = None
    if variant == "fd-torch":
        import torch

        tm = _model("torch")
        torch.set_grad_enabled(False)

        def framework_fun(p: dict[str, Any], i: int) -> Callable[[np.ndarray], np.ndarray]:
            h, t, s = p["known"][i], p["targets"][i], p["sigma"] or 1.0
            return lambda x: (tm(torch.from_numpy(np.concatenate([x, h])[None])).numpy()[0] - t) / s
    elif variant == "fd-keras":
        km = _model("tensorflow")
        limit = KERAS_SUBSET

        def framework_fun(p: dict[str, Any], i: int) -> Callable[[np.ndarray], np.ndarray]:
            h, t, s = p["known"][i], p["targets"][i], p["sigma"] or 1.0
            return lambda x: (km(np.concatenate([x, h])[None]).numpy()[0] - t) / s
    elif variant == "fd-jax":
        import jax

        jax.config.update("jax_enable_x64", True)
        jm = jax.jit(_model("jax"))  # compiled once; each evaluation is one jitted call

        def framework_fun(p: dict[str, Any], i: int) -> Callable[[np.ndarray], np.ndarray]:
            h, t, s = p["known"][i], p["targets"][i], p["sigma"] or 1.0
            return lambda x: (np.asarray(jm(np.concatenate([x, h])[None]))[0] - t) / s

    rows = []
    for name, p in sets.items():
        n = len(p["x0"]) if limit is None else min(limit, len(p["x0"]))
        bounds = (-np.inf, np.inf) if p["bounds"] is None else p["bounds"]
        xs, flags, nfev = np.empty((n, K)), np.empty(n, bool), 0
        start = time.perf_counter()
        for i in range(n):
            jac: Any = "2-point"
            if framework_fun is not None:
                fun = framework_fun(p, i)
            else:
                fun, exact = _numpy_fun(p, i)
                jac = exact if variant == "exact-numpy" else "2-point"
            r = least_squares(fun, p["x0"][i], jac=jac, bounds=bounds)
            xs[i], flags[i], nfev = r.x, r.status > 0, nfev + r.nfev
        seconds = time.perf_counter() - start
        extra: dict[str, Any] = {"nfev_mean": nfev / n}
        if n < len(p["x0"]):
            extra["timed_rows"] = n
            seconds *= len(p["x0"]) / n
        rows.append(_score(f"scipy-{variant}", name, p, xs, flags, seconds, **extra))
    return rows


def run_optimistix(sets: dict[str, dict[str, Any]], repeats: int = 3) -> list[dict[str, Any]]:
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import optimistix as optx

    f = _model("jax")
    solver: Any = optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8)

    def resid(x: Any, args: Any) -> Any:
        h, t, s = args
        return (f(jnp.concatenate([x, h])[None])[0] - t) / s

    @jax.jit
    def run(x0: Any, h: Any, t: Any, s: Any) -> Any:
        def one(x0: Any, h: Any, t: Any) -> Any:
            sol: Any = optx.least_squares(resid, solver, x0, args=(h, t, s), max_steps=100,
                                          throw=False)
            return sol.value, sol.result == optx.RESULTS.successful, sol.stats["num_steps"]
        return jax.vmap(one)(x0, h, t)

    rows = []
    for first, (name, p) in enumerate(sets.items()):
        args = (jnp.asarray(p["x0"]), jnp.asarray(p["known"]), jnp.asarray(p["targets"]),
                jnp.asarray(p["sigma"] or 1.0))
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        cold = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x, ok, steps = jax.block_until_ready(run(*args))
            times.append(time.perf_counter() - start)
        rows.append(_score("optimistix-lm-vmap", name, p, np.asarray(x), np.asarray(ok),
                           float(np.median(times)), **({"cold_seconds": cold} if first == 0 else {}),
                           iterations_max=int(np.asarray(steps).max()),
                           note="no box bounds in Optimistix: solved unconstrained"
                           if p["bounds"] is not None else ""))
    return rows


def run(runner: str, n: int = N) -> list[dict[str, Any]]:
    sets = problem_sets(n)
    if runner.startswith("batchjac-"):
        return run_batchjac(runner.split("-", 1)[1], sets)
    if runner.startswith("scipy-"):
        return run_scipy(runner.split("-", 1)[1], sets)
    if runner == "optimistix-lm-vmap":
        return run_optimistix(sets)
    raise ValueError(f"unknown runner {runner!r}; choose from {RUNNERS}")


def _available(runner: str) -> bool:
    import importlib.util

    need = {"batchjac-tensorflow": ["tensorflow"], "batchjac-torch": ["torch"],
            "batchjac-jax": ["jax"], "scipy-fd-numpy": ["scipy"], "scipy-exact-numpy": ["scipy"],
            "scipy-fd-torch": ["scipy", "torch"], "scipy-fd-keras": ["scipy", "tensorflow"],
            "scipy-fd-jax": ["scipy", "jax"],
            "optimistix-lm-vmap": ["jax", "optimistix"]}[runner]
    return all(importlib.util.find_spec(m) is not None for m in need)


# -- the BENCHMARKS.md section --------------------------------------------------------------------
def section(n: int = N, runners: tuple[str, ...] = RUNNERS,
            log: Callable[[str], None] | None = None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for runner in runners:
        if not _available(runner):
            rows.append({"runner": runner, "error": "not installed"})
            continue
        if log:
            log(f"solve benchmark: {runner} ...")
        proc = subprocess.run([sys.executable, "-m", "batchjac._bench.solve_bench", runner, str(n)],
                              capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        got = [json.loads(ln[11:]) for ln in proc.stdout.splitlines() if ln.startswith("SOLVE-JSON ")]
        rows.extend(got or [{"runner": runner, "error": proc.stderr.strip()[-300:]}])
    return {"rows": rows, "markdown": _markdown(rows, n, load)}


def _markdown(rows: list[dict[str, Any]], n: int, load: float) -> list[str]:
    md = [f"## Solving for the unknowns: `batchjac.solve` vs per-instance loops (N={n:,})", "",
          "MLP 5-32-32-8 (3 unknowns + 2 known inputs -> 8 outputs, tanh), float64, the same "
          "weights in every framework. Problem sets: **identifiable** (x ~ U(-1,1)^3, exact "
          "targets), **bounded** (box [-1,1]^3, 25% of the true unknowns on a bound), **noisy** "
          f"(targets + N(0, {SIGMA}^2), passed as `sigma`). Every solver starts at x0 = 0 with "
          "tolerances 1e-8. *Recovered*: within 1e-5 of the truth (exact sets) or at a cost no "
          "higher than the truth's (noisy set), judged by the numpy reference at the returned x. "
          "*False conv.*: flagged converged but not recovered. *cold*: the first call in a fresh "
          "process, with compilation (and batchjac's mode autotuning), on the first set only; "
          "*2nd call*: the next one; *time*: for batchjac the steady state (median of calls 10-20: "
          "by then the smaller chunk kernels for the tail of slow instances have paid for their "
          "compilation and exist), for Optimistix the median of 3 warm calls. The scipy loops run "
          "one instance at a time, single-threaded; the compiled solvers may use every core. "
          "The scipy loop a user writes calls *their* model (Keras, torch or a jitted JAX "
          "function), hence the first speed-up column; the numpy model (the same network "
          "rewritten in numpy, the fastest per-call forward pass there is) is the strictest "
          "baseline.",
          f"Load average at start: {load:.1f} on {os.cpu_count()} CPUs.", ""]
    errors = [r for r in rows if "error" in r]
    by_set: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            by_set.setdefault(r["set"], []).append(r)
    for name, rs in by_set.items():
        ref = {r["runner"]: r["seconds"] for r in rs}
        base_fd = ref.get("scipy-fd-numpy")
        md += [f"### {name}", "",
               "| solver | recovered | flagged converged | false conv. | median / max residual "
               "| time | 2nd call | cold | speed-up vs scipy FD on the same framework's model "
               "| vs scipy FD on a numpy model |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            note = ""
            if r.get("timed_rows"):
                note = f" (timed on {r['timed_rows']} rows, scaled)"
            if r.get("note"):
                note += f" ({r['note']})"
            cold = f"{r['cold_seconds']:.2f} s" if "cold_seconds" in r else ""
            second = _fmt(r["second_seconds"]) if "second_seconds" in r else ""
            up1 = f"{base_fd / r['seconds']:.0f}x" if base_fd and r["runner"].startswith("batchjac") else ""
            same = ref.get(SAME_FRAMEWORK.get(r["runner"], ""))
            up2 = f"{same / r['seconds']:.0f}x ({SAME_FRAMEWORK[r['runner']]})" if same else ""
            md.append(f"| {r['runner']}{note} | {r['recovered']:.1%} | {r['flagged_converged']:.1%} | "
                      f"{r['false_converged']:.1%} | {r['median_residual']:.1e} / "
                      f"{r['max_residual']:.1e} | {_fmt(r['seconds'])} | {second} | {cold} | {up2} | "
                      f"{up1} |")
        md.append("")
    for r in errors:
        md.append(f"- {r['runner']}: {r['error']}")
    md.append("")
    return md


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


if __name__ == "__main__":
    for row in run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else N):
        sys.stdout.write("SOLVE-JSON " + json.dumps(row) + "\n")
        sys.stdout.flush()
