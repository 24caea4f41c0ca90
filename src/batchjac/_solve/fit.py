"""What is known of the fit at the solution: which start fits best, the numerical rank of the
weighted Jacobian and the Gauss-Newton covariance."""

from __future__ import annotations

import numpy as np


def _best_start(cost: np.ndarray, status: np.ndarray) -> np.ndarray:
    """Per instance (a row of the (N, n_starts) inputs), the start to keep: the lowest finite
    cost; among equal costs, a converged one."""
    key = np.where(np.isfinite(cost), cost, np.inf)
    best_cost = key.min(axis=1, keepdims=True, initial=np.inf)
    lowest = key <= best_cost + 1e-9 * np.abs(best_cost) + 1e-300  # equal up to rounding
    return np.argmax(lowest * (1 + (status > 0)), axis=1)


def _rank_and_covariance(jac: np.ndarray, gram: np.ndarray, sqrt_w: np.ndarray | None,
                         dt: np.dtype, *, absolute: bool, cost: np.ndarray, want_cov: bool
                         ) -> tuple[np.ndarray, np.ndarray | None]:
    """Numerical rank of ``sqrt(W) J`` per row (numpy's matrix_rank rule: singular values above
    ``s_max * max(m, k) * eps`` of the compute dtype) and, if asked, the Gauss-Newton covariance
    ``s^2 (JᵀWJ)^-1``.

    The eigenvalues of the Gram matrix ``JᵀWJ`` (already at hand) settle well-conditioned rows
    cheaply; only rows whose conditioning the Gram matrix cannot resolve get an SVD of ``J``.
    """
    rows, m, k = jac.shape
    rank = np.zeros(rows, np.int64)
    cov = np.full((rows, k, k), np.nan) if want_cov else None
    ok = np.flatnonzero(np.isfinite(jac).all(axis=(1, 2)) & np.isfinite(cost))
    if ok.size == 0:
        return rank, cov
    lam = np.linalg.eigvalsh(gram[ok])  # ascending
    near = lam[:, 0] <= 1e-10 * lam[:, -1]  # cond(J) >= 1e5, or k > m: look closer
    rank[ok] = k
    inv = np.zeros((ok.size, k, k))
    full = ~near
    if want_cov and full.any():
        inv[full] = np.linalg.inv(gram[ok[full]])
    if near.any():
        jw = jac[ok[near]].astype(np.float64)
        if sqrt_w is not None:
            jw = jw * sqrt_w[ok[near]][:, :, None]
        _, s, vt = np.linalg.svd(jw, full_matrices=False)
        tol = s.max(axis=1, initial=0.0, keepdims=True) * max(m, k) * np.finfo(dt).eps
        r = (s > tol).sum(axis=1)
        rank[ok[near]] = r
        if want_cov and m >= k:
            with np.errstate(divide="ignore"):
                w = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0) ** 2, 0.0)
            inv[near] = np.einsum("ijk,ij,ijl->ikl", vt, w, vt)
            full[near] = r == k
    if cov is not None and m >= k:
        m_eff = np.full(ok.size, m) if sqrt_w is None else (sqrt_w[ok] > 0).sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            s2 = np.ones(ok.size) if absolute else 2.0 * cost[ok] / (m_eff - k)
        c = inv * s2[:, None, None]
        c[~(full & (absolute | (m_eff > k)))] = np.nan
        cov[ok] = c
    return rank, cov
