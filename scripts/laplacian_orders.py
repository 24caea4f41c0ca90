"""Laplacian orders side by side in one process (W7, N=10,000, float32): python lap.py FW"""
import sys
import time

import numpy as np

import batchjac
from batchjac.examples import mlp_weights

fw = sys.argv[1]
layers = mlp_weights((3,128,128,128,1), seed=0)
x = np.random.default_rng(1).standard_normal((10000, 3)).astype("f4")
if fw == "torch":
    import torch as T; ws=[(T.tensor(w,dtype=T.float32),T.tensor(b,dtype=T.float32)) for w,b in layers]; tanh=T.tanh
elif fw == "jax":
    import jax.numpy as T; ws=[(T.asarray(w,T.float32),T.asarray(b,T.float32)) for w,b in layers]; tanh=T.tanh
else:
    import tensorflow as T; ws=[(T.constant(w,T.float32),T.constant(b,T.float32)) for w,b in layers]; tanh=T.tanh
def f(z):
    h=z
    for i,(w,b) in enumerate(ws):
        h=h@w+b
        if i<len(ws)-1: h=tanh(h)
    return h
orders=["forward-over-forward","forward-over-reverse"]
for o in orders: batchjac.laplacian(f, x, mode=o, backend=fw); batchjac.laplacian(f, x, mode=o, backend=fw)
ts={o:[] for o in orders}
for _ in range(7):
    for o in orders:
        t=time.perf_counter(); batchjac.laplacian(f, x, mode=o, backend=fw); ts[o].append(time.perf_counter()-t)
print(fw, {o: round(float(np.median(v)),3) for o,v in ts.items()}, "ratio ff/fr", round(float(np.median(ts[orders[0]])/np.median(ts[orders[1]])),2))
