"""W9: a bottlenecked model, MLP 512-256-16-256-512 (tanh), all 512 inputs unknown, where mixed
mode (issue 39, :mod:`batchjac._chain`) is the point: batchjac's Jacobians against the native
pure modes of each framework and the obvious hand-written split at the bottleneck:

- JAX: ``jit(vmap(jacrev))`` and ``jit(vmap(jacfwd))``; the split ``jacfwd(post)(pre(x)) @
  jacrev(pre)(x)``, ``jit(vmap)``-ed;
- PyTorch: torch.func's ``vmap(jacrev)`` and ``vmap(jacfwd)``; the split with torch.func;
- TensorFlow: ``batch_jacobian`` and forward mode (``ForwardAccumulator`` over
  ``vectorized_map``) inside ``tf.function(jit_compile=True)``; the split likewise.

Every case runs in a fresh process (``python -m batchjac._bench.w9 case BACKEND IMPL N``): the
time to the K-th answer (the first call's tracing and compilation included; the timer starts
once the model and the data exist), the steady state (the median of the calls after the
10th), and the first rows' Jacobians, written to a file and compared with the native reverse
mode's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SIZES = (512, 256, 16, 256, 512)
#: the layers before the bottleneck (the hand-written split's first piece)
PRE = 2
NS = (500, 1000)
KS = (1, 2, 5, 10)
CALLS = 13
#: rows whose Jacobians are compared across the cases
CHECK_ROWS = 20
IMPLS = ("batchjac", "rev", "fwd", "split")
NAMES = {
    "jax": {"rev": "jit(vmap(jacrev))", "fwd": "jit(vmap(jacfwd))", "split": "split by hand, jit(vmap)"},
    "torch": {"rev": "vmap(jacrev)", "fwd": "vmap(jacfwd)", "split": "split by hand, torch.func"},
    "tensorflow": {"rev": "batch_jacobian, XLA", "fwd": "ForwardAccumulator, XLA",
                   "split": "split by hand, XLA"},
}


def _jax(impl: str) -> Callable[[np.ndarray], Any]:
    import jax
    import jax.numpy as jnp

    from batchjac.examples import mlp_weights

    weights = [(jnp.asarray(w), jnp.asarray(b)) for w, b in mlp_weights(SIZES)]

    def run(x: Any, lo: int, hi: int) -> Any:
        for i in range(lo, hi):
            x = x @ weights[i][0] + weights[i][1]
            if i < len(weights) - 1:
                x = jnp.tanh(x)
        return x

    def f(x: Any) -> Any:
        return run(x, 0, len(weights))

    if impl == "split":
        def one(x: Any) -> Any:
            return jax.jacfwd(lambda z: run(z, PRE, len(weights)))(run(x, 0, PRE)) @ \
                jax.jacrev(lambda v: run(v, 0, PRE))(x)
        fn = jax.jit(jax.vmap(one))
    else:
        fn = jax.jit(jax.vmap(jax.jacrev(f) if impl == "rev" else jax.jacfwd(f)))
    return lambda x: np.asarray(fn(x))


def _torch(impl: str) -> Callable[[np.ndarray], Any]:
    import torch
    from torch.func import jacfwd, jacrev, vmap

    from batchjac.examples import workload_model

    model = workload_model("W9", "torch")
    pre, post = model[:2 * PRE], model[2 * PRE:]

    def run(x: np.ndarray) -> np.ndarray:
        u = torch.from_numpy(x)
        with torch.no_grad():
            if impl == "split":
                return (vmap(jacfwd(post))(pre(u)) @ vmap(jacrev(pre))(u)).numpy()
            transform = jacrev if impl == "rev" else jacfwd
            return vmap(transform(lambda v: model(v[None])[0]))(u).numpy()  # type: ignore[no-any-return]

    return run


def _tf(impl: str) -> Callable[[np.ndarray], Any]:
    import tensorflow as tf

    from batchjac.examples import workload_model

    model = workload_model("W9", "tensorflow")
    layers = [layer for layer in model.layers if type(layer).__name__ != "InputLayer"]

    def apply(x: Any, lo: int, hi: int) -> Any:
        for layer in layers[lo:hi]:
            x = layer(x, training=False)
        return x

    def reverse(x: Any, lo: int, hi: int) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = apply(x, lo, hi)
        return tape.batch_jacobian(y, x)

    def forward(x: Any, lo: int, hi: int) -> Any:
        k = x.shape[-1]

        def one(t: Any) -> Any:
            with tf.autodiff.ForwardAccumulator(x, tf.broadcast_to(t, tf.shape(x))) as acc:
                y = apply(x, lo, hi)
            return acc.jvp(y)

        return tf.transpose(tf.vectorized_map(one, tf.eye(k, dtype=x.dtype)), (1, 2, 0))

    @tf.function(jit_compile=True)
    def jac(x: Any) -> Any:
        if impl == "split":
            return tf.matmul(forward(apply(x, 0, PRE), PRE, len(layers)), reverse(x, 0, PRE))
        return (reverse if impl == "rev" else forward)(x, 0, len(layers))

    return lambda x: jac(tf.constant(x)).numpy()


def run_case(backend: str, impl: str, n: int, check_file: str) -> dict[str, Any]:
    """The calls of one case in this process: the answers' times, their steady state."""
    from batchjac.examples import workload_inputs, workload_model

    x, _ = workload_inputs("W9", n)
    if impl == "batchjac":
        import batchjac

        model = workload_model("W9", backend)
        fn: Callable[[np.ndarray], Any] = lambda a: batchjac.jacobian(model, a)  # noqa: E731
    else:
        fn = {"jax": _jax, "torch": _torch, "tensorflow": _tf}[backend](impl)
    times = []
    first_rows = None
    for _ in range(CALLS):
        start = time.perf_counter()
        out = fn(x)
        times.append(time.perf_counter() - start)
        if first_rows is None:
            first_rows = np.array(out[:CHECK_ROWS])
        del out
    assert first_rows is not None
    np.save(check_file, first_rows)
    cumulative = np.cumsum(times)
    return {"backend": backend, "impl": impl, "n": n, "first_s": times[0],
            "kth_s": {str(k): float(cumulative[k - 1]) for k in KS},
            "steady_s": statistics.median(times[max(KS):])}


def _case(backend: str, impl: str, n: int, tmp: str) -> dict[str, Any]:
    check = f"{tmp}/{backend}-{impl}-{n}.npy"
    proc = subprocess.run([sys.executable, "-m", "batchjac._bench.w9", "case", backend, impl, str(n),
                           check], capture_output=True, text=True, timeout=1800,
                          env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3",
                               "PYTHONWARNINGS": "ignore", "BATCHJAC_CACHE_DIR": f"{tmp}/cache"})
    for line in proc.stdout.splitlines():
        if line.startswith("W9-JSON "):
            return {**json.loads(line[8:]), "check": check}
    return {"backend": backend, "impl": impl, "n": n,
            "error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}


def counted() -> dict[str, float]:
    """The count of :mod:`batchjac._chain` for W9 (read from the JAX model, where JAX is
    installed): the better pure mode against the bracketing, in operations alone and with the
    writes of the Jacobians."""
    try:
        import jax
        import jax.numpy as jnp

        from batchjac._backends.jax import chain as jax_chain
        from batchjac._chain import choose
        from batchjac.examples import workload_model
    except ImportError:
        return {}
    model = workload_model("W9", "jax")
    closed = jax.make_jaxpr(lambda v: model(v[None])[0])(jax.ShapeDtypeStruct((SIZES[0],), jnp.float32))
    read = jax_chain.read(closed, 0)
    if read is None:
        return {}
    out = {}
    for name, write in (("operations", 0.0), ("with writes", None)):
        plan = choose(read.chain, 1.0) if write is None else choose(read.chain, 1.0, write)
        if plan is not None:
            out[name] = plan.gain
    return out


def section(backends: list[str] | None = None, log: Callable[[str], None] = lambda s: None
            ) -> dict[str, Any]:
    from .run import installed_backends

    rows = []
    with tempfile.TemporaryDirectory(prefix="batchjac-w9-") as tmp:
        for backend in [b for b in installed_backends() if not backends or b in backends]:
            for n in NS:
                cases = []
                for impl in IMPLS:
                    log(f"W9 {backend} {impl} N={n}")
                    cases.append(_case(backend, impl, n, tmp))
                ref = next((c for c in cases if c["impl"] == "rev" and "error" not in c), None)
                if ref is not None:
                    want = np.load(ref["check"]).astype(np.float64)
                    for c in cases:
                        if "error" not in c:
                            got = np.load(c["check"]).astype(np.float64)
                            c["err"] = float(np.abs(got - want).max() / np.abs(want).max())
                rows.append({"backend": backend, "n": n, "cases": cases})
    return {"rows": rows, "counted": counted(), "markdown": markdown(rows, counted())}


def markdown(rows: list[dict[str, Any]], count: dict[str, float]) -> list[str]:
    told = ""
    if count:
        told = (f" By batchjac's count (`batchjac._chain`, read from the JAX model), the "
                f"bracketing takes {count.get('operations', float('nan')):.1f}x fewer operations "
                f"than the better pure mode, {count.get('with writes', float('nan')):.1f}x with "
                f"the writes of the Jacobians counted.")
    md = ["## W9: a bottleneck (mixed mode)", "",
          f"MLP {'-'.join(map(str, SIZES))} (tanh), float32, all 512 inputs unknown: the "
          "Jacobian accumulated through the 16-wide layer (reverse mode up to it, forward mode "
          "from it, a product per row) against each framework's pure modes and the hand-written "
          "split at the bottleneck. Every case runs in one fresh process: the time to the K-th "
          "answer (the first call's tracing and compilation included) and the steady state "
          f"(the median of calls {max(KS) + 1}-{CALLS}). Ratios: the case's time over "
          "batchjac's (above 1: batchjac is faster). Error: the first "
          f"{CHECK_ROWS} rows' Jacobians against the native reverse mode's, max |diff| / max "
          f"|ref|.{told} Command: `python -m batchjac._bench.w9 section` (also a section of "
          "`batchjac bench`).", "",
          "| backend | N | case | 1st answer | 10th answer | steady | steady / batchjac's | "
          "10th / batchjac's | error |",
          "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ours = next((c for c in row["cases"] if c["impl"] == "batchjac" and "error" not in c), None)
        for c in row["cases"]:
            name = "**batchjac**" if c["impl"] == "batchjac" else NAMES[row["backend"]][c["impl"]]
            if "error" in c:
                md.append(f"| {row['backend']} | {row['n']:,} | {name} | failed: "
                          f"{c['error'][-200:]!r} ||||||")
                continue
            ratio = f"{c['steady_s'] / ours['steady_s']:.2f}x" if ours else ""
            tenth = f"{c['kth_s']['10'] / ours['kth_s']['10']:.2f}x" if ours else ""
            md.append(f"| {row['backend']} | {row['n']:,} | {name} | {c['first_s'] * 1e3:,.0f} ms | "
                      f"{c['kth_s']['10']:,.2f} s | {c['steady_s'] * 1e3:,.0f} ms | {ratio} | "
                      f"{tenth} | {c.get('err', float('nan')):.1e} |")
    md.append("")
    return md


def main(argv: list[str]) -> None:
    what, *args = argv
    if what == "case":
        backend, impl, n, check = args
        sys.stdout.write("W9-JSON " + json.dumps(run_case(backend, impl, int(n), check)) + "\n")
    elif what == "section":
        res = section(args or None, log=lambda s: print(s, file=sys.stderr))
        sys.stdout.write("\n".join(res["markdown"]) + "\n")
    else:
        raise SystemExit(f"unknown step {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
