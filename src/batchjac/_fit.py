"""When a converged instance of :func:`batchjac.solve` counts as *fitted*: the residual test
behind ``success``.

The iterations stop where the gradient vanishes; that is a local minimum of the cost as often
as a fit of the targets (``y = z^3 - 3z`` with a target above 2, started left of the hump).
``success`` must mean the targets are matched, so a converged instance passes one more test
on its weighted residual norm ``r = ||sqrt(w) (f(x) - t)||_2``:

- **with** ``sigma`` (absolute standard deviations): ``r^2`` is a chi-square statistic; the
  instance is fitted when ``r^2`` lies below the chi-square distribution's 99.9% quantile for
  ``max(m - k, 1)`` degrees of freedom (the Wilson-Hilferty approximation, which lies
  slightly above the exact quantile: 3% at one degree of freedom, under 1% from ten up).
  Noise of the size ``sigma`` says passes; a residual many standard deviations off does not.
- **without** it (no weights, or relative ``weights``): ``r <= fit_tol * max(||sqrt(w) t||,
  sqrt(sum(w)))`` -- the residual small relative to the targets, and, for targets near zero,
  an RMS residual of at most ``fit_tol`` per unit weight. ``fit_tol`` defaults to 1e-6 in
  float64 and 1e-4 in float32: a hundred times what the solver reaches on targets a model
  can reproduce (its tolerances are 1e-8 and 1e-6), far below the residual of a distinct
  local minimum. Targets with noise and no ``sigma`` need a ``fit_tol`` of the noise's
  relative size, or ``sigma``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["CHI2_LEVEL", "chi2_quantile", "default_fit_tol", "fitted"]

#: the chi-square quantile the residual of a fit with ``sigma`` must stay below
CHI2_LEVEL = 0.999
_Z = 3.090232306167813  # standard normal quantile at CHI2_LEVEL


def default_fit_tol(dtype: np.dtype) -> float:
    """The relative residual a fitted instance may keep, by compute dtype."""
    return 1e-6 if np.dtype(dtype) == np.float64 else 1e-4


def chi2_quantile(dof: int) -> float:
    """The chi-square distribution's :data:`CHI2_LEVEL` quantile for ``dof`` degrees of
    freedom (Wilson-Hilferty: ``dof * (1 - 2/(9 dof) + z sqrt(2/(9 dof)))^3``)."""
    d = max(int(dof), 1)
    c = 2.0 / (9.0 * d)
    return d * (1.0 - c + _Z * math.sqrt(c)) ** 3


def fitted(residual: np.ndarray, target: np.ndarray, sqrt_w: np.ndarray | None, *,
           k: int, absolute: bool, fit_tol: float) -> np.ndarray:
    """Which rows fit their targets. ``residual``: (R,) weighted residual norms; ``target``:
    (R, m) float64 targets; ``sqrt_w``: (R, m) square roots of the weights, or None;
    ``absolute``: the weights come from ``sigma`` (the chi-square test)."""
    m = target.shape[1]
    if absolute:
        return np.asarray(residual**2 <= chi2_quantile(m - k))
    wt = target if sqrt_w is None else sqrt_w * target
    target_norm = np.linalg.norm(wt, axis=1)
    weight_norm = np.full(len(target), math.sqrt(m)) if sqrt_w is None else \
        np.linalg.norm(sqrt_w, axis=1)
    return np.asarray(residual <= fit_tol * np.maximum(target_norm, weight_norm))
