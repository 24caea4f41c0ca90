"""What :func:`batchjac.solve` reports: the status codes, the per-instance results and what the
callback receives after each batched model evaluation."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class Status(enum.IntEnum):
    """Why the iterations of one instance stopped. ``success`` is ``status > 0``: the
    iterations converged *and* the residual passes the fit test of :mod:`batchjac._fit`
    (chi-square below its 99.9% quantile with ``sigma``, else ``||sqrt(w) r|| <= fit_tol *
    max(||sqrt(w) t||, sqrt(sum w))``). A converged instance that fails it is
    ``LOCAL_MINIMUM``.

    ====================  =====  ===============================================================
    name                  value  meaning
    ====================  =====  ===============================================================
    ``GTOL``                 1   converged: the (projected) gradient is orthogonal to the
                                 residual within ``gtol`` (MINPACK's cosine test), or the
                                 residual is exactly zero
    ``FTOL``                 2   converged: an accepted step changed the cost by less than
                                 ``ftol`` relative, and the linear model predicted no more
    ``XTOL``                 3   converged: the step was shorter than ``xtol * (xtol + |x|)``
    ``MAX_ITER``             0   not converged within ``max_iter`` trial steps
    ``INVALID_INPUT``       -1   NaN/Inf in this instance's targets or known inputs: not solved
    ``STALLED``             -2   no progress possible: the Jacobian is exactly zero while the
                                 residual is not (a saturated or dead model), or no acceptable
                                 step was found (damping beyond 1e30, or a line-search step
                                 below 2^-40) before ``xtol`` was met
    ``NON_FINITE``          -3   the model returned NaN/Inf at ``x0``, or at every trial point
                                 down to the ``xtol`` scale, or 30 times in a row
    ``LOCAL_MINIMUM``       -4   converged (on gtol, ftol or xtol) to a point whose residual
                                 fails the fit test: a local minimum of the cost, or targets
                                 the model cannot reach; ``n_starts > 1`` tries other starts
    ====================  =====  ===============================================================
    """

    MAX_ITER = 0
    GTOL = 1
    FTOL = 2
    XTOL = 3
    INVALID_INPUT = -1
    STALLED = -2
    NON_FINITE = -3
    LOCAL_MINIMUM = -4


_STATUS_TEXT = {
    Status.GTOL: "converged: gradient orthogonal to the residual (gtol)",
    Status.FTOL: "converged: relative cost reduction below ftol",
    Status.XTOL: "converged: step shorter than xtol",
    Status.MAX_ITER: "not converged: max_iter reached",
    Status.INVALID_INPUT: "not solved: NaN/Inf in the targets or known inputs",
    Status.STALLED: "not converged: zero Jacobian, or no acceptable step found",
    Status.NON_FINITE: "not converged: the model returned non-finite values",
    Status.LOCAL_MINIMUM: "converged, but the residual fails the fit test: a local minimum or "
                          "unreachable targets (n_starts > 1 tries other starts)",
}


@dataclass(frozen=True)
class IterationInfo:
    """What ``solve(..., callback=...)`` receives after each batched model evaluation."""

    iteration: int  #: 0 for the evaluation at the starting points
    instance: np.ndarray  #: (A,) instance index of each evaluated row
    start: np.ndarray  #: (A,) which of the ``n_starts`` starts each row is
    x: np.ndarray  #: (A, k) the points evaluated (compute dtype)
    cost: np.ndarray  #: (A,) their cost (inf where the model returned NaN/Inf)


@dataclass(frozen=True)
class SolveResult:
    """Per-instance results of :func:`solve`; every array has one row per instance. ``x``,
    ``jacobian`` and ``covariance`` are of the inputs' array kind, on their device (numpy for
    numpy inputs; see :func:`batchjac.solve`); the diagnostics are numpy."""

    x: Any  #: (N, k) the solution (compute dtype); NaN for invalid input
    #: (N,) the weighted residual *norm* ``||sqrt(w) (f(x) - targets)||_2`` (one number per
    #: instance, not the residual vector; ``residual.npy`` of a solve output holds the same)
    residual: np.ndarray
    cost: np.ndarray  #: (N,) ``0.5 * residual**2``
    #: (N,) bool, ``status > 0``: converged (on gtol, ftol or xtol) *and* fitted (the residual
    #: passes the fit test); converged but not fitted is ``Status.LOCAL_MINIMUM``
    success: np.ndarray
    status: np.ndarray  #: (N,) int8 :class:`Status` codes
    iterations: np.ndarray  #: (N,) trial steps taken (each one batched model evaluation)
    rank: np.ndarray  #: (N,) numerical rank of ``sqrt(W) J`` at ``x``
    rank_deficient: np.ndarray  #: (N,) bool, ``rank < k`` (always so when k > m)
    start: np.ndarray  #: (N,) index of the start that won (0 is ``x0``)
    jacobian: Any = None  #: (N, *output_shape, k), model Jacobian at ``x``
    covariance: Any = None  #: (N, k, k) Gauss-Newton covariance of ``x``
    info: dict[str, Any] = field(default_factory=dict)  #: method, tolerances, timings

    @property
    def status_names(self) -> np.ndarray:
        """``status`` as lower-case names: "gtol", "ftol", "xtol", "max_iter", ..."""
        names = np.array([s.name.lower() for s in Status])
        codes = np.array([s.value for s in Status])
        order = np.argsort(codes)
        return names[order[np.searchsorted(codes[order], self.status)]]

    def message(self, i: int) -> str:
        """A sentence on instance ``i``."""
        return _STATUS_TEXT[Status(int(self.status[i]))]

    @property
    def converged(self) -> np.ndarray:
        """(N,) bool: the iterations converged, whether or not the targets were fitted
        (``success`` or ``LOCAL_MINIMUM``)."""
        return np.asarray(self.success | (self.status == Status.LOCAL_MINIMUM))

    def summary(self) -> dict[str, int]:
        """How many instances ended with each status."""
        return {s.name.lower(): int((self.status == s.value).sum()) for s in Status
                if (self.status == s.value).any()}

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in self.summary().items())
        minima = int((self.status == Status.LOCAL_MINIMUM).sum())
        hint = (f"; {minima} converged without fitting the targets: try n_starts > 1"
                if minima and self.info.get("n_starts", 1) == 1 else "")
        return (f"SolveResult(n={len(self.x)}, k={self.x.shape[-1] if self.x.ndim > 1 else 0}, "
                f"success={int(self.success.sum())}, {counts}{hint})")
