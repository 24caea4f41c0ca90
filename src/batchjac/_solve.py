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

import enum
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from . import _backends
from ._autotune import time_modes, tune
from ._bind import BackendName, prepare
from ._config import autotune_enabled, default_max_memory, parse_bytes
from ._errors import BatchJacError, InputError, InputTypeError, add_context
from ._fit import CHI2_LEVEL, default_fit_tol, fitted
from ._plan import ModeArg, Plan, make_plan
from ._runner import call, pad_args
from ._spec import BatchSpec
from ._validate import DTypeLike, normalize, resolve_dtype, to_numpy

__all__ = ["IterationInfo", "SolveResult", "Status", "solve"]

Method = Literal["lm", "gn"]


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


_RUNNING = -100  # internal: still iterating
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

_ACCEPT_RHO = 1e-4  # minimum gain ratio for an LM step
_ARMIJO = 1e-4  # sufficient-decrease constant of the GN line search
_MU_MAX = 1e30  # LM damping beyond this: stalled
_MU_MIN = 1e-12  # LM damping floor (relative to Moré's scaling): keeps k > m systems solvable
_ALPHA_MIN = 2.0**-40  # GN line-search step below this: stalled
_MAX_NONFINITE = 30  # consecutive non-finite trial points before giving up
_MIN_BUCKET = 8  # smallest chunk kernel compiled for the tail of the active set
_BUCKET_FACTOR = 8  # ratio between successive chunk sizes


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
                             tune_modes=timed),
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


# -- the steps of solve() -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Data:
    """The arrays of one solve call, checked and converted; nothing here needed the model."""

    targets: np.ndarray  # (N, *output_shape) as given
    known: np.ndarray | None  # (N, h) as given
    k: int  # unknowns per instance
    dtype: np.dtype  # compute dtype
    tols: tuple[float, float, float]  # xtol, ftol, gtol
    lo: np.ndarray  # (N, k) float64 bounds as given (±inf: none)
    hi: np.ndarray
    lo_c: np.ndarray  # the bounds rounded inwards to the compute dtype
    hi_c: np.ndarray
    x0: np.ndarray  # (N, k) float64 starts, representable in the compute dtype, inside the box
    valid: np.ndarray  # (N,) bool: finite targets and known inputs, the instances solved

    @property
    def n(self) -> int:
        return int(self.targets.shape[0])


def _read_data(targets: Any, known: Any, x0: Any, bounds: Any, *, n_unknowns: int | None,
               dtype: DTypeLike, xtol: float | None, ftol: float | None, gtol: float | None
               ) -> _Data:
    """Check and convert the targets, known inputs, starts, bounds, dtype and tolerances."""
    t_arr = to_numpy(targets, "targets")
    n = t_arr.shape[0]
    h_arr = None if known is None else _known_rows(to_numpy(known, "known"), n)
    x0_arr = None if x0 is None else to_numpy(x0, "x0")
    k = _n_unknowns(x0_arr, bounds, n_unknowns, n)
    dt = resolve_dtype(dtype, [a for a, raw in ((t_arr, targets), (h_arr, known), (x0_arr, x0))
                               if a is not None and not isinstance(raw, (list, tuple))])
    tols = _tolerances(dt, xtol=xtol, ftol=ftol, gtol=gtol)
    lo, hi, lo_c, hi_c = _box(bounds, n, k, dt)
    x0_full = _start_points(x0_arr, lo, hi, n, k)
    x0_full = np.clip(x0_full.astype(dt).astype(np.float64), lo_c, hi_c)
    return _Data(targets=t_arr, known=h_arr, k=k, dtype=dt, tols=tols, lo=lo, hi=hi, lo_c=lo_c,
                 hi_c=hi_c, x0=x0_full, valid=_solvable(t_arr, h_arr))


def _known_rows(h_arr: np.ndarray, n: int) -> np.ndarray:
    """``known``, checked to be one row of known inputs per instance."""
    if h_arr.ndim != 2:
        raise InputError(f"`known` must be (N, h), one row of known inputs per instance; got "
                         f"shape {h_arr.shape}.")
    if h_arr.shape[0] != n:
        raise InputError(f"`known` has {h_arr.shape[0]} rows but `targets` has {n}; they must "
                         f"have one row per instance.")
    return h_arr


def _box(bounds: Any, n: int, k: int, dt: np.dtype
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The bounds as given, (N, k) float64, and rounded inwards to the compute dtype."""
    lo, hi = _bounds(bounds, n, k)
    lo_c, hi_c = _inward(lo, dt), _inward(hi, dt, up=False)
    if np.any(lo_c > hi_c):
        i, j = np.argwhere(lo_c > hi_c)[0]
        raise InputError(f"`bounds` for instance {i}, unknown {j} ([{lo[i, j]}, {hi[i, j]}]) are "
                         f"closer than {dt} can resolve; widen them or use dtype='float64'.")
    return lo, hi, lo_c, hi_c


def _solvable(t_arr: np.ndarray, h_arr: np.ndarray | None) -> np.ndarray:
    """Which instances can be solved: finite targets and known inputs."""
    n = t_arr.shape[0]
    t_rows = t_arr.reshape(n, int(np.prod(t_arr.shape[1:], dtype=np.int64)))
    valid = np.isfinite(t_rows).all(axis=1) if t_arr.dtype.kind == "f" else np.ones(n, bool)
    if h_arr is not None and h_arr.dtype.kind == "f":
        valid &= np.isfinite(h_arr).all(axis=1)
    return valid


@dataclass(frozen=True)
class _Model:
    """The model bound to the call's inputs (unknowns, then the known inputs)."""

    backend: str
    bound: Any
    spec: BatchSpec
    output_shape: tuple[int, ...]  # of one instance
    m: int  # flattened output size


def _bind_model(model: Any, data: _Data, backend: BackendName | None,
                backend_options: dict[str, Any] | None) -> _Model:
    """Bind the model (cached) and learn its output shape, which the targets must have; the
    probes use valid rows."""
    dt, h_arr = data.dtype, data.known
    inputs = (data.x0.astype(dt),) if h_arr is None else (data.x0.astype(dt), h_arr)
    spec = normalize(inputs, wrt=None, dtype=dt, nan_policy="propagate")
    name = backend or _backends.detect(model)
    try:
        bound = prepare(model, spec, name, backend_options or {})
    except BatchJacError as e:
        raise add_context(e, f"backend={name}; solve: x {data.x0.shape}, known "
                             f"{None if h_arr is None else h_arr.shape}; dtype {dt}") from e
    assert bound.output_shape is not None
    out_shape = bound.output_shape
    m = int(np.prod(out_shape, dtype=np.int64))
    t_shape, n = data.targets.shape, data.n
    if t_shape[1:] != out_shape:
        raise InputError(
            f"`targets` has shape {t_shape}, but the model's output for one instance has "
            f"shape {out_shape}; targets must be (N, *output_shape) = {(n, *out_shape)}."
        )
    return _Model(backend=name, bound=bound, spec=spec, output_shape=out_shape, m=m)


def _solve_plan(fitted: _Model, data: _Data, n_starts: int, *, mode: ModeArg,
                chunk_size: int | None, max_memory: int | str | None, reproducible: bool
                ) -> tuple[Plan, bool]:
    """The kernels' mode and chunk size, and whether each chunk size's mode is timed."""
    rows_total = data.n * n_starts
    budget = default_max_memory() if max_memory is None else parse_bytes(max_memory)
    plan = make_plan(n=max(rows_total, 1), k=data.k, m=fitted.m, in_elems=data.k + (
                     0 if data.known is None else data.known.shape[1]), dtype=data.dtype,
                     mode=mode, chunk_size=chunk_size, max_memory=budget)
    timed = plan.uncertain and not reproducible and autotune_enabled()
    if timed and rows_total:
        plan = tune(fitted.bound, fitted.spec, plan, True)
    return plan, timed


def _drawn_starts(data: _Data, n_starts: int, seed: int | None) -> np.ndarray | None:
    """The start of every (instance, start) row, ``x0`` for start 0; None for one start.
    Drawn up front: the same starts whatever the chunk size (or a resume)."""
    if n_starts == 1:
        return None
    n, dt = data.n, data.dtype
    rows_i, rows_s = np.repeat(np.arange(n), n_starts), np.tile(np.arange(n_starts), n)
    drawn = _random_starts(data.x0[rows_i], data.lo[rows_i], data.hi[rows_i], rows_s,
                           np.random.default_rng(seed))
    return np.clip(drawn.astype(dt).astype(np.float64), data.lo_c[rows_i], data.hi_c[rows_i])


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


def _best_start(cost: np.ndarray, status: np.ndarray) -> np.ndarray:
    """Per instance (a row of the (N, n_starts) inputs), the start to keep: the lowest finite
    cost; among equal costs, a converged one."""
    key = np.where(np.isfinite(cost), cost, np.inf)
    best_cost = key.min(axis=1, keepdims=True, initial=np.inf)
    lowest = key <= best_cost + 1e-9 * np.abs(best_cost) + 1e-300  # equal up to rounding
    return np.argmax(lowest * (1 + (status > 0)), axis=1)


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


# -- validation -------------------------------------------------------------------------------
def _count(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InputError(f"`{name}` must be an integer >= {minimum}; got {value!r}.")
    return int(value)


def _fit_tol(value: float | None, dt: np.dtype) -> float:
    if value is None:
        return default_fit_tol(dt)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not np.isfinite(value) or value <= 0:
        raise InputError(f"`fit_tol` must be a finite number > 0 (the relative residual a fitted "
                         f"instance may keep, e.g. 1e-3); got {value!r}.")
    return float(value)


def _tolerances(dt: np.dtype, **given: float | None) -> tuple[float, float, float]:
    default = 1e-8 if dt == np.float64 else 1e-6
    out = []
    for name in ("xtol", "ftol", "gtol"):
        v = given[name]
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                or not np.isfinite(v) or v < 0:
            raise InputError(f"`{name}` must be a finite number >= 0; got {v!r}.")
        out.append(float(v))
    return out[0], out[1], out[2]


def _n_unknowns(x0: np.ndarray | None, bounds: Any, n_unknowns: int | None, n: int) -> int:
    if x0 is not None:
        if x0.ndim == 2 and x0.shape[0] == n:
            k = x0.shape[1]
        elif x0.ndim == 1:
            k = x0.shape[0]
        else:
            raise InputError(f"`x0` must be (N, k) = ({n}, k) or (k,); got shape {x0.shape}.")
        if n_unknowns is not None and n_unknowns != k:
            raise InputError(f"`n_unknowns={n_unknowns}` but `x0` has {k} unknowns per instance.")
        if k == 0:
            raise InputError("`x0` has no unknown columns; give at least one unknown per instance.")
        return k
    if n_unknowns is not None:
        return _count(n_unknowns, "n_unknowns", minimum=1)
    if isinstance(bounds, (tuple, list)) and len(bounds) == 2:
        for b in bounds:
            if b is not None and np.ndim(b) >= 1:
                return int(np.shape(b)[-1])
    raise InputError(
        "solve() cannot tell how many unknowns the model takes: pass x0 with shape (N, k) or "
        "(k,), n_unknowns=k, or per-unknown bounds of shape (k,)."
    )


def _float_array(value: Any, what: str) -> np.ndarray:
    """A scalar, nested list, numpy array or framework tensor as a float64 array."""
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return np.asarray(value, np.float64)
    arr = to_numpy(value, what) if np.ndim(value) else np.asarray(value)
    if arr.dtype.kind not in "fiu":
        raise InputTypeError(f"{what} must hold real numbers; got dtype {arr.dtype}.")
    return arr.astype(np.float64)


def _bounds(bounds: Any, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    if bounds is None:
        return np.full((n, k), -np.inf), np.full((n, k), np.inf)
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise InputError(f"`bounds` must be a pair (lower, upper); got {type(bounds).__name__}. "
                         f"Each side is a scalar, shape ({k},) or ({n}, {k}); None or ±inf means "
                         f"unbounded.")
    out = []
    for side, b, fill in (("lower", bounds[0], -np.inf), ("upper", bounds[1], np.inf)):
        arr = np.full((n, k), fill) if b is None else _float_array(b, f"the {side} bound")
        if arr.shape not in ((), (k,), (n, k)):
            raise InputError(f"The {side} bound has shape {arr.shape}; it must be a scalar, ({k},) "
                             f"or ({n}, {k}).")
        if np.isnan(arr).any():
            raise InputError(f"The {side} bound contains NaN; use -inf/inf for no bound.")
        out.append(np.broadcast_to(arr, (n, k)))
    lo, hi = out
    bad = lo >= hi
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise InputError(
            f"`bounds`: lower >= upper for instance {i}, unknown {j} ({lo[i, j]} >= {hi[i, j]}); "
            f"{int(bad.sum())} pair(s) in all. Each lower bound must be strictly below its upper "
            f"bound (to fix an unknown, pass it in `known` instead)."
        )
    return lo, hi


def _inward(b: np.ndarray, dt: np.dtype, up: bool = True) -> np.ndarray:
    """Bounds as float64 values representable in ``dt``, rounded towards the inside."""
    c = b.astype(dt)
    if up:
        c = np.where(c.astype(np.float64) < b, np.nextafter(c, dt.type(np.inf)), c)
    else:
        c = np.where(c.astype(np.float64) > b, np.nextafter(c, dt.type(-np.inf)), c)
    return c.astype(np.float64)


def _start_points(x0: np.ndarray | None, lo: np.ndarray, hi: np.ndarray, n: int, k: int
                  ) -> np.ndarray:
    if x0 is None:
        both = np.isfinite(lo) & np.isfinite(hi)
        mid = np.where(both, 0.5 * (np.where(both, lo, 0.0) + np.where(both, hi, 0.0)), 0.0)
        return np.clip(mid, lo, hi)
    x = np.broadcast_to(np.asarray(x0, np.float64), (n, k))
    if not np.isfinite(x).all():
        i = int(np.argwhere(~np.isfinite(x))[0][0])
        raise InputError(f"`x0` has a non-finite value in row {i}: {x[i]}. Give finite starts "
                         f"(or leave x0=None).")
    out = (x < lo) | (x > hi)
    if out.any():
        i, j = np.argwhere(out)[0]
        raise InputError(
            f"`x0` is outside the bounds for instance {i}, unknown {j}: {x[i, j]} not in "
            f"[{lo[i, j]}, {hi[i, j]}] ({int(out.any(axis=1).sum())} instance(s) in all). "
            f"Start inside the box, e.g. x0=np.clip(x0, lower, upper)."
        )
    return x.copy()


def _random_starts(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, start: np.ndarray,
                   rng: np.random.Generator) -> np.ndarray:
    finite = np.isfinite(lo) & np.isfinite(hi)
    uniform = rng.uniform(np.where(finite, lo, 0.0), np.where(finite, hi, 1.0))
    normal = x + np.maximum(1.0, np.abs(x)) * rng.standard_normal(x.shape)
    drawn = np.clip(np.where(finite, uniform, normal), lo, hi)
    return np.where((start > 0)[:, None], drawn, x)


def _weights(weights: Any, sigma: Any, n: int, out_shape: tuple[int, ...]
             ) -> tuple[np.ndarray | None, bool]:
    """sqrt of the weights as (1 or N, m), and whether they are absolute (from sigma)."""
    if weights is not None and sigma is not None:
        raise InputError("Give `weights` or `sigma` (standard deviations), not both.")
    if weights is None and sigma is None:
        return None, False
    name = "weights" if weights is not None else "sigma"
    arr = _float_array(weights if weights is not None else sigma, f"`{name}`")
    m = int(np.prod(out_shape, dtype=np.int64))
    if arr.shape == () or arr.shape == out_shape:
        arr = np.broadcast_to(arr, out_shape).reshape(1, m)
    elif arr.shape == (n, *out_shape):
        arr = arr.reshape(n, m)
    else:
        raise InputError(f"`{name}` has shape {arr.shape}; it must be a scalar, the output shape "
                         f"{out_shape} or ({n}, *{out_shape}).")
    if not np.isfinite(arr).all():
        raise InputError(f"`{name}` contains NaN/Inf; give finite values (a zero weight drops an "
                         f"output).")
    if weights is not None:
        if (arr < 0).any():
            raise InputError(f"`weights` must be >= 0; found {arr.min()}.")
        return np.sqrt(arr), False
    if (arr <= 0).any():
        raise InputError(f"`sigma` (standard deviations) must be > 0; found {arr.min()}.")
    return 1.0 / arr, True


# -- evaluation ---------------------------------------------------------------------------------
#: measured compile time of a chunk kernel, per bound model (for the bucket heuristic)
_compile_seconds: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
#: seconds spent on padded rows so far, per bound model: kept across solve() calls, so a
#: session that solves batch after batch compiles the smaller chunk once it has paid for it
_waste: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


class _Evaluator:
    """``(y, J)`` for any number of rows through a few fixed chunk sizes.

    The full chunk size is compiled first; sizes ``chunk/8``, ``chunk/64``, ... serve a shrinking
    active set. A smaller size is compiled only when the time already spent on padded rows
    (by this model, over all solve calls) exceeds the measured cost of one compilation (ski
    rental: never more than twice the best choice in hindsight), unless the bound model has
    it already; a backend whose kernels cost no compilation (PyTorch) uses the smallest size
    that holds the active set at once. With ``adaptive=False`` that smallest size is always
    used too (compiled when first needed): the sizes then depend on the instances alone.
    """

    def __init__(self, bound: Any, mode: Any, chunk_size: int, adaptive: bool = True,
                 tune_modes: bool = False) -> None:
        self.bound, self.mode, self.adaptive, self.tune_modes = bound, mode, adaptive, tune_modes
        sizes = [chunk_size]
        while sizes[-1] // _BUCKET_FACTOR >= _MIN_BUCKET:
            sizes.append(sizes[-1] // _BUCKET_FACTOR)
        self.sizes = sizes  # descending
        #: the mode of each size's kernel: the plan's for the full size; with ``tune_modes``
        #: (the cost model could not tell the modes apart) each smaller size is timed in both
        #: when first used, since the faster mode can change with the rows (PyTorch's forward
        #: mode costs ~1 ms a call in Python however small the chunk, its reverse mode ~0.4 ms)
        self.modes: dict[int, Any] = {chunk_size: mode}
        self.compiled = {s for s in sizes if self._exists(s)}
        self.calls = 0
        self.seconds = 0.0

    def _known_mode(self, size: int) -> Any:
        """The mode for ``size``, or None while it still has to be timed."""
        if size in self.modes:
            return self.modes[size]
        if not self.tune_modes:
            return self.mode
        tuned = self.bound.tuned.get((size, True))
        return None if tuned is None else tuned[0]

    def _exists(self, size: int) -> bool:
        mode = self._known_mode(size)
        return mode is not None and self.bound.has_kernel(mode, size, True)

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        rows = u.shape[0]
        full = self.sizes[0]
        if rows >= full:
            parts = [self._run(full, u[lo:lo + full], tuple(c[lo:lo + full] for c in ctx))
                     for lo in range(0, rows, full)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        ideal = min(s for s in self.sizes if s >= rows)
        if not self.adaptive or not self.bound.compiles_kernels:
            return self._run(ideal, u, ctx)
        usable = min(s for s in self.sizes if s >= rows and (s in self.compiled or s == full))
        waste = _waste.get(self.bound, 0.0)
        if usable != ideal and waste >= _compile_seconds.get(self.bound, 0.25):
            usable, waste = ideal, 0.0
        start = time.perf_counter()
        y, jac = self._run(usable, u, ctx)
        if usable != ideal:
            waste += (time.perf_counter() - start) * (1.0 - ideal / usable)
        _waste[self.bound] = waste
        return y, jac

    def _run(self, size: int, u: np.ndarray, ctx: tuple[np.ndarray, ...]
             ) -> tuple[np.ndarray, np.ndarray]:
        rows = u.shape[0]
        new = size not in self.compiled and not self._exists(size)
        start = time.perf_counter()
        u_pad, ctx_pad = pad_args(u, ctx, size)
        mode = self._known_mode(size)
        if mode is None:
            mode = time_modes(self.bound, u_pad, ctx_pad, True, self.mode)[0]
        self.modes[size] = mode
        # not adaptive: the first build, no timing-based choice of implementation either
        kernel = self.bound.kernel(mode, size, True,
                                   variant=None if self.adaptive else _backends.FIRST_VARIANT)
        out = call(kernel, u_pad, ctx_pad, f"a solver step ({rows} active instances)", rows=rows,
                   zero_check=False)  # a zero Jacobian stalls its instance: the status says so
        y, jac = out["outputs"], out["jacobians"]
        elapsed = time.perf_counter() - start
        if new:
            _compile_seconds[self.bound] = elapsed
        self.compiled.add(size)
        self.calls += 1
        self.seconds += elapsed
        y2 = np.asarray(y, np.float64).reshape(rows, -1)
        return y2, np.asarray(jac, np.float64).reshape(rows, y2.shape[1], -1)


# -- the iterations -----------------------------------------------------------------------------
@dataclass
class _Problem:
    x0: np.ndarray  # (R, k) float64, representable in the compute dtype, inside the bounds
    lo: np.ndarray  # (R, k) inward-rounded bounds
    hi: np.ndarray
    target: np.ndarray  # (R, m) float64
    sqrt_w: np.ndarray | None  # (R, m) or None
    ctx: tuple[np.ndarray, ...]  # known inputs, (R, ...)
    instance: np.ndarray  # (R,) for the callback
    start: np.ndarray


@dataclass
class _Outcome:
    x: np.ndarray
    cost: np.ndarray
    status: np.ndarray
    iterations: np.ndarray
    jac: np.ndarray  # (R, m, k) model Jacobian at x (compute dtype)
    gram: np.ndarray  # (R, k, k) JᵀWJ at x


def _iterate(p: _Problem, evaluate: _Evaluator, dt: np.dtype, *, method: str, max_iter: int,
             tols: tuple[float, float, float], callback: Callable[[IterationInfo], None] | None
             ) -> _Outcome:
    gn = method == "gn"
    s = _State.start(p, dt)
    _first_point(p, s, _evaluate(p, evaluate, dt, callback, np.arange(len(s.x)), s.x, 0), tols[2])
    for it in range(1, max_iter + 1):
        act = np.flatnonzero(s.status == _RUNNING)
        if act.size == 0:
            break
        trial = _propose(p, s, act, dt, gn=gn)
        ev = _evaluate(p, evaluate, dt, callback, act, trial.x, it)
        s.iters[act] += 1
        verdict = _judge(s, trial, ev, gn=gn)
        _take_step(s, trial, ev, verdict, gn=gn)
        s.status[act] = _new_status(p, s, trial, ev, verdict, tols, gn=gn)
    s.status[s.status == _RUNNING] = Status.MAX_ITER
    rows, k = p.x0.shape
    return _Outcome(x=s.x, cost=s.cost, status=s.status.astype(np.int8), iterations=s.iters,
                    jac=s.jac.reshape(rows, -1, k), gram=s.jtj)


@dataclass(frozen=True)
class _Eval:
    """The model at some points: raw Jacobian, weighted residual and Jacobian, cost."""

    jac: np.ndarray  # (A, m, k) model Jacobian (compute dtype)
    r: np.ndarray  # (A, m) sqrt(w) (y - target)
    jw: np.ndarray  # (A, m, k) sqrt(w) J
    cost: np.ndarray  # (A,) 0.5 |r|^2, inf where the model returned NaN/Inf
    finite: np.ndarray  # (A,) bool: outputs and Jacobian finite


@dataclass
class _State:
    """Every row's current point with what the next step needs from it, the damping (LM) or
    line search (GN), and the row's status."""

    x: np.ndarray  # (R, k) current points
    status: np.ndarray  # (R,) _RUNNING until a Status is reached
    iters: np.ndarray  # (R,) trial steps taken
    jac: np.ndarray  # (R, m, k) model Jacobian at x (compute dtype)
    jtj: np.ndarray  # (R, k, k) JᵀWJ at x
    grad: np.ndarray  # (R, k) JᵀWr at x
    colnorm: np.ndarray  # (R, k) column norms of sqrt(W) J at x
    cost: np.ndarray  # (R,) cost at x
    scale: np.ndarray  # (R, k) Moré's D
    mu: np.ndarray  # (R,) LM damping
    nu: np.ndarray  # (R,) LM: factor for mu after a rejected step
    alpha: np.ndarray  # (R,) GN line-search step
    direction: np.ndarray  # (R, k) GN direction
    fresh: np.ndarray  # (R,) GN: the direction must be recomputed
    nonfinite_run: np.ndarray  # (R,) consecutive non-finite trial points

    @classmethod
    def start(cls, p: _Problem, dt: np.dtype) -> _State:
        rows, k = p.x0.shape
        return cls(
            x=p.x0.copy(),
            status=np.full(rows, _RUNNING, np.int64),
            iters=np.zeros(rows, np.int64),
            jac=np.full((rows, p.target.shape[1], k), np.nan, dt),
            jtj=np.zeros((rows, k, k)),
            grad=np.zeros((rows, k)),
            colnorm=np.zeros((rows, k)),
            cost=np.full(rows, np.inf),
            scale=np.zeros((rows, k)),
            mu=np.full(rows, 1e-3),
            nu=np.full(rows, 2.0),
            alpha=np.ones(rows),
            direction=np.zeros((rows, k)),
            fresh=np.ones(rows, bool),
            nonfinite_run=np.zeros(rows, np.int64),
        )

    def store(self, idx: np.ndarray, jac: np.ndarray, r: np.ndarray, jw: np.ndarray,
              c: np.ndarray) -> None:
        """Rows ``idx`` take the Jacobian, gradient and cost of their newly accepted points."""
        at: Any = slice(None) if idx.size == len(self.x) else idx  # every row: no gather/scatter
        self.jac[at] = jac
        # JᵀJ from a contiguous copy of Jᵀ: ~3x faster than matmul on the transposed view
        a = np.matmul(np.ascontiguousarray(jw.transpose(0, 2, 1)), jw)
        self.jtj[at] = a
        self.grad[at] = np.matmul(r[:, None, :], jw)[:, 0]
        diag = np.einsum("ikk->ik", a)
        self.colnorm[at] = np.sqrt(diag)
        self.scale[at] = np.maximum(self.scale[at], diag)
        self.cost[at] = c

    def store_some(self, idx: np.ndarray, keep: np.ndarray, ev: _Eval) -> None:
        """:meth:`store` the rows of ``ev`` (evaluated at rows ``idx``) where ``keep``."""
        if keep.all():  # the usual case: no copies of the kept rows
            self.store(idx, ev.jac, ev.r, ev.jw, ev.cost)
        else:
            self.store(idx[keep], ev.jac[keep], ev.r[keep], ev.jw[keep], ev.cost[keep])


@dataclass(frozen=True)
class _Trial:
    """A trial step of the active rows."""

    act: np.ndarray  # (A,) the rows taking it
    x: np.ndarray  # (A, k) trial points: representable in the compute dtype, inside the box
    step: np.ndarray  # (A, k) trial point minus current point
    pred: np.ndarray  # (A,) cost reduction the linear model predicts
    g: np.ndarray  # (A, k) gradient at the current points


@dataclass(frozen=True)
class _Verdict:
    """Which trial points are accepted, and the cost reductions that decided it."""

    accept: np.ndarray  # (A,) bool
    old_cost: np.ndarray  # (A,) cost at the current points
    ared: np.ndarray  # (A,) actual cost reduction
    rho: np.ndarray | None  # (A,) LM gain ratio (None for GN)


def _evaluate(p: _Problem, evaluate: _Evaluator, dt: np.dtype,
              callback: Callable[[IterationInfo], None] | None, idx: np.ndarray, x: np.ndarray,
              it: int) -> _Eval:
    """The model at points ``x`` of rows ``idx`` (one batched call), reported to ``callback``."""
    xc = x.astype(dt)
    y, jac = evaluate(xc, tuple(c[idx] for c in p.ctx))
    finite = np.isfinite(y).all(axis=1) & np.isfinite(jac).all(axis=(1, 2))
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf rows are rejected below
        r, jw = _weighted(p, idx, y, jac)
        cost = np.where(finite, 0.5 * np.einsum("ij,ij->i", r, r), np.inf)
    if callback is not None:
        callback(IterationInfo(iteration=it, instance=p.instance[idx], start=p.start[idx],
                               x=xc, cost=cost))
    return _Eval(jac=jac, r=r, jw=jw, cost=cost, finite=finite)


def _weighted(p: _Problem, idx: np.ndarray, y: np.ndarray, jac: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    r = y - p.target[idx]
    if p.sqrt_w is not None:
        r = r * p.sqrt_w[idx]
        jac = jac * p.sqrt_w[idx][:, :, None]
    return r, jac


def _first_point(p: _Problem, s: _State, ev: _Eval, gtol: float) -> None:
    """Take the starting points: non-finite there stops a row; one may be converged already."""
    idx = np.arange(len(s.x))
    s.status[~ev.finite] = Status.NON_FINITE
    ok = idx[ev.finite]
    s.store_some(idx, ev.finite, ev)
    conv, flat = _gtol_test(s.x[ok], p.lo[ok], p.hi[ok], s.grad[ok], s.colnorm[ok], s.cost[ok],
                            gtol)
    s.status[ok[conv]] = Status.GTOL
    s.status[ok[flat]] = Status.STALLED


def _propose(p: _Problem, s: _State, act: np.ndarray, dt: np.dtype, *, gn: bool) -> _Trial:
    """The trial step of rows ``act``: damped (LM) or line-searched (GN), unknowns held at a
    bound frozen, the trial point clipped into the box."""
    xa, lo, hi, g, a = s.x[act], p.lo[act], p.hi[act], s.grad[act], s.jtj[act]
    free = ~(((xa <= lo) & (g > 0)) | ((xa >= hi) & (g < 0)))
    if gn:
        need = s.fresh[act]
        if need.any():
            s.direction[act[need]] = _gn_direction(a[need], g[need], free[need], dt)
            s.fresh[act[need]] = False
            s.alpha[act[need]] = 1.0
        h = s.alpha[act, None] * s.direction[act]
    else:
        d = np.maximum(s.scale[act], 1e-12 * s.scale[act].max(axis=1, keepdims=True) + 1e-300)
        h = _lm_step(a, g, s.mu[act, None] * d, free)
    xt = np.clip(xa + h, lo, hi)
    xt = np.clip(xt.astype(dt).astype(np.float64), lo, hi)  # representable, still inside
    step = xt - xa
    pred = -(np.einsum("ik,ik->i", g, step) +
             0.5 * np.einsum("ik,ikl,il->i", step, a, step))
    return _Trial(act=act, x=xt, step=step, pred=pred, g=g)


def _judge(s: _State, t: _Trial, ev: _Eval, *, gn: bool) -> _Verdict:
    """Accept a trial point on Armijo's condition (GN) or a gain ratio above 1e-4 (LM)."""
    act = t.act
    ared = s.cost[act] - ev.cost
    rho = None
    if gn:
        accept = ev.finite & (ev.cost <= s.cost[act] + _ARMIJO * np.einsum("ik,ik->i", t.g, t.step)) \
            & (ared >= 0) & (np.abs(t.step).max(axis=1) > 0)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = np.where(t.pred > 0, ared / t.pred, -np.inf)
        accept = ev.finite & (rho > _ACCEPT_RHO)
    return _Verdict(accept=accept, old_cost=s.cost[act].copy(), ared=ared, rho=rho)


def _take_step(s: _State, t: _Trial, ev: _Eval, v: _Verdict, *, gn: bool) -> None:
    """Move the accepted rows to their trial points; update every row's line search (GN) or
    damping (LM, Nielsen's rule)."""
    act, accept = t.act, v.accept
    acc = act[accept]
    s.store_some(act, accept, ev)
    s.x[acc] = t.x[accept]
    s.nonfinite_run[act] = np.where(ev.finite, 0, s.nonfinite_run[act] + 1)
    if gn:
        s.fresh[acc] = True
        rej = act[~accept]
        s.alpha[rej] *= np.where(ev.finite[~accept], 0.5, 0.25)
    else:
        assert v.rho is not None
        rho_acc = v.rho[accept]
        s.mu[acc] = np.maximum(s.mu[acc] * np.maximum(1 / 3, 1 - (2 * rho_acc - 1) ** 3), _MU_MIN)
        s.nu[acc] = 2.0
        rej = act[~accept]
        s.mu[rej] *= s.nu[rej]
        s.nu[rej] *= 2.0


def _new_status(p: _Problem, s: _State, t: _Trial, ev: _Eval, v: _Verdict,
                tols: tuple[float, float, float], *, gn: bool) -> np.ndarray:
    """The status of rows ``t.act`` after their step: the per-instance convergence tests in
    order of precedence, then the reasons to give up; ``_RUNNING`` for the rows that go on."""
    xtol, ftol, gtol = tols
    act, accept, finite = t.act, v.accept, ev.finite
    acc = act[accept]
    snorm = np.linalg.norm(t.step, axis=1)
    xnorm = np.linalg.norm(t.x, axis=1)
    small_step = finite & (snorm < xtol * (xtol + xnorm))
    small_f = accept & (np.abs(v.ared) <= ftol * v.old_cost) & (t.pred <= ftol * v.old_cost)
    g_ok = np.zeros(act.size, bool)
    g_flat = np.zeros(act.size, bool)
    if acc.size:
        g_ok[accept], g_flat[accept] = _gtol_test(s.x[acc], p.lo[acc], p.hi[acc], s.grad[acc],
                                                  s.colnorm[acc], s.cost[acc], gtol)
    new = np.full(act.size, _RUNNING, np.int64)
    new[small_step] = Status.XTOL
    new[small_f] = Status.FTOL
    new[g_ok] = Status.GTOL
    new[g_flat] = Status.STALLED
    still = new == _RUNNING
    stuck_nf = still & ~finite & ((s.nonfinite_run[act] >= _MAX_NONFINITE) |
                                  (snorm < xtol * (xtol + xnorm)))
    new[stuck_nf] = Status.NON_FINITE
    stalled = (new == _RUNNING) & ~accept & ((s.alpha[act] < _ALPHA_MIN) if gn
                                             else (s.mu[act] > _MU_MAX))
    new[stalled] = Status.STALLED
    return new


def _gtol_test(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, g: np.ndarray, colnorm: np.ndarray,
               cost: np.ndarray, gtol: float) -> tuple[np.ndarray, np.ndarray]:
    """MINPACK's scaled gradient test on the projected gradient: the largest cosine between the
    residual and a Jacobian column, over unknowns not held at a bound. Returns (converged,
    flat): a zero Jacobian with a nonzero residual is no convergence (nothing is known there)."""
    held = ((x <= lo) & (g > 0)) | ((x >= hi) & (g < 0))
    gp = np.where(held, 0.0, np.abs(g))
    rnorm = np.sqrt(2.0 * cost)
    denom = colnorm * rnorm[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = np.where(denom > 0, gp / denom, 0.0).max(axis=1)
    flat = (colnorm == 0).all(axis=1) & (rnorm > 0)
    return ((cosine <= gtol) | (rnorm == 0)) & ~flat, flat


def _lm_step(a: np.ndarray, g: np.ndarray, damp: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Solve ``(A + diag(damp)) h = -g`` over the free unknowns; held unknowns get ``h = 0``."""
    k = a.shape[1]
    both = free[:, :, None] & free[:, None, :]
    mat = np.where(both, a, 0.0)
    idx = np.arange(k)
    mat[:, idx, idx] += np.where(free, damp, 1.0)
    rhs = np.where(free, -g, 0.0)
    try:
        return np.linalg.solve(mat, rhs[:, :, None])[:, :, 0]
    except np.linalg.LinAlgError:  # numerically singular somewhere: pseudo-inverse for all
        return _pinv_solve(mat, rhs, 1e-14)


def _gn_direction(a: np.ndarray, g: np.ndarray, free: np.ndarray, dt: np.dtype) -> np.ndarray:
    """The minimum-norm Gauss-Newton step over the free unknowns."""
    both = free[:, :, None] & free[:, None, :]
    mat = np.where(both, a, 0.0)
    rhs = np.where(free, -g, 0.0)
    # singular values of J below max(m, k) * eps * s_max (numpy's matrix_rank rule) are noise
    rcond = (a.shape[1] * 8 * np.finfo(dt).eps) ** 2
    return _pinv_solve(mat, rhs, rcond)


def _pinv_solve(mat: np.ndarray, rhs: np.ndarray, rcond: float) -> np.ndarray:
    lam, vec = np.linalg.eigh(mat)
    cut = rcond * np.maximum(lam.max(axis=1, keepdims=True), 1e-300)
    inv = np.where(lam > cut, 1.0 / np.where(lam > cut, lam, 1.0), 0.0)
    coef = np.einsum("ikj,ik->ij", vec, rhs) * inv
    return np.einsum("ikj,ij->ik", vec, coef)


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
