"""Products that never form J (issue 38): two reductions of the Jacobians against forming J
with the native code and reducing it, each case in a fresh process (its peak memory its own):

- the divergence ``tr J_i`` of a 64-256-256-64 tanh map, N=10,000: native ``jit(vmap(jacfwd))``
  (JAX), torch.func's ``vmap(jacfwd)``, TensorFlow's ``batch_jacobian`` under XLA, each with the
  trace taken in the framework; batchjac exact, Hutchinson's and Hutch++'s estimates (16
  products an instance; their error: the median ``|estimate - exact|`` over the median
  ``|exact|``, and how many instances' exact traces lie within 2 standard errors);
- ``J Sigma J^T`` on W2 (784 unknowns, 10 outputs), N=10,000, a full shared ``Sigma``: the native
  reverse-mode Jacobians and ``J @ Sigma @ J^T`` in the framework (one compiled function where
  the framework compiles), against ``batchjac.propagate(method="linear", cov=Sigma)``; and
  ``propagate`` with a dense diagonal ``cov`` against the same ``std=``.

``python -m batchjac._bench.products case BACKEND CASE`` runs one case; ``section`` all.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

N = 10_000
FLOW = (64, 256, 256, 64)
CALLS = 4
CASES = {
    "divergence": ("native", "batchjac", "hutchinson", "hutch++"),
    "jsj": ("native", "batchjac", "diagonal cov", "std"),
}
NAMES = {
    "jax": {"divergence": "jit(vmap(jacfwd)) + trace", "jsj": "jit: vmap(jacrev), J Sigma J^T"},
    "torch": {"divergence": "vmap(jacfwd) + trace", "jsj": "vmap(jacrev), J Sigma J^T"},
    "tensorflow": {"divergence": "batch_jacobian (XLA) + trace",
                   "jsj": "batch_jacobian (XLA), J Sigma J^T"},
}
SAMPLES = 16


def _flow_inputs() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(N, FLOW[0])).astype(np.float32)


def _w2() -> tuple[np.ndarray, np.ndarray]:
    """W2's inputs and a full covariance of its 784 unknowns (a random factor, well
    conditioned)."""
    from batchjac.examples import workload_inputs

    x, _ = workload_inputs("W2", N)
    k = x.shape[1]
    a = np.random.default_rng(2).normal(size=(k, k)) / np.sqrt(k)
    return x.astype(np.float32), (a @ a.T + 0.1 * np.eye(k)).astype(np.float32)


def _flow_model(backend: str) -> Any:
    import importlib

    module = {"tensorflow": "keras", "torch": "torch", "jax": "jax"}[backend]
    return importlib.import_module(f"batchjac._examples.{module}").mlp(FLOW)


def _native_divergence(backend: str) -> Callable[[np.ndarray], Any]:
    model = _flow_model(backend)
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        fn = jax.jit(lambda x: jnp.trace(jax.vmap(jax.jacfwd(lambda r: model(r[None])[0]))(x),
                                         axis1=1, axis2=2))
        return lambda x: np.asarray(fn(x))
    if backend == "torch":
        import torch

        one = lambda r: model(r[None])[0]  # noqa: E731
        jac = torch.func.vmap(torch.func.jacfwd(one))

        def torch_div(x: np.ndarray) -> Any:
            with torch.no_grad():
                return jac(torch.from_numpy(x)).diagonal(dim1=1, dim2=2).sum(-1).numpy()

        return torch_div
    import tensorflow as tf

    @tf.function(jit_compile=True)
    def tf_div(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=False)
        return tf.linalg.trace(tape.batch_jacobian(y, x))

    return lambda x: tf_div(tf.constant(x)).numpy()


def _native_jsj(backend: str, sigma: np.ndarray) -> Callable[[np.ndarray], Any]:
    from batchjac.examples import workload_model

    model = workload_model("W2", backend)
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        s = jnp.asarray(sigma)

        @jax.jit
        def jsj(x: Any) -> Any:
            jac = jax.vmap(jax.jacrev(lambda r: model(r[None])[0]))(x)
            return jac @ s @ jnp.swapaxes(jac, 1, 2)

        return lambda x: np.asarray(jsj(x))
    if backend == "torch":
        import torch

        one = lambda r: model(r[None])[0]  # noqa: E731
        jac = torch.func.vmap(torch.func.jacrev(one))
        st = torch.from_numpy(sigma)

        def torch_jsj(x: np.ndarray) -> Any:
            with torch.no_grad():
                j = jac(torch.from_numpy(x))
                return (j @ st @ j.transpose(1, 2)).numpy()

        return torch_jsj
    import tensorflow as tf

    st = tf.constant(sigma)

    @tf.function(jit_compile=True)
    def tf_jsj(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x, training=False)
        j = tape.batch_jacobian(y, x)
        return tf.matmul(tf.matmul(j, st), j, transpose_b=True)

    return lambda x: tf_jsj(tf.constant(x)).numpy()


def run_case(backend: str, case: str, impl: str) -> dict[str, Any]:
    """One case's calls in this process: the first call, the steady one, the peak memory the
    calls added, and the result (kept for the error)."""
    import batchjac

    if case == "divergence":
        x = _flow_inputs()
        if impl == "native":
            fn = _native_divergence(backend)
        else:
            model = _flow_model(backend)
            est: Any = None if impl == "batchjac" else impl
            def estimate(a: np.ndarray) -> Any:  # (the value, then its standard error)
                found = batchjac.divergence(model, a, estimator=est, samples=SAMPLES)
                return np.stack([found.value, found.stderr])

            fn = (lambda a: batchjac.divergence(model, a)) if est is None else estimate
    else:
        from batchjac.examples import workload_model

        x, sigma = _w2()
        if impl == "native":
            fn = _native_jsj(backend, sigma)
        else:
            model = workload_model("W2", backend)
            if impl == "batchjac":
                fn = lambda a: batchjac.propagate(model, a, cov=sigma).cov  # noqa: E731
            else:  # a diagonal Sigma, dense or as its standard deviations
                std = np.sqrt(np.diag(sigma)).astype(np.float32)
                kw: dict[str, Any] = {"cov": np.diag(std ** 2)} if impl == "diagonal cov" else \
                    {"std": std}
                fn = lambda a: batchjac.propagate(model, a, **kw).cov  # noqa: E731
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    result = None
    for _ in range(CALLS):
        start = time.perf_counter()
        result = np.asarray(fn(x))
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert result is not None
    return {"first_s": times[0], "steady_s": statistics.median(times[1:]),
            "peak_mb": (peak - before) / 1024, "_result": result}


def _case(backend: str, case: str, impl: str, tmp: str) -> dict[str, Any]:
    out = f"{tmp}/{backend}-{case}-{impl.replace(' ', '_')}.npy"
    proc = subprocess.run(
        [sys.executable, "-m", "batchjac._bench.products", "case", backend, case, impl, out],
        capture_output=True, text=True, timeout=1800,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore",
             "BATCHJAC_CACHE_DIR": f"{tmp}/cache"})
    for line in proc.stdout.splitlines():
        if line.startswith("PRODUCTS-JSON "):
            return {**json.loads(line[14:]), "impl": impl, "file": out}
    return {"impl": impl, "error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}


def section(backends: list[str] | None = None, log: Callable[[str], None] = lambda s: None
            ) -> dict[str, Any]:
    import tempfile

    from .run import installed_backends

    rows = []
    with tempfile.TemporaryDirectory(prefix="batchjac-products-") as tmp:
        for backend in [b for b in installed_backends() if not backends or b in backends]:
            for case, impls in CASES.items():
                cases = []
                for impl in impls:
                    log(f"products {backend} {case} {impl}")
                    cases.append(_case(backend, case, impl, tmp))
                _errors(cases)
                rows.append({"backend": backend, "case": case, "cases": cases})
    return {"rows": rows, "markdown": markdown(rows)}


def _errors(cases: list[dict[str, Any]]) -> None:
    """Each case's error against the native result (a diagonal Sigma's two forms against each
    other); an estimate's: the median of ``|estimate - exact|`` over the median ``|exact|``, and
    the share of instances whose standard error puts the exact value within 2 of them."""
    done = {c["impl"]: np.load(c["file"]) for c in cases if "error" not in c}
    for c in cases:
        if "error" in c:
            continue
        got = done[c["impl"]]
        want = done.get("std" if c["impl"] == "diagonal cov" else "native")
        if c["impl"] == "std" or want is None:
            continue
        if c["impl"] in ("hutchinson", "hutch++"):
            value, stderr = got
            c["rel"] = float(np.median(np.abs(value - want)) / np.median(np.abs(want)))
            c["covered"] = float(np.mean(np.abs(value - want) <= 2 * stderr))
        else:
            c["err"] = float(np.abs(got - want).max() / np.abs(want).max())


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    jsize = {"divergence": N * FLOW[0] * FLOW[-1] * 4 / 1e6, "jsj": N * 784 * 10 * 4 / 1e6}
    md = ["## Products without J: divergence and J Sigma J^T", "",
          f"Each case in a fresh process: the first call, the steady call (the median of calls "
          f"2-{CALLS}), and the peak resident memory the calls added to the process (its model "
          f"and data made before). Ratios: batchjac's time over the native code's (below 1: "
          f"batchjac is faster). Divergence: an MLP {'-'.join(map(str, FLOW))} (tanh), N={N:,}, "
          f"J {jsize['divergence']:.0f} MB; the estimates take {SAMPLES} products an instance, "
          f"their error the median |estimate - exact| over the median |exact| and the share of "
          f"instances whose exact trace lies within 2 standard errors of the estimate. "
          f"J Sigma J^T: W2 (784 unknowns, 10 outputs), N={N:,}, a full shared Sigma, J "
          f"{jsize['jsj']:.0f} MB; `diagonal cov` and `std`: a diagonal Sigma given dense and as "
          f"its standard deviations (the error of the dense one: against the other). "
          f"Command: `python -m batchjac._bench.products section` (also "
          f"a section of `batchjac bench`).", "",
          "| backend | case | implementation | first call | steady | steady / native | peak added "
          "| error |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        native = next((c for c in row["cases"] if c["impl"] == "native" and "error" not in c), None)
        for c in row["cases"]:
            name = NAMES[row["backend"]][row["case"]] if c["impl"] == "native" else \
                f"batchjac {c['impl']}" if c["impl"] != "batchjac" else "**batchjac**"
            if "error" in c:
                md.append(f"| {row['backend']} | {row['case']} | {name} | failed: "
                          f"{c['error'][-200:]!r} ||||")
                continue
            ratio = f"{c['steady_s'] / native['steady_s']:.2f}" if native else ""
            err = (f"{c['rel']:.0%} (median), {c['covered']:.0%} within 2 stderr" if "rel" in c
                   else f"{c['err']:.1e}" if "err" in c else "")
            md.append(f"| {row['backend']} | {row['case']} | {name} | {c['first_s']:.2f} s | "
                      f"{c['steady_s']:.3f} s | {ratio} | {c['peak_mb']:,.0f} MB | {err} |")
    md.append("")
    return md


def main(argv: list[str]) -> None:
    what, *args = argv
    if what == "case":
        backend, case, impl, out = args
        found = run_case(backend, case, impl)
        np.save(out, found.pop("_result"))
        sys.stdout.write("PRODUCTS-JSON " + json.dumps(found) + "\n")
    elif what == "section":
        res = section(args or None, log=lambda s: print(s, file=sys.stderr))
        sys.stdout.write("\n".join(res["markdown"]) + "\n")
    else:
        raise SystemExit(f"unknown step {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
