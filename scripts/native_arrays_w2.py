# Measurement helper of the native-arrays work (branch arrays, issue 17): see the report; not
# part of the package.
"""Torch W2 (N=10,000), torch tensors in and out, in one process:

1. the NaN/Inf check of the input, old (isfinite(x).all(), four passes) against new (one sum);
2. batchjac against the native baseline (vmap(jacrev)), call by call, with the kernel variant
   batchjac used (the first calls' untimed build, then the race);
3. torch's profiler on one steady call of each: which copies each makes.

usage: BATCHJAC_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python scripts/native_arrays_w2.py [calls]
"""
import statistics
import sys
import time

import torch
from torch.func import jacrev, vmap
from torch.profiler import ProfilerActivity, profile

import batchjac
from batchjac.examples import workload_inputs, workload_model

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 10
model = workload_model("W2", "torch")
x, _ = workload_inputs("W2", 10_000)
xt = torch.from_numpy(x)

checks = {"isfinite(x).all()": lambda: bool(torch.isfinite(xt).all()),
          "isfinite(x.sum())": lambda: bool(torch.isfinite(xt.sum()))}
times: dict[str, list[float]] = {k: [] for k in checks}
for _ in range(15):
    for k, fn in checks.items():
        start = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - start)
print("input check:", {k: f"{statistics.median(v) * 1e3:.2f} ms" for k, v in times.items()})


def base() -> torch.Tensor:
    with torch.no_grad():
        return vmap(jacrev(lambda r: model(r[None])[0]))(xt)


for i in range(calls):
    start = time.perf_counter()
    batchjac.jacobian(model, xt, explain=i in (0, calls - 1))
    ours = time.perf_counter() - start
    start = time.perf_counter()
    base()
    theirs = time.perf_counter() - start
    print(f"call {i}: batchjac {ours * 1e3:.0f} ms, baseline {theirs * 1e3:.0f} ms, "
          f"ratio {ours / theirs:.2f}")

for name, fn in (("batchjac", lambda: batchjac.jacobian(model, xt)), ("baseline", base)):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    print(f"--- {name}: copies and reductions over whole arrays")
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in ("aten::copy_", "aten::clone", "aten::cat", "aten::eq", "aten::ne",
                     "aten::abs", "aten::all", "aten::sum") and e.self_cpu_time_total > 500:
            print(f"  {e.key} x{e.count} {e.self_cpu_time_total / 1e3:.1f} ms {e.input_shapes}")
