"""Randomized estimators of per-instance traces and diagonals, from products that never form
the matrix (issue 38): the divergence ``tr J_i`` from Jacobian-vector products, the Laplacian
``tr H_i`` (one per output) and the diagonal of ``H_i`` from Hessian-vector products.

- Hutchinson: ``v^T A v`` averaged over Rademacher probes ``v``; unbiased.
- Hutch++ (Meyer, Musco, Musco and Woodruff, SOSA 2021): a third of the products sketch the
  range of ``A`` (``A S``, orthonormalized to ``Q``); ``tr(Q^T A Q)`` is computed exactly from a
  third, and the rest of the trace, ``tr((I - QQ^T) A (I - QQ^T))``, by Hutchinson's estimate on
  the last third. Unbiased too; where ``A``'s spectrum decays (a few large eigenvalues) its
  error falls as ``1/samples`` rather than ``1/sqrt(samples)``.
- The diagonal (Bekas, Kokiopoulou and Saad 2007): ``v * (A v)`` averaged over Rademacher
  probes, whose squares are 1: unbiased entry by entry.

Each estimate carries a per-instance standard error: the spread of its probes' values over
the square root of their number (for Hutch++, of the residual's probes: the sketched part is
exact given the sketch). The probes are a function of ``(seed, instance, entry)`` only
(SplitMix64 of its index), so an instance gets the same estimate in any chunking.

Framework-free: the products come from a function of a chunk's rows and directions
(``apply``), which the verbs make from the backend's products (:mod:`batchjac._products`) or
its second-order ``hvp`` kernels (:mod:`batchjac._hessian`), and the chunks from the runner.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._errors import InputError
from ._runner import run_chunks
from ._sinks import ArraySink
from ._spec import BatchSpec, TangentSpec

Estimator = Literal["hutchinson", "hutch++"]
ESTIMATORS = ("hutchinson", "hutch++")

#: the bytes a block of rows of a product or an estimate may take by its estimate, below the
#: memory budget: blocks whose temporaries stay near the CPU's caches run as fast or faster
#: than larger ones, and the peak memory stays far below the Jacobians' (docs/thresholds.md)
WORKING_SET = 64 << 20

#: ``apply(u, ctx, V)``: for directions ``V`` ``(rows, d, k)``, the outputs ``(rows, *out)`` (or
#: None) and the products ``(rows, d, m, k)``, one ``k``-vector per direction and output
Apply = Callable[[np.ndarray, tuple[np.ndarray, ...], np.ndarray], tuple[Any, np.ndarray]]


@dataclass
class TraceEstimate:
    """A per-instance estimate of a trace: ``value`` ``(N, ...)``, its standard error ``stderr``
    (the same shape: the spread of the probes' values over the square root of their number),
    the ``estimator``, the number of products it took (``samples``) and the ``seed``."""

    value: Any
    stderr: Any
    samples: int
    estimator: str
    seed: int


@dataclass
class DiagonalEstimate(TraceEstimate):
    """A per-instance estimate of a diagonal, ``value`` ``(N, *output_shape, *unknown_shape)``,
    with its entry-by-entry standard error."""


def check(estimator: Any, samples: Any, seed: Any, allowed: tuple[str, ...], verb: str) -> None:
    """Bad estimator arguments fail by name, before anything is bound."""
    if estimator not in allowed:
        raise InputError(f"`estimator` of {verb}() must be None (exact) or one of "
                         f"{', '.join(map(repr, allowed))}; got {estimator!r}.")
    least = 4 if estimator == "hutch++" else 2
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < least:
        why = ("a third of them sketch the range, as many take its exact part, and the rest's "
               "standard error needs two" if least == 4 else "the standard error needs two")
        raise InputError(f"`samples` must be an int >= {least} for estimator={estimator!r} "
                         f"({why}); got {samples!r}.")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"`seed` must be a non-negative int; got {seed!r}.")


def probes_per_row(estimator: str, samples: int) -> int:
    """The random probes an instance draws: all of them for Hutchinson; for Hutch++ the sketch's
    and the residual's (the exact part's directions are the sketch's range)."""
    return samples - sketch(samples) if estimator == "hutch++" else samples


def sketch(samples: int) -> int:
    """Hutch++'s sketch width: a third of the products (the exact part takes as many)."""
    return max(1, samples // 3)


class Probes:
    """The probes of ``n`` instances, ``(n, count, *shape)``, made when rows of them are read
    (``probes[lo:hi]``, as a chunk reads its tangents): :func:`rademacher`; ``first``: the
    index of the first instance among all (a Dask block's offset)."""

    def __init__(self, seed: int, n: int, count: int, shape: tuple[int, ...],
                 dtype: np.dtype, first: int = 0) -> None:
        self.seed, self.count, self.dtype, self.first = seed, count, dtype, first
        self.shape = (n, count, *shape)

    def __getitem__(self, rows: slice) -> np.ndarray:
        lo, hi, _ = rows.indices(self.shape[0])
        return rademacher(self.seed, self.first + lo, self.first + hi, self.count,
                          self.shape[2:], self.dtype)


def rademacher(seed: int, lo: int, hi: int, count: int, shape: tuple[int, ...],
               dtype: np.dtype) -> np.ndarray:
    """``(hi - lo, count, *shape)`` signs, each a function of ``(seed, instance, entry)`` only:
    the same for an instance in any block, drawn at once. Entry ``e`` of an instance is bit
    ``e % 64`` of the SplitMix64 hash of its word ``(instance, e // 64)``: one hash gives 64
    signs."""
    per = count * math.prod(shape)
    words = -(-per // 64)
    with np.errstate(over="ignore"):
        # (SplitMix64's state after its (index + 1)-th step from the seed)
        index = (np.arange(lo, hi, dtype=np.uint64)[:, None] * np.uint64(words)
                 + np.arange(words, dtype=np.uint64)[None, :])
        z = np.uint64(seed) + (index + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    # (the words' bytes in little-endian order, each byte's bits lowest first: bit e % 64)
    bits = np.unpackbits(z.astype("<u8").view(np.uint8).reshape(hi - lo, words * 8), axis=1,
                         bitorder="little")[:, :per]
    signs = np.subtract(1, 2 * bits, dtype=np.int8).astype(dtype)
    return signs.reshape(hi - lo, count, *shape)


class EstimateKernel:
    """A chunk's estimates, as the runner calls a kernel: the probes come last among the
    chunk's arrays (:class:`batchjac._spec.TangentSpec`). Returns ``"estimates"`` and
    ``"stderrs"`` shaped ``(rows, *shape)`` (the ``m`` traces or the ``m x k`` diagonal of an
    instance, as the result holds them), and the ``"outputs"`` where asked."""

    def __init__(self, apply: Apply, chunk_size: int, estimator: str, samples: int,
                 shape: tuple[int, ...], diagonal: bool, with_outputs: bool) -> None:
        self.apply, self.chunk_size, self.estimator = apply, chunk_size, estimator
        self.samples, self.shape, self.diagonal = samples, shape, diagonal
        self.with_outputs = with_outputs

    def __call__(self, u: Any, ctx: tuple[Any, ...]) -> dict[str, np.ndarray]:
        *model_ctx, t = ctx
        rows = t.shape[0]
        v = np.asarray(t).reshape(rows, t.shape[1], -1)
        if self.estimator == "hutch++":
            y, values = hutchpp(self.apply, u, tuple(model_ctx), v, sketch(self.samples))
        else:
            y, av = self.apply(u, tuple(model_ctx), v)
            av = np.asarray(av, np.float64)
            v64 = v.astype(np.float64)
            if self.diagonal:  # (rows, m, k, s): v * Av, each probe's diagonal
                values = np.einsum("rsk,rsmk->rmks", v64, av)
            else:  # (rows, m, s): v^T A v
                values = np.einsum("rsk,rsmk->rms", v64, av)
        spread = values.std(-1, ddof=1) / math.sqrt(values.shape[-1])
        out = {"estimates": values.mean(-1).reshape(rows, *self.shape),
               "stderrs": spread.reshape(rows, *self.shape)}
        if self.with_outputs:
            out["outputs"] = np.asarray(y)
        return out


class Paired:
    """An estimate's chunk as one stored array ``name``, ``(rows, *shape, 2)``: each value and
    its standard error (what a store holds of an estimate)."""

    def __init__(self, kernel: EstimateKernel, name: str) -> None:
        self.kernel, self.name, self.chunk_size = kernel, name, kernel.chunk_size

    def __call__(self, u: Any, ctx: tuple[Any, ...]) -> dict[str, np.ndarray]:
        out = self.kernel(u, ctx)
        pair = np.stack([out.pop("estimates"), out.pop("stderrs")], -1).astype(u.dtype)
        return {**out, self.name: pair}


def hutchpp(apply: Apply, u: Any, ctx: tuple[Any, ...], v: np.ndarray, width: int
            ) -> tuple[Any, np.ndarray]:
    """Hutch++ of a chunk: ``v`` ``(rows, width + rest, k)`` holds the sketch's probes, then the
    residual's. Each output ``o`` of ``m`` gets its own sketch ``Q_o`` of ``A_o``'s range; the
    exact part pushes ``Q_o``'s columns and the residual part ``(I - Q_o Q_o^T) g``, so the second
    round takes ``m (width + rest)`` directions (each product gives every output; the ``o``-th is
    kept). Returns the outputs and each residual probe's value plus the exact part, ``(rows, m,
    rest)``: their mean is the estimate, their spread its error."""
    rows, _, k = v.shape
    s, g = v[:, :width], v[:, width:].astype(np.float64)
    _, a_s = apply(u, ctx, np.ascontiguousarray(s))
    m = a_s.shape[2]
    # Q_o: an orthonormal basis of range(A_o S), (rows, m, k, width') with width' = min(width, k)
    q, r = np.linalg.qr(np.moveaxis(np.asarray(a_s, np.float64), 1, -1))
    # a sketch of lower rank (two probes equal up to sign, a singular A_o) leaves columns of Q
    # that rounding alone decides: they are dropped, so the estimate is the same on any machine
    size = np.abs(np.diagonal(r, axis1=-2, axis2=-1))  # (rows, m, width')
    tol = 1000 * np.finfo(v.dtype).eps * size.max(-1, keepdims=True)
    q = np.moveaxis(q * (size > tol)[..., None, :], -1, 2)  # (rows, m, width', k)
    # the residual's probes, each projected off Q_o: (rows, m, rest, k)
    pg = g[:, None] - np.einsum("rmwk,rmsw->rmsk", q, np.einsum("rsk,rmwk->rmsw", g, q))
    directions = np.concatenate([q, pg], axis=2)  # (rows, m, d, k)
    d = directions.shape[2]
    y, a_d = apply(u, ctx, directions.reshape(rows, m * d, k).astype(v.dtype))
    a_d = np.asarray(a_d, np.float64).reshape(rows, m, d, m, k)
    a_own = np.einsum("rmdmk->rmdk", a_d)  # each output's products along its own directions
    quad = np.einsum("rmdk,rmdk->rmd", directions, a_own)
    exact = quad[..., :q.shape[2]].sum(-1, keepdims=True)
    return y, exact + quad[..., q.shape[2]:]


def run(kernel: EstimateKernel, spec: BatchSpec, probes: Probes, out_shape: tuple[int, ...] | None
        ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """The estimates of every instance, chunk by chunk through the runner (the probes drawn as
    each chunk reads them): ``(outputs or None, value, stderr)``, ``value`` and ``stderr``
    ``(N, *shape)`` in the batch's dtype."""
    per = (spec.n, *kernel.shape)
    targets = {"estimates": np.empty(per, spec.dtype), "stderrs": np.empty(per, spec.dtype)}
    if out_shape is not None:
        targets["outputs"] = np.empty((spec.n, *out_shape), spec.dtype)
    sink = ArraySink(targets)
    run_chunks(kernel, TangentSpec.of(spec, probes), sink)
    return targets.get("outputs"), targets["estimates"], targets["stderrs"]

