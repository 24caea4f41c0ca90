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

from ._arrays import kind_of, like
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
    m, k = int(np.prod(out_shape, dtype=np.int64)), int(np.prod(ushape, dtype=np.int64))
    total_abs, total = np.zeros((m, k)), np.zeros((m, k))
    for lo in range(0, n, _ROWS):
        a = _host(jac[lo:lo + _ROWS], "jac").reshape(-1, m, k)
        if not np.isfinite(a).all():
            bad = lo + int(np.argmin(np.isfinite(a).reshape(len(a), -1).all(axis=1)))
            raise InputError(f"`jac` has a NaN or Inf entry in instance {bad}; drop or "
                             f"recompute those instances before summarising.")
        total_abs += np.abs(a).sum(axis=0)
        total += a.sum(axis=0)
    elasticity = undefined = scaled = None
    if x is not None and y is not None:
        xs = _host(x, "x").reshape(n, k)
        ys = _host(y, "y").reshape(n, m)
        rows = np.arange(n) if n <= max_median_instances else np.sort(
            np.random.default_rng(seed).choice(n, max_median_instances, replace=False))
        some = jac if len(rows) == n else jac[rows] if kind_of(jac) == "numpy" else \
            to_numpy(jac, "jac")[rows]  # (a framework's array: no fancy indexing in TensorFlow)
        e = elasticities(_host(some, "jac"), xs[rows].reshape(
            len(rows), *ushape), ys[rows].reshape(len(rows), *out_shape), y_floor=y_floor)
        e = e.reshape(len(rows), m, k)
        undefined = np.isnan(e[:, :, 0]).sum(axis=0) if k else np.zeros(m, int)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # outputs with no defined value
            elasticity = np.nanmedian(e, axis=0)
        sx, sy = xs.std(axis=0), ys.std(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(sy[:, None] > 0, (total_abs / n) * sx[None, :] / sy[:, None], np.nan)
    return Sensitivity(
        mean_abs=total_abs / n, mean=total / n, elasticity=elasticity,
        elasticity_undefined=undefined, scaled=scaled,
        input_names=_names(input_names, ushape, "x", "input_names"),
        output_names=_names(output_names, out_shape, "y", "output_names"), n=n, by=by,
    )
