"""Sensitivity summaries of a set of per-instance Jacobians: which inputs drive which outputs.

Everything is numpy and streams over the instances, so a memory-mapped Jacobian file of any
size can be summarised. A framework's arrays (``jacobian``'s result for tensors, on any
device) are read to the host chunk by chunk; the summaries are a report, numpy whatever the
inputs, and :func:`elasticities`, per-instance arrays, come back in the kind of ``jac``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._arrays import like
from ._errors import InputError
from ._validate import to_numpy

Measure = Literal["mean_abs", "elasticity", "scaled"]
_MEASURES = ("mean_abs", "elasticity", "scaled")
_DESCRIBE = {
    "mean_abs": "mean |dy/dx| over instances",
    "elasticity": "|median elasticity| (dy/dx * x/y) over instances",
    "scaled": "mean |dy/dx| * std(x) / std(y) (standardised)",
}
#: rows read at once when summarising a (memory-mapped) Jacobian set
_ROWS = 8192


@dataclass
class Sensitivity:
    """Summaries of a Jacobian set, per output (rows) and unknown input (columns), flattened
    in C order: ``m`` outputs by ``k`` inputs."""

    #: mean |dy_o / dx_j| over instances, (m, k)
    mean_abs: np.ndarray
    #: signed mean dy_o / dx_j, (m, k)
    mean: np.ndarray
    #: median over instances of the elasticity dy_o/dx_j * x_j / y_o, (m, k); None without x, y
    elasticity: np.ndarray | None
    #: instances whose |y_o| was too close to 0 for an elasticity, per output, (m,)
    elasticity_undefined: np.ndarray | None
    #: mean |dy/dx| * std(x_j) / std(y_o): the change of y in its standard deviations per
    #: standard deviation of x, (m, k); None without x and y
    scaled: np.ndarray | None
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    n: int
    #: the measure that ranks inputs unless another is asked for
    by: str = "mean_abs"

    def measure(self, by: Measure | None = None) -> np.ndarray:
        """The (m, k) non-negative values inputs are ranked by."""
        by = by or self.by  # type: ignore[assignment]
        if by not in _MEASURES:
            raise InputError(f"`by` must be one of {_MEASURES}; got {by!r}.")
        if by == "mean_abs":
            return self.mean_abs
        values = self.elasticity if by == "elasticity" else self.scaled
        if values is None:
            raise InputError(f"by={by!r} needs the inputs x and outputs y: pass them to "
                             f"sensitivity(jac, x, y).")
        return np.abs(values)

    def order(self, by: Measure | None = None) -> np.ndarray:
        """(m, k): for each output, input indices from the most to the least influential
        (undefined values last)."""
        values = np.nan_to_num(self.measure(by), nan=-np.inf)
        return np.argsort(-values, axis=1, kind="stable")

    def ranking(self, output: int | str = 0, by: Measure | None = None) -> list[tuple[str, float]]:
        """``[(input name, value), ...]`` for one output, most influential first."""
        o = self._output_index(output)
        values = self.measure(by)[o]
        return [(self.input_names[j], float(values[j])) for j in self.order(by)[o]]

    def _output_index(self, output: int | str) -> int:
        if isinstance(output, str):
            if output not in self.output_names:
                raise InputError(f"No output named {output!r}; the outputs are "
                                 f"{list(self.output_names)[:20]}.")
            return self.output_names.index(output)
        if not -len(self.output_names) <= output < len(self.output_names):
            raise InputError(f"Output {output} is out of range: there are "
                             f"{len(self.output_names)} outputs.")
        return int(output) % len(self.output_names)

    def __str__(self, top: int = 5) -> str:
        lines = [f"Sensitivity of {len(self.output_names)} output(s) to {len(self.input_names)} "
                 f"input(s) over {self.n} instances, ranked by {_DESCRIBE[self.by]}:"]
        for o, name in enumerate(self.output_names[:50]):
            ranked = self.ranking(o)[:top]
            lines.append(f"  {name}: " + ", ".join(f"{n} {v:.3g}" for n, v in ranked))
        if len(self.output_names) > 50:
            lines.append(f"  ... and {len(self.output_names) - 50} more outputs")
        return "\n".join(lines)


def _host(a: Any, name: str) -> np.ndarray:
    """``a`` (numpy, a memmap's rows, or a framework's array on any device) as float64 numpy."""
    return np.asarray(to_numpy(a, name), np.float64)


def _names(given: Sequence[str] | None, shape: tuple[int, ...], prefix: str, what: str
           ) -> tuple[str, ...]:
    size = int(np.prod(shape, dtype=np.int64))
    if given is not None:
        names = tuple(str(s) for s in given)
        if len(names) != size:
            raise InputError(f"`{what}` has {len(names)} names but there are {size} "
                             f"{what.split('_')[0]}s (shape {shape}); give one name each.")
        return names
    if len(shape) == 1:
        return tuple(f"{prefix}{j}" for j in range(size))
    return tuple(f"{prefix}[{', '.join(map(str, idx))}]" for idx in np.ndindex(*shape))


def _split_shape(jac: Any, x: Any, y: Any) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(N, output shape, unknown shape) of a Jacobian set ``(N, *out, *unknown)``."""
    shape = tuple(np.shape(jac))
    if len(shape) < 3:
        raise InputError(
            f"`jac` has shape {shape}; a Jacobian set is (N, *output_shape, *unknown_shape), "
            f"e.g. (N, m, k) from batchjac.jacobian."
        )
    n = shape[0]
    if x is not None:
        ushape = tuple(np.shape(x))[1:]
        if shape[len(shape) - len(ushape):] != ushape or np.shape(x)[0] != n or \
                len(ushape) >= len(shape) - 1:
            raise InputError(f"`x` has shape {np.shape(x)} but `jac` {shape}: x must be the "
                             f"unknowns, (N, *unknown_shape), with the Jacobians' trailing axes.")
        out_shape = shape[1:len(shape) - len(ushape)]
    elif y is not None:
        out_shape = tuple(np.shape(y))[1:]
        ushape = shape[1 + len(out_shape):]
        if shape[1:1 + len(out_shape)] != out_shape or not ushape:
            raise InputError(f"`y` has shape {np.shape(y)} but `jac` {shape}: y must be the "
                             f"outputs, (N, *output_shape), with the Jacobians' leading axes.")
    elif len(shape) == 3:
        out_shape, ushape = shape[1:2], shape[2:]
    else:
        raise InputError(
            f"`jac` has shape {shape}: with more than one output or unknown axis, pass the "
            f"unknowns `x` (N, *unknown_shape) or outputs `y` so the axes can be told apart."
        )
    if y is not None and (tuple(np.shape(y)) != (n, *out_shape)):
        raise InputError(f"`y` has shape {np.shape(y)}; for `jac` {shape} it must be "
                         f"{(n, *out_shape)}.")
    return n, tuple(out_shape), tuple(ushape)


def elasticities(jac: Any, x: Any, y: Any, *, y_floor: float = 1e-3) -> np.ndarray:
    """Per-instance elasticities ``dy_o/dx_j * x_j / y_o``: the percent change of ``y_o`` per
    percent change of ``x_j``. Shape and axes as ``jac`` ``(N, *out, *unknown)``, float64, of
    the array kind of ``jac`` (a torch tensor on its device for a torch ``jac``, ...).

    Where ``|y_o|`` of an instance is at most ``y_floor`` times the root mean square of that
    output over the instances, the elasticity is undefined (it would blow up as y -> 0) and is
    NaN.

    >>> import numpy as np
    >>> jac = np.array([[[2.0, 0.0]], [[1.0, 1.0]]])      # 2 instances, 1 output, 2 inputs
    >>> x = np.array([[1.0, 1.0], [1.0, 3.0]]); y = np.array([[2.0], [4.0]])
    >>> elasticities(jac, x, y)
    array([[[1.  , 0.  ]],
    <BLANKLINE>
           [[0.25, 0.75]]])
    """
    n, out_shape, ushape = _split_shape(jac, x, y)
    if x is None or y is None:
        raise InputError("elasticities need both the unknowns `x` and the outputs `y`.")
    m, k = int(np.prod(out_shape, dtype=np.int64)), int(np.prod(ushape, dtype=np.int64))
    a = _host(jac, "jac").reshape(n, m, k)
    xs = _host(x, "x").reshape(n, k)
    ys = _host(y, "y").reshape(n, m)
    floor = y_floor * np.sqrt(np.mean(ys**2, axis=0)) if n else np.zeros(m)
    ok = np.abs(ys) > floor
    with np.errstate(divide="ignore", invalid="ignore"):
        e = a * xs[:, None, :] / ys[:, :, None]
    e[~np.broadcast_to(ok[:, :, None], e.shape)] = np.nan
    return like(e.reshape(tuple(np.shape(jac))), jac)  # type: ignore[no-any-return]


def sensitivity(
    jac: Any,
    x: Any = None,
    y: Any = None,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    by: Measure = "mean_abs",
    y_floor: float = 1e-3,
    max_median_instances: int = 100_000,
    seed: int = 0,
) -> Sensitivity:
    """Summarise per-instance Jacobians ``jac`` (N, *output_shape, *unknown_shape).

    ``x`` (the unknowns, N x unknown shape) and ``y`` (the outputs, e.g. from
    ``jacobian(..., return_outputs=True)``) are optional; with both, elasticities and
    standardised sensitivities are computed too. ``input_names``/``output_names`` label the
    flattened unknowns and outputs (default ``x0, x1, ...`` and ``y0, y1, ...``). ``by`` picks
    the measure that ranks the inputs: ``"mean_abs"`` (mean |dy/dx|, in the units of y per unit
    of x), ``"elasticity"`` (|median of dy/dx * x/y|, unit-free) or ``"scaled"`` (mean |dy/dx|
    * std(x) / std(y), unit-free).

    Means are over all instances, read in chunks (``jac`` may be a memmap); the median
    elasticity uses all instances up to ``max_median_instances`` and a seeded random subset
    beyond that.

    >>> import numpy as np, batchjac
    >>> rng = np.random.default_rng(0)
    >>> jac = rng.normal(size=(100, 2, 3)) * [1.0, 10.0, 0.1]   # input 1 matters most
    >>> s = batchjac.sensitivity(jac, input_names=["a", "b", "c"])
    >>> [name for name, _ in s.ranking(0)]
    ['b', 'a', 'c']
    """
    if by not in _MEASURES:
        raise InputError(f"`by` must be one of {_MEASURES}; got {by!r}.")
    n, out_shape, ushape = _split_shape(jac, x, y)
    if n == 0:
        raise InputError("`jac` has no instances (N = 0); there is nothing to summarise.")
    if by != "mean_abs" and (x is None or y is None):
        raise InputError(f"by={by!r} needs the inputs x and outputs y: sensitivity(jac, x, y, ...).")
    both = x is not None and y is not None
    totals = Totals(n, out_shape, ushape, with_xy=both, max_median_instances=max_median_instances,
                    seed=seed)
    for lo in range(0, n, _ROWS):
        hi = min(n, lo + _ROWS)
        totals.add(lo, jac[lo:hi], x[lo:hi] if both else None, y[lo:hi] if both else None)
    return totals.result(input_names=input_names, output_names=output_names, by=by,
                         y_floor=y_floor)


class Totals:
    """What :func:`sensitivity` sums over the instances, chunk by chunk in their order (from a
    Jacobian set, or as a model's Jacobians are computed, :func:`of_model`): the sums of ``J``
    and ``|J|``, the inputs' and outputs' means and variances (merged per chunk), and for the
    median elasticity ``J x`` and ``y`` of the instances it is taken over (all of them up to
    ``max_median_instances``, else a seeded random subset)."""

    def __init__(self, n: int, out_shape: tuple[int, ...], ushape: tuple[int, ...], *,
                 with_xy: bool, max_median_instances: int, seed: int) -> None:
        self.n, self.out_shape, self.ushape = n, out_shape, ushape
        self.m = m = int(np.prod(out_shape, dtype=np.int64))
        self.k = k = int(np.prod(ushape, dtype=np.int64))
        self.total_abs, self.total = np.zeros((m, k)), np.zeros((m, k))
        self.seen = 0
        self.rows: np.ndarray | None = None
        if with_xy:
            self.rows = np.arange(n) if n <= max_median_instances else np.sort(
                np.random.default_rng(seed).choice(n, max_median_instances, replace=False))
            self.jx = np.empty((len(self.rows), m, k))
            self.ys = np.empty((len(self.rows), m))
            self.moments = {"x": (np.zeros(k), np.zeros(k)), "y": (np.zeros(m), np.zeros(m))}

    def add(self, lo: int, jac: Any, x: Any = None, y: Any = None) -> None:
        """Instances ``lo, lo + 1, ...`` (the next ones): their Jacobians, unknowns, outputs,
        in blocks of ``_ROWS`` (float64 copies of a block at a time)."""
        for start in range(0, len(jac), _ROWS):
            part = slice(start, start + _ROWS)
            self._add(lo + start, jac[part], None if x is None else x[part],
                      None if y is None else y[part])

    def _add(self, lo: int, jac: Any, x: Any, y: Any) -> None:
        a = _host(jac, "jac").reshape(-1, self.m, self.k)
        if not np.isfinite(a).all():
            bad = lo + int(np.argmin(np.isfinite(a).reshape(len(a), -1).all(axis=1)))
            raise InputError(f"`jac` has a NaN or Inf entry in instance {bad}; drop or "
                             f"recompute those instances before summarising.")
        self.total += a.sum(axis=0)
        self.total_abs += np.abs(a).sum(axis=0)
        if self.rows is not None:
            xs = _host(x, "x").reshape(len(a), self.k)
            ys = _host(y, "y").reshape(len(a), self.m)
            for name, values in (("x", xs), ("y", ys)):  # (Chan et al.'s merge of two sets)
                mean, m2 = self.moments[name]
                delta = values.mean(axis=0) - mean
                total = self.seen + len(a)
                self.moments[name] = (mean + delta * len(a) / total,
                                      m2 + ((values - values.mean(axis=0)) ** 2).sum(axis=0)
                                      + delta ** 2 * self.seen * len(a) / total)
            first, last = np.searchsorted(self.rows, [lo, lo + len(a)])
            picked = self.rows[first:last] - lo
            if len(picked) == len(a):  # (every instance: no copy of the block)
                picked = slice(None)  # type: ignore[assignment]
            np.multiply(a[picked], xs[picked][:, None, :], out=self.jx[first:last])
            self.ys[first:last] = ys[picked]
        self.seen += len(a)

    def result(self, *, input_names: Sequence[str] | None, output_names: Sequence[str] | None,
               by: Measure, y_floor: float) -> Sensitivity:
        n, m, k = self.n, self.m, self.k
        elasticity = undefined = scaled = None
        if self.rows is not None:
            floor = y_floor * np.sqrt(np.mean(self.ys ** 2, axis=0)) if len(self.ys) else np.zeros(m)
            # (in place: J x becomes the elasticities, undefined where |y| is at the floor)
            ys = np.where(np.abs(self.ys) > floor, self.ys, np.nan)
            e = np.divide(self.jx, ys[:, :, None], out=self.jx)
            undefined = np.isnan(ys).sum(axis=0) if k else np.zeros(m, int)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # outputs with no defined value
                elasticity = np.nanmedian(e, axis=0, overwrite_input=True)
            sx, sy = (np.sqrt(self.moments[w][1] / n) for w in ("x", "y"))
            with np.errstate(divide="ignore", invalid="ignore"):
                scaled = np.where(sy[:, None] > 0, (self.total_abs / n) * sx[None, :] / sy[:, None],
                                  np.nan)
        return Sensitivity(
            mean_abs=self.total_abs / n, mean=self.total / n, elasticity=elasticity,
            elasticity_undefined=undefined, scaled=scaled,
            input_names=_names(input_names, self.ushape, "x", "input_names"),
            output_names=_names(output_names, self.out_shape, "y", "output_names"), n=n, by=by,
        )


def of_model(model: Any, inputs: tuple[Any, ...], *, wrt: Any = None, dtype: Any = None,
             backend: str | None = None, max_memory: int | str | None = None,
             input_names: Sequence[str] | None = None,
             output_names: Sequence[str] | None = None, by: Measure = "mean_abs",
             y_floor: float = 1e-3, max_median_instances: int = 100_000, seed: int = 0
             ) -> Sensitivity:
    """:func:`sensitivity` of ``model``'s Jacobians at ``inputs`` (the call forms of
    :func:`batchjac.jacobian`), summed chunk by chunk as they are computed: no Jacobian set is
    held, only the instances the median elasticity is taken over (``J x`` and ``y`` of at most
    ``max_median_instances``)."""
    from ._errors import BatchJacError, add_context
    from ._evaluate import bind, context
    from ._loaders import as_model
    from ._validate import normalize

    if by not in _MEASURES:
        raise InputError(f"`by` must be one of {_MEASURES}; got {by!r}.")
    model = as_model(model)
    spec = normalize(inputs, wrt=wrt, dtype=dtype, nan_policy="raise")
    if spec.n == 0:
        raise InputError("The inputs have no instances (N = 0); there is nothing to summarise.")
    name, bound = bind(model, spec, backend, None)
    try:
        return _of_bound(bound, spec, name, max_memory=max_memory, input_names=input_names,
                         output_names=output_names, by=by, y_floor=y_floor,
                         max_median_instances=max_median_instances, seed=seed)
    except BatchJacError as e:
        raise add_context(e, context(spec, name)) from e


def _of_bound(bound: Any, spec: Any, name: str, *, max_memory: int | str | None,
              input_names: Sequence[str] | None, output_names: Sequence[str] | None,
              by: Measure, y_floor: float, max_median_instances: int, seed: int) -> Sensitivity:
    from ._evaluate import reduce_jacobians

    def consume(chunks: Any, plan: Any) -> Totals:
        totals: Totals | None = None
        for lo, hi, y, jac in chunks:
            if totals is None:
                totals = Totals(spec.n, tuple(np.shape(y))[1:], tuple(spec.unknown_shape),
                                with_xy=True, max_median_instances=max_median_instances,
                                seed=seed)
            totals.add(lo, jac, spec.chunk(lo, hi)[0], y)
        assert totals is not None
        return totals

    totals = reduce_jacobians(bound, spec, name, mode="auto", chunk_size=None,
                              max_memory=max_memory, with_outputs=True, consume=consume)
    return totals.result(input_names=input_names, output_names=output_names, by=by,
                         y_floor=y_floor)
