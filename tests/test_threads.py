"""20 threads calling ``batchjac.jacobian`` on one model at once, in every backend and mode:
every result's values against the framework's own Jacobian, computed once up front (issue 19:
torch's forward mode gave errors, fallbacks blaming the model and all-zero Jacobians).

The threads' row counts differ (5 + i % 5 + 3 * call), so they also race to build, cache and
reuse kernels for new sizes, the tuning ledger and the fast path for repeated calls. Warnings are
errors in every thread (pytest's ``filterwarnings``): a fallback warning is a failure here.
Each case is bounded in time (threads joined with a timeout).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac._finite_diff import max_relative_error

from .helpers import RTOL, tanh_model

THREADS, CALLS = 20, 3
K, H = 3, 2  # tanh_model: 3 unknowns + 2 known -> 8 outputs; mode="auto" picks forward
LIMIT_S = 60  # a hang, not slowness, is what this catches (measured: 1-4 s per case)

@pytest.mark.parametrize("mode", ["forward", "auto", "reverse"])
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_twenty_threads_on_one_model_get_correct_values(backend: str, mode: str) -> None:
    model, reference = tanh_model(backend)
    rng = np.random.default_rng(19000)
    # 4 threads share each row count: kernels of one size and of several built concurrently
    sizes = [5 + i % 5 + 3 * c for i in range(THREADS) for c in range(CALLS)]
    u_all = rng.uniform(-1.5, 1.5, (sum(sizes), K)).astype(np.float32)
    h_all = rng.normal(size=(sum(sizes), H)).astype(np.float32)
    ref_all = reference(u_all, h_all)  # the framework's own, in one call, before any thread
    cuts = np.cumsum([0, *sizes])
    calls = [(u_all[a:b], h_all[a:b], ref_all[a:b]) for a, b in itertools.pairwise(cuts)]
    inputs = [calls[CALLS * i:CALLS * (i + 1)] for i in range(THREADS)]
    assert np.abs(ref_all).max() > 0.1  # not a zero model
    failures: list[str] = []
    checked = [0]
    lock = threading.Lock()
    start = threading.Barrier(THREADS)

    def work(i: int) -> None:
        try:
            start.wait(timeout=LIMIT_S)
            for u, h, ref in inputs[i]:
                jac = batchjac.jacobian(model, u, h, mode=mode)
                err = max_relative_error(np.asarray(jac), ref) if jac.shape == ref.shape else np.inf
                with lock:
                    checked[0] += 1
                    if not err <= RTOL[np.dtype(np.float32)]:
                        failures.append(f"thread {i}, {len(u)} rows: shape {jac.shape}, max "
                                        f"relative error {err:.2e}, max |J| {np.abs(jac).max():.3g}")
        except Exception as e:  # reported below, with the thread
            with lock:
                failures.append(f"thread {i}: {type(e).__name__}: {e}")

    t0 = time.monotonic()
    pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(THREADS)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=max(0.1, LIMIT_S - (time.monotonic() - t0)))
    assert not any(t.is_alive() for t in pool), f"threads still running after {LIMIT_S} s"
    assert not failures, "\n".join(failures[:5])  # whole, not a truncated repr
    assert checked[0] == THREADS * CALLS


def test_threads_binding_one_model_bind_and_probe_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race behind a false RebindWarning (seen 1 run in 7 above, JAX forward mode): threads
    meeting a model first each built their own bound model, or probed the shared one again;
    the copies then counted as "new function objects with the same code". Binding and probing
    are made slow here, so every thread is inside them at once."""
    from batchjac import ClosedForm, _backends, _bind
    from batchjac._backends.numpy import NumpyBackend

    a = np.random.default_rng(1920).normal(size=(4, K))
    model = ClosedForm(lambda z: np.tanh(z @ a.T),
                       lambda z: (1 - np.tanh(z @ a.T) ** 2)[:, :, None] * a[None])
    slow_bind, slow_probes = NumpyBackend.bind, _bind.run_probes
    probes: list[int] = []

    def bind(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return slow_bind(self, *args, **kwargs)

    def run_probes(*args: Any, **kwargs: Any) -> None:
        probes.append(1)
        time.sleep(0.05)
        slow_probes(*args, **kwargs)

    monkeypatch.setattr(NumpyBackend, "bind", bind)
    monkeypatch.setattr(_bind, "run_probes", run_probes)
    start = threading.Barrier(THREADS)
    results: dict[int, Any] = {}

    def work(i: int) -> None:
        x = np.random.default_rng(19200 + i).normal(size=(6, K))
        start.wait(timeout=LIMIT_S)
        try:
            results[i] = (x, batchjac.jacobian(model, x))
        except Exception as e:  # reported below
            results[i] = (x, e)

    pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(THREADS)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=LIMIT_S)
    assert len(results) == THREADS
    for x, jac in results.values():
        assert isinstance(jac, np.ndarray), jac
        np.testing.assert_allclose(jac, (1 - np.tanh(x @ a.T) ** 2)[:, :, None] * a[None],
                                   rtol=1e-12)
    assert len(_backends._bound[model]) == 1  # one bound model for the one signature
    assert len(probes) == 1, f"the probes ran {len(probes)} times for one model"


@pytest.mark.parametrize(("backend", "module", "kernel_class", "first"), [
    ("tensorflow", "tensorflow", "TFKernel", "_establish"),
    ("jax", "jax", "JaxKernel", "choose"),
    ("torch", "torch", "TorchKernel", "_establish"),
])
def test_threads_meeting_a_new_kernel_establish_it_once(
        backend: str, module: str, kernel_class: str, first: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The race behind a VectorizationFallbackWarning in the 20-thread case above (1 CI run in
    a few dozen, TensorFlow forward mode): threads calling one kernel for the first time each
    ran its first call, and TensorFlow's reset the path another thread was building on it.
    The first call is made slow here, so every thread arrives while it runs: one runs it, the
    others wait for its choice and compute with it."""
    import importlib

    cls = getattr(importlib.import_module(f"batchjac._backends.{module}"), kernel_class)
    slow, entered = getattr(cls, first), []

    def first_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        entered.append(id(self))
        time.sleep(0.2)
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(cls, first, first_call)
    model, reference = tanh_model(backend)
    rng = np.random.default_rng(19300)
    u = rng.uniform(-1.5, 1.5, (7, K)).astype(np.float32)
    h = rng.normal(size=(7, H)).astype(np.float32)
    ref = reference(u, h)
    batchjac.jacobian(model, u[:3], h[:3], mode="forward", chunk_size=3)  # bound and probed
    entered.clear()
    start, results = threading.Barrier(8), []

    def work() -> None:
        start.wait(timeout=LIMIT_S)
        try:
            results.append(batchjac.jacobian(model, u, h, mode="forward", chunk_size=7))
        except Exception as e:  # reported below
            results.append(e)

    pool = [threading.Thread(target=work, daemon=True) for _ in range(8)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=LIMIT_S)
    assert len(results) == 8
    for jac in results:
        assert isinstance(jac, np.ndarray), jac
        assert max_relative_error(jac, ref) <= RTOL[np.dtype(np.float32)]
    assert len(entered) == 1, f"{len(entered)} threads ran the new kernel's first call"
