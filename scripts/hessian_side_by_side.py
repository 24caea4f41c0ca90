"""Side-by-side timings of batchjac.hessian/laplacian and the native answers in one fresh process
(first call, then the median of 5): python scripts/hessian_side_by_side.py torch|jax|tensorflow W6|W7
[hessian|laplacian|laplacian:forward-over-reverse]. Interim, until the bench harness has W6-W8."""
import sys
import time

import numpy as np

fw, wl = sys.argv[1], sys.argv[2]
N = 10_000
import batchjac
from batchjac.examples import mlp_weights

sizes = (8, 64, 64, 4) if wl == "W6" else (3, 128, 128, 128, 1)
k = 5 if wl == "W6" else 3
layers = mlp_weights(sizes, seed=0)
rng = np.random.default_rng(1)
x = rng.standard_normal((N, sizes[0])).astype("f4")

def timeit(fn, reps=5):
    t0 = time.perf_counter(); r = fn(); first = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return first, float(np.median(ts)), r

if fw == "torch":
    import torch
    torch.manual_seed(0)
    ws = [(torch.tensor(w, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)) for w, b in layers]
    def f(z):
        h = z
        for i, (w, b) in enumerate(ws):
            h = h @ w + b
            if i < len(ws) - 1: h = torch.tanh(h)
        return h
    xt = torch.tensor(x)
    def native_h():
        with torch.no_grad():
            def one(u, c):
                return f(torch.cat([u, c])[None])[0]
            return torch.func.vmap(torch.func.jacfwd(torch.func.jacrev(one)))(xt[:, :k], xt[:, k:]).numpy()
    def native_h_full():
        return torch.func.vmap(torch.func.jacfwd(torch.func.jacrev(lambda z: f(z[None])[0])))(xt).detach().numpy()
elif fw == "jax":
    import jax
    import jax.numpy as jnp
    ws = [(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32)) for w, b in layers]
    def f(z):
        h = z
        for i, (w, b) in enumerate(ws):
            h = h @ w + b
            if i < len(ws) - 1: h = jnp.tanh(h)
        return h
    one = lambda u, c: f(jnp.concatenate([u, c])[None])[0]
    _nh = jax.jit(jax.vmap(jax.jacfwd(jax.jacrev(one))))
    native_h = lambda: np.asarray(_nh(x[:, :k], x[:, k:]))
    _nhf = jax.jit(jax.vmap(jax.hessian(lambda z: f(z[None])[0])))
    native_h_full = lambda: np.asarray(_nhf(x))
else:
    import tensorflow as tf
    ws = [(tf.constant(w, tf.float32), tf.constant(b, tf.float32)) for w, b in layers]
    def f(z):
        h = z
        for i, (w, b) in enumerate(ws):
            h = h @ w + b
            if i < len(ws) - 1: h = tf.tanh(h)
        return h
    @tf.function(jit_compile=True)
    def _nh(u, c):
        with tf.GradientTape() as t2:
            t2.watch(u)
            with tf.GradientTape() as t1:
                t1.watch(u)
                y = f(tf.concat([u, c], -1))
            j = t1.batch_jacobian(y, u)
        return t2.batch_jacobian(j, u)
    native_h = lambda: _nh(tf.constant(x[:, :k]), tf.constant(x[:, k:])).numpy()
    native_h_full = None
    if wl == "W7":
        native_h = lambda: _nh(tf.constant(x), tf.constant(x[:, :0])).numpy()

u, c = x[:, :k], x[:, k:]
what = sys.argv[3] if len(sys.argv) > 3 else "hessian"
if what == "hessian":
    if wl == "W7":
        a = timeit(lambda: batchjac.hessian(f, x, backend=fw))
        b = timeit(native_h_full if native_h_full else native_h)
    else:
        a = timeit(lambda: batchjac.hessian(f, u, c, backend=fw))
        b = timeit(native_h)
    err = np.abs(a[2] - b[2]).max() / np.abs(b[2]).max()
    print(f"{fw} {wl} hessian: batchjac first {a[0]:.3f}s steady {a[1]:.3f}s | native first {b[0]:.3f}s steady {b[1]:.3f}s | ratio steady {a[1]/b[1]:.2f} | rel diff {err:.1e}", flush=True)
else:  # laplacian, W7
    order = what.split(":")[1] if ":" in what else "auto"
    a = timeit(lambda: batchjac.laplacian(f, x, backend=fw, mode=order))
    nat = native_h_full if native_h_full else native_h
    b = timeit(lambda: np.trace(nat(), axis1=-2, axis2=-1))
    err = np.abs(a[2] - b[2]).max() / np.abs(b[2]).max()
    print(f"{fw} {wl} laplacian[{order}]: batchjac first {a[0]:.3f}s steady {a[1]:.3f}s | trace(native hessian) first {b[0]:.3f}s steady {b[1]:.3f}s | ratio steady {a[1]/b[1]:.2f} | rel diff {err:.1e}", flush=True)
