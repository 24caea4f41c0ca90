"""Batched nonlinear least squares for the unknowns: Levenberg-Marquardt and Gauss-Newton.

For every instance ``i`` find ``x_i`` minimising ``0.5 * sum_j w_ij (f([x_i, h_i])_j - t_ij)^2``
within box bounds. Every instance has its own damping, its own step acceptance and its own
convergence tests; the instances still running are evaluated together, one batched model call
with its Jacobian per iteration, through the same compiled chunk kernels as
:func:`batchjac.jacobian`, so every backend works and nothing here imports a framework.

Algorithm (per instance, vectorised over the active instances):

- **Levenberg-Marquardt** (``method="lm"``): the step solves
  ``(JᵀWJ + mu D) h = -JᵀWr`` with Moré's scaling ``D = diag(max over iterations of
  diag(JᵀWJ))`` (invariant to the units of each unknown), and Nielsen's damping update
  (``mu *= max(1/3, 1 - (2 rho - 1)^3)`` after an accepted step, ``mu *= nu, nu *= 2`` after a
  rejected one). A trial point is accepted when the gain ratio ``rho`` (actual over predicted
  cost reduction) exceeds 1e-4.
- **Gauss-Newton** (``method="gn"``): the minimum-norm Gauss-Newton direction (pseudo-inverse
  of ``JᵀWJ``, small eigenvalues cut off), with a per-instance backtracking line search
  (Armijo condition, step halved on failure), so it does not diverge on the first bad step.
- **Bounds** are kept by projection with an active set (projected Levenberg-Marquardt, as in
  Kanzow, Yamashita & Fukushima 2004): an unknown sitting on a bound whose gradient pushes
  outwards is frozen for the step, the others take the damped step, and the trial point is
  clipped into the box. Projection rather than Coleman-Li's reflective scaling because it
  keeps every evaluated point inside the box *exactly* (``np.clip`` returns the bound itself),
  needs no interior start, and lets unknowns converge onto a bound in finitely many steps.
  Bounds are rounded inwards to the compute dtype, so a float32 evaluation point never lies
  outside the float64 bounds either.
- Trial points are evaluated with the kernel that returns ``(y, J)`` together: most trial
  steps are accepted, and an accepted point needs its Jacobian for the next step anyway, so
  one batched call per iteration beats a forward pass followed by a Jacobian pass.
- Instances stop costing compute once they stop: the active set is compacted every
  iteration and fed through the smallest already-compiled chunk size that holds it; a smaller
  chunk kernel is compiled once the time wasted on padding exceeds what a compilation costs
  (measured), so a long tail of slow instances does not keep the whole batch's cost.

Underdetermined problems (more unknowns than outputs) are solved by the damped equations as
well, and flagged ``rank_deficient``. The steps add nothing in directions the outputs do not
see, so the solution found is the one nearest to ``x0`` in a norm: for a linear model exactly
so, in the scaled norm ``||D^1/2 (x - x0)||`` for LM and the Euclidean norm for GN (whose
step is the pseudo-inverse one).

Instances are solved in blocks of one kernel chunk (all starts of an instance in the same
block), so memory stays bounded by the chunk size whatever N is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .._bind import BackendName
from .._errors import InputError
from .._fit import CHI2_LEVEL, fitted
from .._plan import ModeArg, Plan
from .._validate import DTypeLike
from .evaluator import _Evaluator
from .fit import _best_start, _rank_and_covariance
from .iterate import _iterate
from .problem import (
    _bind_model,
    _count,
    _Data,
    _drawn_starts,
    _fit_tol,
    _Model,
    _Problem,
    _read_data,
    _solve_plan,
    _weights,
)
from .result import IterationInfo, SolveResult, Status

__all__ = ["IterationInfo", "SolveResult", "Status", "solve"]

Method = Literal["lm", "gn"]


def solve(
    model: Any,
    targets: Any,
    known: Any = None,
    *,
    x0: Any = None,
    bounds: Any = None,
    method: Method = "lm",
    max_iter: int = 100,
    xtol: float | None = None,
    ftol: float | None = None,
    gtol: float | None = None,
    weights: Any = None,
    sigma: Any = None,
    n_starts: int = 1,
    seed: int | None = None,
    fit_tol: float | None = None,
    n_unknowns: int | None = None,
    return_jacobian: bool = False,
    return_covariance: bool = False,
    dtype: DTypeLike = None,
    mode: ModeArg = "auto",
    chunk_size: int | None = None,
    max_memory: int | str | None = None,
    backend: BackendName | None = None,
    backend_options: dict[str, Any] | None = None,
    callback: Callable[[IterationInfo], None] | None = None,
    reproducible: bool = False,
) -> SolveResult:
    """The in-memory solver behind :func:`batchjac.solve` (documented there): every instance of
    ``targets`` at once, the result in memory."""
    start_time = time.perf_counter()
    if method not in ("lm", "gn"):
        raise InputError(f"`method` must be 'lm' (Levenberg-Marquardt) or 'gn' (Gauss-Newton); "
                         f"got {method!r}.")
    max_iter = _count(max_iter, "max_iter", minimum=0)
    n_starts = _count(n_starts, "n_starts", minimum=1)
    data = _read_data(targets, known, x0, bounds, n_unknowns=n_unknowns, dtype=dtype,
                      xtol=xtol, ftol=ftol, gtol=gtol)
    fit_tol = _fit_tol(fit_tol, data.dtype)
    fitted = _bind_model(model, data, backend, backend_options)
    sqrt_w, absolute = _weights(weights, sigma, data.n, fitted.output_shape)
    plan, timed = _solve_plan(fitted, data, n_starts, mode=mode, chunk_size=chunk_size,
                              max_memory=max_memory, reproducible=reproducible)
    job = _Job(
        data=data, model=fitted, n_starts=n_starts, method=method, max_iter=max_iter,
        callback=callback,
        ctx=fitted.spec.chunk(0, data.n)[1],  # known inputs in the compute dtype
        evaluator=_Evaluator(fitted.bound, plan.mode, plan.chunk_size, adaptive=not reproducible,
                             tune_modes=timed, asked=mode != "auto"),
        target=data.targets.reshape(data.n, fitted.m).astype(np.float64),
        sqrt_w=sqrt_w, absolute=absolute, starts=_drawn_starts(data, n_starts, seed),
        fit_tol=fit_tol,
    )
    rows = _Rows.empty(data.n * n_starts, data.k, fitted.m, data.dtype, jacobian=return_jacobian,
                       covariance=return_covariance)
    block = max(1, plan.chunk_size // n_starts)  # instances per block, all their starts in it
    for lo_i in range(0, data.n, block):
        _solve_block(job, np.arange(lo_i, min(data.n, lo_i + block)), rows)
    return _result(job, rows, plan, start_time)



@dataclass(frozen=True)
class _Job:
    """What the blocks of one solve call share."""

    data: _Data
    model: _Model
    n_starts: int
    method: str
    max_iter: int
    callback: Callable[[IterationInfo], None] | None
    ctx: tuple[np.ndarray, ...]  # known inputs of every instance, in the compute dtype
    evaluator: _Evaluator
    target: np.ndarray  # (N, m) float64
    sqrt_w: np.ndarray | None  # (1 or N, m) square roots of the weights
    absolute: bool  # weights from sigma: the covariance is not scaled by the residual
    starts: np.ndarray | None  # (N * n_starts, k) every row's start; None for one start
    fit_tol: float  # the relative residual of a fit (without sigma): see _fit


@dataclass(frozen=True)
class _Rows:
    """Results per (instance, start) row ``instance * n_starts + start``; rows not solved keep
    NaN and ``INVALID_INPUT``."""

    x: np.ndarray  # (R, k)
    cost: np.ndarray  # (R,)
    status: np.ndarray  # (R,) int8
    iterations: np.ndarray  # (R,)
    rank: np.ndarray  # (R,)
    jac: np.ndarray | None  # (R, m, k) compute dtype, if asked for
    cov: np.ndarray | None  # (R, k, k), if asked for

    @classmethod
    def empty(cls, rows: int, k: int, m: int, dt: np.dtype, *, jacobian: bool, covariance: bool
              ) -> _Rows:
        return cls(
            x=np.full((rows, k), np.nan),
            cost=np.full(rows, np.nan),
            status=np.full(rows, int(Status.INVALID_INPUT), np.int8),
            iterations=np.zeros(rows, np.int64),
            rank=np.zeros(rows, np.int64),
            jac=np.full((rows, m, k), np.nan, dt) if jacobian else None,
            cov=np.full((rows, k, k), np.nan) if covariance else None,
        )


def _solve_block(job: _Job, inst: np.ndarray, rows: _Rows) -> None:
    """Solve every start of the valid instances among ``inst`` together, into ``rows``."""
    data, n_starts = job.data, job.n_starts
    inst = inst[data.valid[inst]]
    if inst.size == 0:
        return
    rows_inst = np.repeat(inst, n_starts)
    rows_start = np.tile(np.arange(n_starts), inst.size)
    dest = rows_inst * n_starts + rows_start
    xs = data.x0[rows_inst] if job.starts is None else job.starts[dest]
    sw = None if job.sqrt_w is None else np.broadcast_to(job.sqrt_w, (data.n, job.model.m))[rows_inst]
    problem = _Problem(
        x0=xs, lo=data.lo_c[rows_inst], hi=data.hi_c[rows_inst], target=job.target[rows_inst],
        sqrt_w=sw, ctx=tuple(c[rows_inst] for c in job.ctx), instance=rows_inst, start=rows_start,
    )
    out = _iterate(problem, job.evaluator, data.dtype, method=job.method, max_iter=job.max_iter,
                   tols=data.tols, callback=job.callback)
    # converged is not fitted: a local minimum of the cost converges as well as a fit does
    unfit = (out.status > 0) & ~fitted(np.sqrt(2.0 * out.cost), problem.target, sw, k=data.k,
                                       absolute=job.absolute, fit_tol=job.fit_tol)
    out.status[unfit] = Status.LOCAL_MINIMUM
    rows.x[dest], rows.cost[dest], rows.status[dest] = out.x, out.cost, out.status
    rows.iterations[dest] = out.iterations
    rows.rank[dest], cov = _rank_and_covariance(out.jac, out.gram, sw, data.dtype,
                                                absolute=job.absolute, cost=out.cost,
                                                want_cov=rows.cov is not None)
    if rows.jac is not None:
        rows.jac[dest] = out.jac
    if rows.cov is not None:
        rows.cov[dest] = cov


def _result(job: _Job, rows: _Rows, plan: Plan, start_time: float) -> SolveResult:
    """The best start of every instance, with what the call did in ``info``."""
    n, k, dt, tols = job.data.n, job.data.k, job.data.dtype, job.data.tols
    evaluator = job.evaluator
    best = _best_start(rows.cost.reshape(n, job.n_starts), rows.status.reshape(n, job.n_starts))
    pick = np.arange(n) * job.n_starts + best
    x = rows.x[pick]
    cost = rows.cost[pick]
    status = rows.status[pick]
    rank = rows.rank[pick]
    invalid = status == Status.INVALID_INPUT
    x_out = x.astype(dt)
    return SolveResult(
        x=x_out,
        residual=np.sqrt(2.0 * cost),
        cost=cost,
        success=status > 0,
        status=status,
        iterations=rows.iterations[pick],
        rank=rank,
        rank_deficient=(rank < k) & ~invalid,
        start=np.where(invalid, 0, best),
        jacobian=None if rows.jac is None else rows.jac[pick].reshape(n, *job.model.output_shape, k),
        covariance=None if rows.cov is None else rows.cov[pick],
        info={"method": job.method, "backend": job.model.backend, "dtype": str(dt),
              "mode": plan.mode, "chunk_size": plan.chunk_size, "xtol": tols[0], "ftol": tols[1],
              "gtol": tols[2], "max_iter": job.max_iter, "n_starts": job.n_starts,
              "fit_test": (f"chi2 <= its {CHI2_LEVEL:.1%} quantile (sigma given)" if job.absolute
                           else f"residual <= {job.fit_tol:g} * max(||sqrt(w) t||, sqrt(sum w))"),
              "fit_tol": job.fit_tol,
              "seconds": time.perf_counter() - start_time, "kernel_calls": evaluator.calls,
              "kernel_seconds": evaluator.seconds,
              "compiled_chunk_sizes": sorted(evaluator.compiled)},
    )
