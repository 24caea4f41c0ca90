"""One-off checks of a model for a batch signature, run before the first real chunk and cached
on the bound model: output shape, connection to the unknowns, and independence of rows."""

from __future__ import annotations

import numpy as np

from ._backends import BoundModel
from ._errors import ModelError, NotConnectedError, RowInteractionError
from ._spec import BatchSpec

PROBE_ROWS = 4


def _probe_batch(spec: BatchSpec) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Up to PROBE_ROWS finite rows of the user's data (the known inputs matter), at least 2."""
    u, ctx = spec.chunk(0, min(spec.n, 64))
    if spec.n:
        finite = np.isfinite(u.reshape(len(u), -1)).all(axis=1)
        for c in ctx:
            if c.dtype.kind == "f":
                finite &= np.isfinite(c.reshape(len(c), -1)).all(axis=1)
        rows = np.flatnonzero(finite)[:PROBE_ROWS]
    else:
        rows = np.array([], dtype=int)
    if rows.size == 0:  # no usable data (N = 0, or all NaN): synthetic rows of the right shape
        rng = np.random.default_rng(0)
        u = rng.standard_normal((2, *spec.unknown_shape)).astype(spec.dtype)
        ctx = tuple(np.zeros((2, *c.shape[1:]), c.dtype) + (0.5 if c.dtype.kind == "f" else 0)
                    for c in ctx)
        return u, ctx
    if rows.size == 1:
        rows = np.array([rows[0], rows[0]])
    return u[rows], tuple(c[rows] for c in ctx)


def run_probes(bound: BoundModel, spec: BatchSpec, name: str) -> None:
    u, ctx = _probe_batch(spec)
    rows = u.shape[0]
    y0 = bound.forward(u, ctx)
    if y0.ndim == 0 or y0.shape[0] != rows:
        raise ModelError(
            f"For a batch of {rows} rows the model returned shape {y0.shape}; it must map a batch "
            f"(N, ...) to outputs (N, ...), one row per instance. If it handles one instance at "
            f"a time, vectorise it (e.g. jax.vmap) or use the backend's per-instance option."
        )
    if not bound.connected(u, ctx):
        raise NotConnectedError(
            f"The model's output does not depend on the unknowns (`{name}`, per-instance shape "
            f"{spec.unknown_shape}): autodiff finds no path from them to the output. This is "
            f"why GradientTape.jacobian returns None. Usual causes: the output is computed "
            f"outside the differentiable graph (model.predict, .numpy(), numpy functions), or "
            f"the model never reads the unknown input. (Unknown features that are merely unused "
            f"get zero columns; this error means none is used.)"
        )
    if spec.n >= 1:
        _check_rows_independent(bound, u, ctx, y0)
    bound.output_shape = tuple(int(s) for s in y0.shape[1:])
    bound.probed = True


def _check_rows_independent(bound: BoundModel, u: np.ndarray, ctx: tuple[np.ndarray, ...],
                            y0: np.ndarray) -> None:
    """Change row 0's inputs; every other row's output must stay the same (tensorflow#38428:
    batch statistics make each instance's output depend on the whole batch, and then
    per-instance Jacobians are silently wrong)."""
    rng = np.random.default_rng(1234)
    u1 = u.copy()
    u1[0] = u[0] + (0.5 * np.abs(u[0]) + 0.5) * rng.standard_normal(u[0].shape).astype(u.dtype)
    ctx1 = []
    for c in ctx:
        c1 = c.copy()
        if c.dtype.kind == "f" and c.shape[0]:
            c1[0] = c[0] + (0.5 * np.abs(c[0]) + 0.5) * rng.standard_normal(c[0].shape).astype(c.dtype)
        ctx1.append(c1)
    y1 = bound.forward(u1, tuple(ctx1))
    a, b = y0[1:].astype(np.float64), y1[1:].astype(np.float64)
    both = np.isfinite(a) & np.isfinite(b)
    scale = max(float(np.abs(a[both]).max()) if both.any() else 1.0, 1e-30)
    tol = np.sqrt(np.finfo(y0.dtype if y0.dtype.kind == "f" else np.float32).eps) * scale
    changed = (np.abs(a - b) > tol) & both | (np.isfinite(a) != np.isfinite(b))
    if changed.any():
        diff = float(np.abs(a - b)[both].max()) if both.any() else float("nan")
        raise RowInteractionError(
            f"The rows of a batch interact: changing instance 0's inputs changed the outputs of "
            f"other instances (by up to {diff:.3g}, output scale {scale:.3g}). Per-instance "
            f"Jacobians would then be silently wrong (see tensorflow#38428). Usual cause: batch "
            f"statistics, e.g. BatchNormalization in training mode or normalising over the "
            f"batch axis. Run the model in inference mode, or make each row's output depend "
            f"only on its own inputs."
        )
