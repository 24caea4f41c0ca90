"""W10: a physics-informed training step. MLP 2-64-64-64-1 (tanh), 10,000 collocation points,
loss ``mean((Laplacian u - 1)^2)``, one optimizer step (Adam: torch, Keras; plain gradient
descent: JAX), with the Laplacian from ``batchjac.laplacian(..., differentiable=True)`` against
the native compositions a user writes:

- PyTorch: nested ``torch.autograd.grad(..., create_graph=True)`` (the classic PINN code) and
  torch.func's ``vmap(hessian)``;
- JAX: ``vmap(hessian)`` (``jacfwd(jacrev)``) inside the jitted step;
- TensorFlow: nested tapes (``gradient``, then ``batch_jacobian``) inside a ``tf.function``,
  plain and under XLA.

Every case runs in a fresh process (``python -m batchjac._bench.w10 step BACKEND IMPL ...``):
the first step (tracing and compilation included; the timer starts once the model and the
data exist), then the median of the steady steps, and memory: the first step's (peak RSS
less the RSS before it: tracing and compilation included) and a steady step's working memory
(the peak RSS it adds once the C allocator has returned its free memory to the system and the
peak was reset: :func:`_fresh_peak`), which ``max_memory`` bounds. Then batchjac again with
``max_memory`` half of the best native's step memory: its step must fit in it and give the
same gradients. The gradients of the first step (at the same weights and points) are written
to a file and compared with the native's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: a step's function and its first gradients (read after the steps)
Step = tuple[Callable[[], Any], Callable[[], list[np.ndarray]]]

SIZES = (2, 64, 64, 64, 1)
N = 10_000
STEPS = 10
#: steps whose working memory is measured (the largest is reported)
MEMORY_STEPS = 3
#: fresh processes per case (medians reported); one for a baseline that takes minutes a round
ROUNDS = 3
ONE_ROUND = {"tapes-xla"}
LR = 1e-3
NATIVES = {"torch": ("autograd", "torch.func"), "jax": ("jax",), "tensorflow": ("tapes", "tapes-xla")}
NATIVE_NAMES = {"autograd": "nested autograd.grad (create_graph)",
                "torch.func": "torch.func vmap(hessian)", "jax": "jit of vmap(hessian)",
                "tapes": "nested tapes in tf.function", "tapes-xla": "nested tapes, XLA"}


#: a steady step's working memory below this is read as not measured (see :func:`measure`)
MEASURABLE_MB = 4.0


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fresh_peak() -> float:
    """The RSS after the C allocator returned its free memory to the system, with the
    process's peak RSS reset to it (Linux: ``clear_refs`` 5): what a step then adds is its
    own working memory, not what earlier steps (compilation included) left cached."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_mb()


def _peak_since_mb() -> float:
    """The peak RSS since :func:`_fresh_peak` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise OSError("no VmHWM in /proc/self/status")


def _allocator_reset(backend: str) -> float:
    """TensorFlow's CPU allocator's bytes in use (MB), its peak reset to them: where the
    allocator keeps freed memory for the next step, the RSS does not grow while a step's
    tensors live (0 MB a step on some hosts), and its own peak is their working set. 0 for
    the other frameworks (the RSS alone)."""
    if backend != "tensorflow":
        return 0.0
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats("CPU:0")
    return float(tf.config.experimental.get_memory_info("CPU:0")["current"]) / 2**20


def _allocator_peak_mb(backend: str) -> float:
    if backend != "tensorflow":
        return 0.0
    import tensorflow as tf

    return float(tf.config.experimental.get_memory_info("CPU:0")["peak"]) / 2**20


def _points() -> np.ndarray:
    return np.random.default_rng(1).uniform(-1, 1, (N, SIZES[0])).astype(np.float32)


# -- one framework's step, native or batchjac -------------------------------------------------

def _torch_step(impl: str, max_memory: int | None) -> Step:
    import torch

    import batchjac
    from batchjac.examples import workload_model

    net = workload_model("W10", "torch")
    x = torch.tensor(_points())
    opt = torch.optim.Adam(net.parameters(), lr=LR)

    def laplacian() -> Any:
        if impl == "batchjac":
            return batchjac.laplacian(net, x, differentiable=True, max_memory=max_memory)
        if impl == "torch.func":
            from torch.func import functional_call, hessian, vmap

            params = dict(net.named_parameters())
            h = vmap(hessian(lambda xi: functional_call(net, params, (xi,))))(x)  # (N, 1, 2, 2)
            return h.diagonal(dim1=-2, dim2=-1).sum(-1)
        xg = x.detach().requires_grad_(True)
        u = net(xg)
        (du,) = torch.autograd.grad(u.sum(), xg, create_graph=True)
        lap: Any = 0
        for i in range(x.shape[1]):
            (d2,) = torch.autograd.grad(du[:, i].sum(), xg, create_graph=True)
            lap = lap + d2[:, i:i + 1]
        return lap

    grads: list[np.ndarray] = []

    def step() -> Any:
        opt.zero_grad()
        loss = (laplacian() - 1.0).square().mean()
        loss.backward()
        if not grads:
            # (the last bias has no gradient: the Laplacian does not depend on it)
            grads.extend(np.zeros(tuple(p.shape), np.float32) if p.grad is None else
                         p.grad.detach().numpy().copy() for p in net.parameters())
        opt.step()
        return loss.item()

    return step, lambda: grads


def _jax_step(impl: str, max_memory: int | None) -> Step:
    import jax
    import jax.numpy as jnp

    import batchjac
    from batchjac.examples import mlp_weights

    params = [(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32))
              for w, b in mlp_weights(SIZES)]
    x = jnp.asarray(_points())

    def net(p: Any, x: Any) -> Any:
        h = x
        for i, (w, b) in enumerate(p):
            h = h @ w + b
            if i < len(p) - 1:
                h = jnp.tanh(h)
        return h

    def laplacian(p: Any) -> Any:
        if impl == "batchjac":
            return batchjac.laplacian(net, x, differentiable=True, max_memory=max_memory,
                                      backend_options={"params": p})
        h = jax.vmap(jax.hessian(lambda xi: net(p, xi)))(x)  # (N, 1, 2, 2)
        return jnp.trace(h, axis1=-2, axis2=-1)

    def loss_fn(p: Any) -> Any:
        return jnp.mean((laplacian(p) - 1.0) ** 2)

    @jax.jit
    def update(p: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(p)
        return loss, g, jax.tree_util.tree_map(lambda a, d: a - LR * d, p, g)

    state = {"p": params}
    grads: list[np.ndarray] = []

    def step() -> Any:
        loss, g, state["p"] = update(state["p"])
        if not grads:
            grads.extend(np.asarray(a) for a in jax.tree_util.tree_leaves(g))
        return float(loss)

    return step, lambda: grads


def _tf_step(impl: str, max_memory: int | None) -> Step:
    import tensorflow as tf

    import batchjac
    from batchjac.examples import workload_model

    model = workload_model("W10", "tensorflow")
    x = tf.constant(_points())
    opt = tf.keras.optimizers.Adam(LR)

    def laplacian() -> Any:
        if impl == "batchjac":
            return batchjac.laplacian(model, x, differentiable=True, max_memory=max_memory)
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                u = model(x)
            du = inner.gradient(u, x)
        return tf.linalg.trace(outer.batch_jacobian(du, x))[:, None]

    def body() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((laplacian() - 1.0) ** 2)
        g = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(g, model.trainable_variables))
        return loss, g

    compiled = tf.function(body, jit_compile=impl == "tapes-xla")
    grads: list[np.ndarray] = []

    def step() -> Any:
        loss, g = compiled()
        if not grads:
            grads.extend(np.zeros(tuple(v.shape), np.float32) if a is None else a.numpy()
                         for a, v in zip(g, model.trainable_variables))
        return float(loss)

    return step, lambda: grads


STEP = {"torch": _torch_step, "jax": _jax_step, "tensorflow": _tf_step}


def run_step(backend: str, impl: str, max_memory: int | None, grads_file: str) -> dict[str, Any]:
    """The first step, then :data:`STEPS` steady ones, in this (fresh) process."""
    step, grads = STEP[backend](impl, max_memory)
    before = _rss_mb()
    t0 = time.perf_counter()
    first_loss = step()
    first = time.perf_counter() - t0
    first_mb = _peak_mb() - before
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    memory = []
    for _ in range(MEMORY_STEPS):  # (apart from the timed steps: the trim costs page faults)
        start, held = _fresh_peak(), _allocator_reset(backend)
        step()
        memory.append(max(_peak_since_mb() - start, _allocator_peak_mb(backend) - held))
    np.savez(grads_file, *grads())
    return {"first_s": first, "steady_s": statistics.median(times), "loss": first_loss,
            "first_mb": first_mb, "step_mb": max(memory)}


# -- the section: every case in a fresh process -----------------------------------------------

def _case(backend: str, impl: str, max_memory: int | None, grads_file: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "batchjac._bench.w10", "step", backend, impl,
           str(max_memory or 0), grads_file]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("W10-JSON "):
            return {"impl": impl, **json.loads(line[len("W10-JSON "):])}
    return {"impl": impl, "error": (proc.stderr or proc.stdout).strip()[-400:]}


def _grad_error(a_file: str, b_file: str) -> float:
    a, b = np.load(a_file), np.load(b_file)
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() or 1.0)) for k in b.files)


def _rounds(backend: str, impls: list[str], max_memory: int | None, tmp: str,
            log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Each case in :data:`ROUNDS` fresh processes, interleaved (a slow spell of the machine
    spreads over all of them), summarised by medians (step memory: the largest)."""
    runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
    for r in range(ROUNDS):
        for impl in impls:
            if r and impl in ONE_ROUND:
                continue
            tag = f"{impl}-budget" if max_memory else impl
            res = _case(backend, impl, max_memory, os.path.join(tmp, f"{backend}-{tag}.npz"))
            log(f"  W10 {backend} {tag} round {r + 1}: {res}")
            runs[impl].append(res)
    out = {}
    for impl, results in runs.items():
        ok = [x for x in results if "error" not in x]
        if not ok:
            out[impl] = results[-1]
            continue
        out[impl] = {"impl": impl, "rounds": len(ok),
                     **{f: statistics.median(x[f] for x in ok)
                        for f in ("first_s", "steady_s", "first_mb")},
                     "step_mb": max(x["step_mb"] for x in ok)}
    return out


def measure(backend: str, tmp: str, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    impls = [*NATIVES[backend], "batchjac"]
    cases = list(_rounds(backend, impls, None, tmp, log).values())
    natives = [c for c in cases if c["impl"] != "batchjac" and "error" not in c]
    if not natives:
        return {"backend": backend, "cases": cases}
    best = min(natives, key=lambda c: c["steady_s"])
    reference = os.path.join(tmp, f"{backend}-{best['impl']}.npz")
    for c in cases:
        if "error" not in c:
            c["grad_err"] = _grad_error(os.path.join(tmp, f"{backend}-{c['impl']}.npz"), reference)
    budget_mb = min(c["step_mb"] for c in natives) / 2
    if budget_mb < MEASURABLE_MB / 2:
        # (no budget of half of nothing: a budget of a few kB runs thousands of chunks)
        cases.append({"impl": "batchjac, max_memory", "error": (
            f"not run: a native steady step added {2 * budget_mb:.2f} MB to the RSS on this "
            f"host (its allocator kept the memory of the earlier steps), so half of it is no "
            f"budget to hold")})
        return {"backend": backend, "cases": cases, "best": best["impl"],
                "best_first": min(natives, key=lambda c: c["first_s"])["impl"]}
    budgeted = _rounds(backend, ["batchjac"], int(budget_mb * 2**20), tmp, log)["batchjac"]
    budgeted["impl"] = "batchjac, max_memory"
    budgeted["budget_mb"] = budget_mb
    if "error" not in budgeted:
        budgeted["grad_err"] = _grad_error(os.path.join(tmp, f"{backend}-batchjac-budget.npz"),
                                           reference)
    cases.append(budgeted)
    return {"backend": backend, "cases": cases, "best": best["impl"],
            "best_first": min(natives, key=lambda c: c["first_s"])["impl"]}


def section(backends: list[str] | None = None, log: Callable[[str], None] = lambda s: None
            ) -> dict[str, Any]:
    from .run import installed_backends

    rows = []
    with tempfile.TemporaryDirectory(prefix="batchjac-w10-") as tmp:
        for backend in [b for b in installed_backends() if not backends or b in backends]:
            rows.append(measure(backend, tmp, log))
    return {"rows": rows, "markdown": markdown(rows)}


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    md = ["## W10: a physics-informed training step (differentiable=True)", "",
          f"MLP {'-'.join(map(str, SIZES))} (tanh), {N:,} collocation points, float32, loss "
          "`mean((Laplacian u - 1)^2)` with `batchjac.laplacian(model, x, differentiable=True)` "
          "against the native compositions, one optimizer step (Adam; JAX: gradient descent) "
          f"each. Every case runs in {ROUNDS} fresh processes, interleaved (medians; the "
          "XLA row in one): the first step (tracing and compilation included; against the "
          f"native with the fastest first step), the median of {STEPS} steady steps (against "
          "the native with the fastest steady step), a steady step's working memory (the peak "
          "RSS it adds after the C allocator returned its free memory and the peak was reset: "
          "what `max_memory` bounds), and the first step's (peak RSS less the RSS before it: "
          "tracing and compilation included). The budgeted row runs batchjac with "
          "`max_memory` = half the best native's step memory. Gradient error: the first "
          "step's parameter gradients against the best native's, max |diff| / max |ref| per "
          "tensor. Command: `python -m batchjac._bench.w10 section` (also a section of "
          "`batchjac bench`).", "",
          "| backend | step | first step | / best native | steady step | / best native | "
          "step memory | first step's memory | gradient error |",
          "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        best = next((c for c in row["cases"] if c["impl"] == row.get("best")), None)
        first_best = next((c for c in row["cases"] if c["impl"] == row.get("best_first")), best)
        for c in row["cases"]:
            name = NATIVE_NAMES.get(c["impl"], c["impl"])
            if "error" in c:
                what = c["error"] if c["error"].startswith("not run") else \
                    f"failed: {c['error'][-200:]!r}"
                md.append(f"| {row['backend']} | {name} | {what} |||||||")
                continue
            first = f"{c['first_s'] / first_best['first_s']:.2f}" if first_best else ""
            steady = f"{c['steady_s'] / best['steady_s']:.2f}" if best else ""
            if c["impl"].startswith("batchjac"):
                first, steady = f"**{first}**", f"**{steady}**"
            mem = f"{c['step_mb']:,.0f} MB"
            if "budget_mb" in c:
                fits = "fits" if c["step_mb"] <= c["budget_mb"] else "OVER"
                mem += f" (budget {c['budget_mb']:,.0f} MB: **{fits}**)"
            name += f" ({c['rounds']} process{'es' if c['rounds'] > 1 else ''})"
            md.append(f"| {row['backend']} | {name} | {c['first_s'] * 1e3:,.0f} ms | {first} | "
                      f"{c['steady_s'] * 1e3:,.1f} ms | {steady} | {mem} | "
                      f"{c['first_mb']:,.0f} MB | {c.get('grad_err', float('nan')):.1e} |")
    md.append("")
    return md


def main(argv: list[str]) -> None:
    what, *args = argv
    if what == "step":
        backend, impl, max_memory, grads_file = args
        res = run_step(backend, impl, int(max_memory) or None, grads_file)
        sys.stdout.write("W10-JSON " + json.dumps(res) + "\n")
    elif what == "section":
        res = section(args or None, log=lambda s: print(s, file=sys.stderr))
        sys.stdout.write("\n".join(res["markdown"]) + "\n")
    else:
        raise SystemExit(f"unknown step {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
