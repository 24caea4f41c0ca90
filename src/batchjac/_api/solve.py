"""``batchjac.solve``: dispatch only, to the in-memory solver or to a resumable store."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from .._arrays import OutputArg, deliver, on_host
from .._bind import BackendName
from .._errors import InputError
from .._loaders import as_model
from .._plan import ModeArg
from .._solve import IterationInfo, Method, SolveResult, solve as _in_memory
from .._solve_store import SolveInputs, SolveStoreResult, solve_to_store
from .._stores import Store
from .._validate import DTypeLike


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
    out: str | os.PathLike[str] | Store | None = None,
    block_size: int | None = None,
    progress: bool | Callable[[int], None] = False,
    output: OutputArg = "auto",
) -> SolveResult | SolveStoreResult:
    """Find the unknowns ``x_i`` with ``model(concat([x_i, known_i])) ≈ targets_i``, per instance.

    Minimises ``0.5 * sum_j w_ij (f_j - targets_ij)^2`` for every instance independently, all
    instances at once, with exact Jacobians from the model's framework (any backend).

    - ``model`` takes ``concat([x, known], axis=-1)`` (the ``jacobian(model, unknown, known)``
      layout), or ``x`` alone when ``known`` is None. ``x`` is ``(N, k)``.
    - ``targets``: ``(N, *output_shape)``. ``known``: ``(N, h)`` or None.
    - ``x0``: ``(N, k)``, ``(k,)`` or None (zeros, moved into the bounds; the midpoint where
      both bounds are finite). ``k`` comes from ``x0``, the bounds or ``n_unknowns``.
    - ``bounds=(lower, upper)``: each a scalar, ``(k,)`` or ``(N, k)``; ±inf or None for none.
      Every point the model is evaluated at lies within them.
    - ``method``: "lm" (Levenberg-Marquardt) or "gn" (Gauss-Newton with a line search).
    - ``max_iter``: trial steps per instance (each costs one batched model evaluation).
    - ``xtol``, ``ftol``, ``gtol``: convergence tolerances (see :class:`Status`); default 1e-8
      when computing in float64, 1e-6 in float32 (whose rounding noise hides smaller changes).
    - ``weights`` (``w``) or ``sigma`` (standard deviations, ``w = 1/sigma^2``): scalar,
      ``output_shape`` or ``(N, *output_shape)``. Zero weights drop an output.
    - ``n_starts`` > 1: also start from ``n_starts - 1`` random points (uniform in the box
      where both bounds are finite, else ``x0 + max(1, |x0|) * N(0, 1)`` moved into the
      bounds; ``seed`` fixes them) and keep the lowest cost per instance.
    - ``return_jacobian``: also return the model Jacobian at the solution.
    - ``return_covariance``: also return ``s^2 (JᵀWJ)^-1``; ``s^2 = 1`` when ``sigma`` was
      given (absolute uncertainties), else ``2 cost / (m - k)`` (weights are relative). NaN
      where it does not exist: rank deficiency, or ``m <= k`` without ``sigma``. It is the
      linearisation at ``x``: for unknowns held on a bound it ignores the bound.
    - ``dtype``, ``mode``, ``chunk_size``, ``max_memory``, ``backend``, ``backend_options``: as
      in :func:`batchjac.jacobian`. Float64 is used when any of targets, known or x0 is float64.
    - ``callback(info)``: called after every batched evaluation with the points evaluated.
    - ``reproducible``: choose the mode from the cost model and the padded chunk sizes from the
      number of active instances alone, never from timings, so that the same call gives the
      same bytes in every run (``batchjac solve``'s resumable output relies on it). It may
      compile a few more chunk kernels than the default, which weighs padding against
      measured compilation time.

    - ``out``: a path (a directory of ``.npy`` files when it has no suffix, ``.zarr`` or ``.h5``)
      or a :class:`Store` (``overwrite=``, ``model_id=``): the instances are solved block by
      block into a resumable output, exactly as ``batchjac solve`` does (memory bounded by
      the block, a killed call continues where it stopped when made again, bitwise the same
      result; ``block_size`` and ``progress`` as in :func:`batchjac.jacobian`). Returns a
      :class:`SolveStoreResult` (``.open(name)`` reads an array). ``callback`` and
      ``chunk_size`` are for in-memory solves; stores are always ``reproducible``.

    - ``output``: the kind of the solution arrays (below); "auto" is the kind of ``targets``,
      ``known`` and ``x0``.

    - ``fit_tol``: the fit test's relative residual when ``sigma`` is not given (default 1e-6 in
      float64, 1e-4 in float32; see below).

    Returns a :class:`SolveResult`. ``success`` means the targets are **fitted**: the iterations
    converged (``status`` says on which test) *and* the weighted residual norm ``residual =
    ||sqrt(w) (f(x) - t)||`` passes the fit test. With ``sigma``, ``residual**2`` is a
    chi-square statistic and must lie below its 99.9% quantile for ``max(m - k, 1)`` degrees
    of freedom; otherwise ``residual <= fit_tol * max(||sqrt(w) t||, sqrt(sum(w)))``. An
    instance that converged to a point failing it (a local minimum of the cost, or a target
    the model cannot reach) has ``status == Status.LOCAL_MINIMUM`` and ``success`` False
    (``converged`` is True for both): ``n_starts > 1`` restarts it from random points. Noisy
    targets without ``sigma`` need ``fit_tol`` of the noise's relative size.
    The solution arrays ``x``, ``jacobian`` and ``covariance`` have the kind and device of the
    inputs, as :func:`batchjac.jacobian`'s result has (torch tensors in, torch tensors out on
    their device; JAX and TensorFlow likewise; ``output=`` asks for a kind): what the next
    step computes with. The per-instance diagnostics (``residual``, ``cost``, ``success``,
    ``status``, ``iterations``, ``rank``, ``rank_deficient``, ``start``) are numpy, a report
    to read and to filter by (a numpy mask indexes every kind). The iterations run on the
    host whatever the inputs: their per-instance damping and step tests are numpy, and the
    model's evaluations go through its kernels in host chunks; so the inputs are copied to the
    host once and the solution arrays back once.
    ``rank_deficient`` flags instances whose unknowns the outputs do not
    determine (always so when k > m: the damped steps then stay close to ``x0`` in the
    directions the outputs do not see, a minimum-norm-like solution).

    Instances with NaN/Inf in their targets or known inputs get ``Status.INVALID_INPUT``; the
    others are solved. A model returning NaN/Inf at a trial point rejects that step and raises
    the damping (LM) or shortens the step (GN); errors the model raises propagate.

    >>> import numpy as np, batchjac
    >>> from batchjac.examples import workload_model
    >>> model = workload_model("W3", "tensorflow", dtype="float64")  # 4 unknown + 4 known -> 512
    >>> rng = np.random.default_rng(0)
    >>> x_true, known = rng.uniform(-1, 1, (100, 4)), rng.normal(size=(100, 4))
    >>> targets = batchjac.jacobian(model, x_true, known, return_outputs=True)[0]
    >>> res = batchjac.solve(model, targets, known, x0=np.zeros((100, 4)))
    >>> bool(res.success.all()), float(np.abs(res.x - x_true).max()) < 1e-6
    (True, True)
    """
    model = as_model(model)  # an ONNX file or ModelProto: its PyTorch module
    delivery = on_host((targets, known, x0), output, out=out)
    if out is None:
        if block_size is not None:
            raise InputError("`block_size` sizes the blocks of a resumable output; it goes with "
                             "`out=`. For an in-memory solve, use `chunk_size` or `max_memory`.")
        # a mode asked for is computed or refused (a ModelError naming the other), never
        # swapped for the other with a warning, as in jacobian() (the solver's kernels'
        # calls say so); a store's mode comes from the cost model and falls back
        found = _in_memory(model, targets, known, x0=x0, bounds=bounds, method=method,
                           max_iter=max_iter, xtol=xtol, ftol=ftol, gtol=gtol,
                           weights=weights, sigma=sigma, n_starts=n_starts, seed=seed,
                           fit_tol=fit_tol, n_unknowns=n_unknowns,
                           return_jacobian=return_jacobian,
                           return_covariance=return_covariance, dtype=dtype, mode=mode,
                           chunk_size=chunk_size, max_memory=max_memory, backend=backend,
                           backend_options=backend_options, callback=callback,
                           reproducible=reproducible)
        return _delivered(found, delivery)
    return _to_store(model, targets, known, x0=x0, bounds=bounds, method=method, max_iter=max_iter,
                     xtol=xtol, ftol=ftol, gtol=gtol, weights=weights, sigma=sigma, n_starts=n_starts,
                     seed=seed, fit_tol=fit_tol, n_unknowns=n_unknowns, return_jacobian=return_jacobian,
                     return_covariance=return_covariance, dtype=dtype, mode=mode,
                     chunk_size=chunk_size, max_memory=max_memory, backend=backend,
                     backend_options=backend_options, callback=callback, out=out,
                     block_size=block_size, progress=progress)


def _delivered(found: SolveResult, delivery: Any) -> SolveResult:
    """The solution arrays in the inputs' kind and device (the diagnostics stay numpy)."""
    if delivery.kind == "numpy":
        return found
    return dataclasses.replace(
        found, x=deliver(found.x, delivery),
        jacobian=None if found.jacobian is None else deliver(found.jacobian, delivery),
        covariance=None if found.covariance is None else deliver(found.covariance, delivery))


def _to_store(model: Any, targets: Any, known: Any, *, x0: Any, bounds: Any, mode: ModeArg,
              chunk_size: int | None, callback: Callable[[IterationInfo], None] | None,
              out: str | os.PathLike[str] | Store, **options: Any) -> SolveStoreResult:
    for name, value, default in (("callback", callback, None), ("chunk_size", chunk_size, None),
                                 ("mode", mode, "auto")):
        if value != default:
            raise InputError(f"`{name}`={value!r} is not supported with `out=` (a resumable output "
                             f"solves block by block, mode from the cost model); drop it, or solve "
                             f"in memory without `out=`.")
    lower, upper = _split_bounds(bounds)
    store = out if isinstance(out, Store) else Store(os.fspath(out))
    inputs = SolveInputs(targets=targets, known=known, x0=x0, lower=lower, upper=upper,
                         weights=options.pop("weights"), sigma=options.pop("sigma"))
    return solve_to_store(model, inputs, store.path, overwrite=store.overwrite,
                          model_id=store.model_id, **options)


def _split_bounds(bounds: Any) -> tuple[Any, Any]:
    if bounds is None:
        return None, None
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise InputError(f"`bounds` must be a pair (lower, upper); got {type(bounds).__name__}.")
    return bounds[0], bounds[1]


__all__ = ["Method", "solve"]
