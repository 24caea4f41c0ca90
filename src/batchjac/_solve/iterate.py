"""The iterations: Levenberg-Marquardt and Gauss-Newton steps with per-row damping or line
search, projection onto the bounds, acceptance and the convergence tests, over the rows of one
block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .evaluator import _Evaluator
from .problem import _Problem
from .result import IterationInfo, Status

_RUNNING = -100  # internal: still iterating

_ACCEPT_RHO = 1e-4  # minimum gain ratio for an LM step
_ARMIJO = 1e-4  # sufficient-decrease constant of the GN line search
_MU_MAX = 1e30  # LM damping beyond this: stalled
_MU_MIN = 1e-12  # LM damping floor (relative to Moré's scaling): keeps k > m systems solvable
_ALPHA_MIN = 2.0**-40  # GN line-search step below this: stalled
_MAX_NONFINITE = 30  # consecutive non-finite trial points before giving up


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
