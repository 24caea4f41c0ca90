# Measurement helper of the cold-start work (branch cold): see the report; not part of the package.
"""Time breakdown of one batchjac first call in this fresh process: intervals of key functions per thread.
usage: brk.py W BACKEND N [native]"""
import functools
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("BATCHJAC_CACHE_DIR", tempfile.mkdtemp())
W, B, N = sys.argv[1], sys.argv[2], int(sys.argv[3])
import numpy as np

import batchjac
from batchjac._bench import cold
from batchjac.examples import workload_inputs, workload_model

cold._import_baselines(B)
model = workload_model(W, B)
u, k = workload_inputs(W, N)
data = (u,) if k is None else (u, k)
log = []
T0 = [0.0]
def wrap(obj, name, label=None):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **kw):
        s = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            log.append((label or name, threading.current_thread().name[:12], s - T0[0], time.perf_counter() - T0[0]))
    setattr(obj, name, g)
from batchjac import _bind, _jacobian, _probes
from batchjac._backends import get_backend
from batchjac._tune import policy as _tuning

be = get_backend(B)
import importlib

mod = importlib.import_module(f"batchjac._backends.{B}")
bound_cls = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, batchjac._backends.BoundModel) and c is not batchjac._backends.BoundModel][0]
for n in ("forward", "connected", "output_shape_of", "build_kernel", "rows_apart"):
    if n in vars(bound_cls): wrap(bound_cls, n)
wrap(_probes, "run_probes"); _bind.run_probes = _probes.run_probes
if os.environ.get("NOPROBE"): _bind.run_probes = lambda b, s, n: setattr(b, "probed", True)
wrap(_bind, "_prepare")
wrap(_bind, "probed"); _jacobian.probed = _bind.probed
wrap(_tuning, "persist"); wrap(_tuning, "persist_probes"); _bind.persist_probes = _tuning.persist_probes
wrap(_tuning, "recall_probes"); _bind.recall_probes = _tuning.recall_probes
wrap(_bind, "_same_code")
import batchjac._fingerprint as fp

wrap(fp, "computation_fingerprint")
if B == "jax":
    from batchjac._backends.jax import executables as je
    wrap(je, "compile", "exec.compile"); wrap(je, "_key", "exec._key")
    K = mod.JaxKernel
    wrap(K, "_block_sizes")
    for n in ("_lowering", "_compile", "_first_call", "_compile_default"):
        wrap(K, n)
from batchjac import _runner

wrap(_runner, "run_single"); _jacobian.run_single = _runner.run_single
if len(sys.argv) > 4:
    T0[0] = time.perf_counter(); C0 = time.process_time()
    f = cold._native(B, model, sys.argv[4])
    s = time.perf_counter(); J = f(u, k); e = time.perf_counter()
    print(f"native first {1e3*(e-T0[0]):.1f} ms cpu {1e3*(time.process_time()-C0):.1f} ms")
    sys.exit()
T0[0] = time.perf_counter(); C0 = time.process_time()
J = np.asarray(batchjac.jacobian(model, *data))
tot = time.perf_counter() - T0[0]; cpu = time.process_time() - C0
print(f"first call {tot*1e3:.1f} ms cpu {cpu*1e3:.1f} ms")
for name, th, s, e in sorted(log, key=lambda r: r[2]):
    print(f"  {th:12s} {name:24s} {s*1e3:7.1f} -> {e*1e3:7.1f}  ({(e-s)*1e3:6.1f} ms)")
