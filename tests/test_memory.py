"""200 calls with 200 distinct row counts on one model, in every backend: memory stays bounded
(issue 19: Keras grew ~28 MB and JAX ~9 MB per new batch size, 1,119 -> 1,660 MB in 19 calls),
and every result is right (against the framework's own Jacobian, computed up front).

Measured on this tree (2-core machine under load; /tmp/reliab_rss.py of the session): RSS grew
0.1 MiB (TensorFlow), 0.3 MiB (JAX), 0.3 MiB (torch) from call 20 to call 200, in 0.6-4.4 s.
The bound below is 25 MiB: ~100x that, and under one new batch size of the old growth.
Kernels are bounded too (at most ``BoundModel.MAX_KERNELS`` kept per bound model).
"""

from __future__ import annotations

import gc
import itertools
import os

import numpy as np
import pytest

import batchjac
from batchjac import _backends

from .helpers import RTOL, H, K, tanh_model

SIZES = list(range(10, 210))  # 200 distinct N
WARM_UP = 20  # calls before the first reading: the first kernels, the frameworks' own caches
BOUND_MIB = 25


def rss_mib() -> float:
    """Resident memory of this process, from /proc (no dependency; Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_two_hundred_distinct_batch_sizes_keep_memory_bounded(backend: str) -> None:
    model, reference = tanh_model(backend)
    rng = np.random.default_rng(1930)
    u_all = rng.uniform(-1.5, 1.5, (sum(SIZES), K)).astype(np.float32)
    h_all = rng.normal(size=(sum(SIZES), H)).astype(np.float32)
    ref_all = reference(u_all, h_all)
    cuts = list(itertools.pairwise(np.cumsum([0, *SIZES]).tolist()))
    before = 0.0
    for i, (lo, hi) in enumerate(cuts):
        jac = np.asarray(batchjac.jacobian(model, u_all[lo:hi], h_all[lo:hi]))
        assert jac.shape == ref_all[lo:hi].shape
        err = np.abs(jac - ref_all[lo:hi]).max() / np.abs(ref_all[lo:hi]).max()
        assert err <= RTOL[np.dtype(np.float32)], f"N={hi - lo}: max relative error {err:.2e}"
        if i == WARM_UP - 1:
            gc.collect()
            before = rss_mib()
    gc.collect()
    grown = rss_mib() - before
    assert grown < BOUND_MIB, (f"RSS grew {grown:.1f} MiB over {len(SIZES) - WARM_UP} new batch "
                               f"sizes (bound {BOUND_MIB} MiB)")
    bound = list(_backends._bound[model].values())
    assert bound, "the model was not bound"
    for b in bound:
        assert len(b._kernels) <= b.MAX_KERNELS
