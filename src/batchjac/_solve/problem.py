"""The problem of one solve call: the arrays checked and converted, the model bound to them,
the kernels' plan, the starts and weights, and the rows one block iterates on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _backends
from .._bind import BackendName, prepare
from .._config import autotune_enabled, default_max_memory, parse_bytes
from .._errors import BatchJacError, InputError, InputTypeError, add_context
from .._fit import default_fit_tol
from .._plan import ModeArg, Plan, make_plan
from .._spec import BatchSpec
from .._tune.races import tune
from .._validate import DTypeLike, normalize, resolve_dtype, to_numpy


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



# -- the rows of one block ------------------------------------------------------------------
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
