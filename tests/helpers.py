"""Shared test helpers: one tolerance table keyed by dtype, float64 references."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from batchjac._finite_diff import central_differences

# Per entry: |J - J_ref| <= atol + rtol * |J_ref|, with rtol by the dtype batchjac computed in
RTOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-8}
# and a small atol, relative to the reference's largest entry, for entries that are (near) zero
# where rounding leaves a residue: 100x (float32) and 10x (float64) tighter than the whole-array
# criterion it replaced, which let an entry be wrong by up to RTOL * max|J_ref| however small it
# should have been. float64 cannot go tighter against central differences: their own error is
# ~eps**(2/3) ~ 4e-11 of the outputs' scale (measured: 3e-10 of max|J| on the torch CNN).
ATOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-9}


def assert_jac_close(jac: np.ndarray, ref: np.ndarray, dtype: Any = None, factor: float = 1.0) -> None:
    """Every entry of ``jac`` within ``atol + rtol * |ref|`` of the reference's entry.

    ``factor`` widens both tolerances (a reference that is itself only so accurate)."""
    jac = np.asarray(jac)
    ref = np.asarray(ref)
    assert jac.shape == ref.shape, f"shape {jac.shape} != reference {ref.shape}"
    assert np.all(np.isfinite(jac)), "non-finite Jacobian entries"
    key = np.dtype(dtype or jac.dtype)
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    np.testing.assert_allclose(
        np.asarray(jac, np.float64), np.asarray(ref, np.float64),
        rtol=RTOL[key] * factor, atol=ATOL[key] * factor * (scale or 1.0),
    )


def assert_close(actual: Any, desired: Any, rtol: float, atol: float = 0.0) -> None:
    """Per-entry comparison for non-Jacobian results (covariances, solutions): one helper so
    that no test falls back to a whole-array relative error."""
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(desired, np.float64),
                               rtol=rtol, atol=atol)


def jax_x64() -> Any:
    """JAX's x64 mode for the duration of a ``with`` block only: ``jax.enable_x64`` (>= 0.7),
    else its experimental home (older JAX)."""
    import jax

    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pragma: no cover - older jax

    return enable_x64()  # pragma: no cover


def fd_reference(forward64: Any, u: np.ndarray) -> np.ndarray:
    """Central differences of a float64 batch function."""
    return central_differences(forward64, np.asarray(u, np.float64))


def run_in_fresh_process(code: str) -> str:
    """Run ``code`` (dedented) in a new Python process with warnings as errors and this
    checkout's batchjac first on the path; its stdout (the process must exit 0)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    import batchjac

    src = str(Path(batchjac.__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
                          env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


__all__ = ["ATOL", "RTOL", "assert_close", "assert_jac_close", "central_differences", "fd_reference", "rng",
           "run_in_fresh_process"]


def all_compiled(bound: Any) -> bool:
    """Whether every build of a JAX model's kernels was compiled here, none loaded from disk
    (the quick first build, and the steady one where the tier-up found a core free)."""
    builds = sum(len({*k._compiled, *k._pending}) for k in bound.kernels())
    return bool(bound.compile_count == builds > 0)


def race_now(monkeypatch: Any) -> None:
    """Make every call pay for its races (batchjac._tune.policy's rule answers yes), as a job large
    enough to repay them would: for tests of the races themselves."""
    import batchjac._tune.policy

    monkeypatch.setattr(batchjac._tune.policy, "worth", lambda *args, **kwargs: True)


# ---- one small model in every framework, with the framework's own Jacobian ---------------------
K, H, M = 3, 2, 8  # 3 unknowns + 2 known inputs -> 8 outputs: mode="auto" picks forward mode
_rng = np.random.default_rng(1919)
W = (_rng.normal(size=(K + H, M)) * 0.7).astype(np.float32)
B = (_rng.normal(size=(M,)) * 0.1).astype(np.float32)


def tanh_model(backend: str) -> tuple[Any, Callable[[np.ndarray, np.ndarray], np.ndarray]]:
    """The model ``tanh([u, h] @ W + b)`` of ``backend``, and the framework's own per-instance
    Jacobian with respect to ``u`` (its batch_jacobian / vmap of jacrev)."""
    if backend == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        keras = pytest.importorskip("keras")
        dense = keras.layers.Dense(M, activation="tanh")
        model = keras.Sequential([keras.Input((K + H,)), dense])
        dense.set_weights([W, B])

        def tf_reference(u: np.ndarray, h: np.ndarray) -> np.ndarray:
            ut = tf.constant(u)
            with tf.GradientTape() as tape:
                tape.watch(ut)
                y = model(tf.concat([ut, tf.constant(h)], axis=1))
            return np.asarray(tape.batch_jacobian(y, ut))

        return model, tf_reference
    if backend == "jax":
        jax = pytest.importorskip("jax")
        jnp = jax.numpy
        wj, bj = jnp.asarray(W), jnp.asarray(B)

        def jax_model(z: Any) -> Any:
            return jnp.tanh(z @ wj + bj)

        row_jac = jax.jit(jax.vmap(jax.jacrev(
            lambda u, h: jax_model(jnp.concatenate([u, h])[None])[0])))
        return jax_model, lambda u, h: np.asarray(row_jac(u, h))
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(K + H, M), torch.nn.Tanh())
    with torch.no_grad():
        net[0].weight.copy_(torch.from_numpy(W.T.copy()))
        net[0].bias.copy_(torch.from_numpy(B))

    def torch_reference(u: np.ndarray, h: np.ndarray) -> np.ndarray:
        row = torch.func.jacrev(lambda ui, hi: net(torch.cat([ui, hi])[None])[0])
        with torch.no_grad():
            return torch.func.vmap(row)(torch.from_numpy(u), torch.from_numpy(h)).numpy()

    return net, torch_reference


_DROP_AND_EXEC = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")
os.execv(sys.argv[1], sys.argv[1:])
"""


def without_dac_capabilities(argv: list[str]) -> list[str]:
    """``argv`` for tests of permission errors that must run as root too (CI runs as root,
    which reads and writes any file through CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH): as
    root, a small Python drops both from its bounding set and execs ``argv``, which then runs
    as root without them, refused what any user is refused. (A ``preexec_fn`` would fork this
    process, which JAX, once imported, warns against.) Unchanged for other users."""
    import os
    import sys

    if os.geteuid() != 0:
        return argv
    return [sys.executable, "-c", _DROP_AND_EXEC, *argv]
