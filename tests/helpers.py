"""Shared test helpers: one tolerance table keyed by dtype, float64 references."""

from __future__ import annotations

from typing import Any

import numpy as np

from batchjac._finite_diff import central_differences, max_relative_error

# max |J - J_ref| / max |J_ref| allowed, by the dtype batchjac computed in
RTOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-8}


def assert_jac_close(jac: np.ndarray, ref: np.ndarray, dtype: Any = None, factor: float = 1.0) -> None:
    jac = np.asarray(jac)
    assert jac.shape == ref.shape, f"shape {jac.shape} != reference {ref.shape}"
    assert np.all(np.isfinite(jac)), "non-finite Jacobian entries"
    tol = RTOL[np.dtype(dtype or jac.dtype)] * factor
    err = max_relative_error(jac, ref)
    assert err <= tol, f"max relative error {err:.3e} > {tol:.1e}"


def fd_reference(forward64: Any, u: np.ndarray) -> np.ndarray:
    """Central differences of a float64 batch function."""
    return central_differences(forward64, np.asarray(u, np.float64))


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


__all__ = ["RTOL", "assert_jac_close", "central_differences", "fd_reference", "max_relative_error", "rng"]


def race_now(monkeypatch: Any) -> None:
    """Make every call pay for its races (batchjac._tuning's rule answers yes), as a job large
    enough to repay them would: for tests of the races themselves."""
    import batchjac._tuning

    monkeypatch.setattr(batchjac._tuning, "worth", lambda *args, **kwargs: True)
