"""Central finite differences in float64: the independent reference for Jacobians."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def central_differences(
    f: Callable[[np.ndarray], np.ndarray], u: np.ndarray, *, rel_step: float | None = None
) -> np.ndarray:
    """Per-instance Jacobians of a batch function ``f`` (rows independent) at ``u``.

    One perturbed batch per unknown feature and sign, so ``2 k`` calls of ``f`` for the whole
    batch. The step per entry is ``rel_step * max(1, |u|)`` with ``rel_step = eps^(1/3)``
    (the optimum for central differences, truncation ~ h², rounding ~ eps/h), taken as an
    exactly representable difference.
    """
    u = np.asarray(u, dtype=np.float64)
    n, ushape = u.shape[0], u.shape[1:]
    k = int(np.prod(ushape, dtype=np.int64))
    rel = np.finfo(np.float64).eps ** (1 / 3) if rel_step is None else rel_step
    flat = u.reshape(n, k)
    cols = []
    for j in range(k):
        h = rel * np.maximum(1.0, np.abs(flat[:, j]))
        up, down = flat.copy(), flat.copy()
        up[:, j] += h
        down[:, j] -= h
        step = up[:, j] - down[:, j]  # the step actually taken, after rounding
        diff = np.asarray(f(up.reshape(u.shape)), np.float64) - np.asarray(
            f(down.reshape(u.shape)), np.float64)
        cols.append(diff / step.reshape((n,) + (1,) * (diff.ndim - 1)))
    jac = np.stack(cols, axis=-1)  # (n, *out, k)
    return jac.reshape(jac.shape[:-1] + ushape)


def max_relative_error(jac: np.ndarray, ref: np.ndarray) -> float:
    """``max |J - J_ref| / max |J_ref|``: the figure the benchmarks and issues quote."""
    scale = float(np.abs(ref).max()) or 1.0
    return float(np.abs(np.asarray(jac, np.float64) - ref).max() / scale)
