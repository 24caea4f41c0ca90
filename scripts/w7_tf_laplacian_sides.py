# Measurement helper of the forward-Laplacian work (branch lap3): see the report; not part of the package.
"""TF W7: the forward-Laplacian build with main's tf_laplacian against this branch's, and the
nested tapes, interleaved in one process (same weights, 100,000 rows, one chunk)."""
import os, sys, time, tempfile, importlib.util
os.environ.setdefault("BATCHJAC_CACHE_DIR", tempfile.mkdtemp())
import numpy as np, tensorflow as tf
import batchjac._backends as backends
from batchjac._backends import tf_laplacian as new_mod
from batchjac._bench import second
from batchjac._bind import prepare
from batchjac._validate import normalize
spec_ = importlib.util.spec_from_file_location("old_tf_laplacian", "/work/main/src/batchjac/_backends/tf_laplacian.py")
old_mod = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(old_mod)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
R = int(sys.argv[2]) if len(sys.argv) > 2 else 5
model, u, _ = second.model_and_inputs("W7", "tensorflow", N)
nat = second.native("W7", "tensorflow", model)
spec = normalize((u,), wrt=None, dtype=None, nan_policy="raise")
def kernel(mod):
    bound = prepare(lambda x: model(x, training=False), spec, "tensorflow", {})
    k = bound.second_kernel("laplacian", "forward-over-reverse", N, False, False)
    backends.tf_laplacian = mod
    import sys as _s; _s.modules["batchjac._backends.tf_laplacian"] = mod
    k._fn("forward-laplacian")
    _s.modules["batchjac._backends.tf_laplacian"] = new_mod; backends.tf_laplacian = new_mod
    return k
ks = {"main tf_laplacian": kernel(old_mod), "lap3 tf_laplacian": kernel(new_mod)}
uu, ctx = spec.chunk(0, N)
cases = {name: (lambda k=k: k._fn("forward-laplacian")(uu, *k._seed_arrays)["laplacians"].numpy()) for name, k in ks.items()}
cases["native nested tapes"] = lambda: nat(u, None)
ref = cases["native nested tapes"]()
for n, f in cases.items(): print(n, "max|diff|", np.max(np.abs(f().reshape(ref.shape) - ref)))
ts = {n: [] for n in cases}
for r in range(R):
    for n, f in cases.items():
        t = time.perf_counter(); f(); ts[n].append(time.perf_counter() - t)
b = np.median(ts["native nested tapes"])
for n in cases: print(n, f"median {np.median(ts[n])*1e3:.0f} ms, ratio to native {np.median(ts[n])/b:.2f}")
