# Measurement helper of the forward-Laplacian work (branch lap3): see the report; not part of the package.
"""W7 (JAX): batchjac.laplacian with the forward Laplacian, the same with it disabled
(jvp of jvp: what main computes), and the bench's native trace of jit(vmap(hessian)),
interleaved in one process; median of R rounds."""
import os, sys, time, tempfile
os.environ.setdefault("BATCHJAC_CACHE_DIR", tempfile.mkdtemp())
import numpy as np, jax
import batchjac
from batchjac._bench import second
from batchjac._backends import jax_laplacian

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
R = int(sys.argv[2]) if len(sys.argv) > 2 else 5
model, unknown, known = second.model_and_inputs("W7", "jax", n)
nat = second.native("W7", "jax", model)
old_model = lambda x: model(x)  # another model object: its own kernels

orig = jax_laplacian.run
def no_forward_laplacian(*a):
    raise jax_laplacian.Unsupported("disabled for the bench")

def new():
    return batchjac.laplacian(model, unknown)
def old():
    jax_laplacian.run = no_forward_laplacian
    try:
        return batchjac.laplacian(old_model, unknown, backend="jax")
    finally:
        jax_laplacian.run = orig
def native():
    return nat(unknown, known)

cases = {"forward-laplacian": new, "jvp-of-jvp (main)": old, "native trace(jit(vmap(hessian)))": native}
first, res = {}, {}
for name, fn in cases.items():
    t = time.perf_counter(); res[name] = np.asarray(fn()); first[name] = time.perf_counter() - t
ref = res["native trace(jit(vmap(hessian)))"]
for name in cases:
    print(f"{name}: max |diff| vs native {np.max(np.abs(res[name] - ref)):.2e}; first call {first[name]:.2f} s")
times = {name: [] for name in cases}
for r in range(R):
    for name, fn in cases.items():
        t = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t)
med = {k: float(np.median(v)) for k, v in times.items()}
nat_t = med["native trace(jit(vmap(hessian)))"]
for name in cases:
    print(f"{name}: median {med[name]*1e3:.0f} ms (min {min(times[name])*1e3:.0f}), ratio to native {med[name]/nat_t:.2f}")
