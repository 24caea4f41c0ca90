"""The runner: the one chunk iterator and the one error boundary around a call into the model.

Every path that computes per-instance results goes through here: in-memory results, stores
(local and on Dask workers), ``check`` and ``propagate``, the solver's evaluations and the
repeated-call fast path. A kernel's result is a mapping of named per-instance arrays
(``{"outputs": y, "jacobians": J}`` today; see :func:`results`), so the iterator, the sinks
and the stores carry whatever a kernel computes without knowing what it is.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._backends._base import user_stacklevel
from ._errors import BatchJacError, ModelError, ZeroJacobianWarning, add_context
from ._sinks import ArraySink
from ._spec import BatchSpec
from ._xp import NUMPY, ArrayOps

#: a chunk's named per-instance results, each ``(rows, ...)``
Results = dict[str, np.ndarray]


@dataclass(frozen=True)
class Chunk:
    """Rows ``lo:hi`` of the batch, the ``index``-th chunk of ``chunk_size`` rows."""

    index: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    def __str__(self) -> str:
        return f"chunk {self.index} (rows {self.lo}:{self.hi})"


def chunk_bounds(index: int, chunk_size: int, n: int) -> Chunk:
    """The ``index``-th chunk of ``chunk_size`` rows of ``n`` (the last one may be short).

    >>> chunk_bounds(2, 64, 150)
    Chunk(index=2, lo=128, hi=150)
    """
    lo = index * chunk_size
    return Chunk(index, lo, min(lo + chunk_size, n))


def chunks(n: int, chunk_size: int, indices: Iterable[int] | None = None) -> Iterator[Chunk]:
    """The chunks of ``n`` rows in order, or only those of ``indices`` (a resumed store's)."""
    if indices is None:
        indices = range(-(-n // chunk_size) if n else 0)
    for index in indices:
        yield chunk_bounds(index, chunk_size, n)


def pad(a: np.ndarray, rows: int, xp: ArrayOps = NUMPY) -> np.ndarray:
    """Pad to ``rows`` by repeating the last row: real values keep every op finite (zeros
    might not, e.g. log or division), and padded results are dropped anyway."""
    if a.shape[0] == rows:
        return a
    return xp.pad_rows(a, rows)


def pad_args(u: np.ndarray, ctx: tuple[np.ndarray, ...], rows: int, xp: ArrayOps = NUMPY
             ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """A kernel's arguments padded to exactly ``rows`` rows (``xp``: their kind)."""
    return pad(u, rows, xp), tuple(pad(c, rows, xp) for c in ctx)


def pad_chunk(spec: BatchSpec, lo: int, hi: int, rows: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Rows ``lo:hi`` of the batch as kernel arguments, padded to ``rows``."""
    u, ctx = spec.chunk(lo, hi)
    return pad_args(u, ctx, rows, spec.xp)


@contextlib.contextmanager
def model_call(where: object) -> Iterator[None]:
    """THE error boundary around a call into the model: batchjac's own errors get ``where``
    added (which chunk, which rows), and a framework's exception becomes a
    :class:`~batchjac.ModelError` that names it, with the original as its cause."""
    try:
        yield
    except BatchJacError as e:
        raise add_context(e, str(where)) from e
    except Exception as e:  # framework errors at run time
        raise ModelError(f"The model failed on {where}: {type(e).__name__}: {e}") from e


def results(raw: Any) -> Results:
    """A kernel's return value as named arrays: a mapping as it is; the ``(y or None, J)``
    pair of a Jacobian kernel as ``{"outputs": y, "jacobians": J}`` (no outputs when None)."""
    if isinstance(raw, Mapping):
        return dict(raw)
    y, jac = raw
    return {"jacobians": jac} if y is None else {"outputs": y, "jacobians": jac}


def call(kernel: Callable[..., Any], u: np.ndarray, ctx: tuple[np.ndarray, ...], where: object,
         rows: int | None = None, *, zero_check: bool = True) -> Results:
    """One kernel call inside the boundary; with ``rows``, each result cut to its first rows
    (the padded ones dropped). The first call of a bound model's kernels checks the Jacobians
    for being all zero (:func:`warn_if_zero`), unless ``zero_check`` is False (the solver's
    iterates are not the user's rows: a zero Jacobian there is an instance that stalls, which
    its status reports)."""
    with model_call(where):
        out = results(kernel(u, ctx))
    if rows is not None:
        out = {name: a[:rows] if a.shape[0] != rows else a for name, a in out.items()}
    if zero_check:
        warn_if_zero(kernel, out, where)
    return out


def warn_if_zero(kernel: Any, out: Results, where: object) -> None:
    """Warn, once per bound model (on its first chunk), when every Jacobian entry of that chunk
    is zero: the output most likely does not depend on the unknowns at all. Torch and JAX see a
    missing path in the probes (NotConnectedError); TensorFlow's gradients flow through a
    slice of the unknowns that is never used, and zeros came back silently. Every backend gets
    this one check here. It stops at the first block of rows with a nonzero entry: the whole
    first chunk is read only when it is all zero (reading a large chunk whole costs tens of
    milliseconds)."""
    if not hasattr(kernel, "chunk_size"):  # not a kernel (a wrapper of a launched call)
        return
    owner = getattr(kernel, "_bound", kernel)
    if getattr(owner, "zero_checked", False):
        return
    with contextlib.suppress(AttributeError):  # an object without attributes: each time
        owner.zero_checked = True
    jac = out.get("jacobians")
    if jac is None or math.prod(jac.shape) == 0 or _any_nonzero(jac):
        return
    warnings.warn(
        f"Every Jacobian entry of {where} is zero: the model's output does not seem to depend "
        f"on the unknowns. Usual cause: the model reads only the known inputs (or ignores the "
        f"unknown columns), e.g. it slices them away; check which columns it takes. (A model "
        f"flat over these rows, e.g. saturated or behind dead ReLUs, gives zeros too.)",
        ZeroJacobianWarning, stacklevel=user_stacklevel())


#: entries of a block of rows :func:`_any_nonzero` reads at once (its views cost nothing)
ZERO_CHECK_BLOCK = 1 << 16


def _any_nonzero(a: Any) -> bool:
    """Some entry is not zero, computed where ``a`` lives (a framework's array on its device:
    one reduction there and a bool back, not a copy of the Jacobians to the host)."""
    if isinstance(a, np.ndarray):
        if a.ndim == 0:
            return bool(a)
        step = max(1, ZERO_CHECK_BLOCK // max(1, math.prod(a.shape[1:])))
        return any(bool(np.any(a[i:i + step])) for i in range(0, a.shape[0], step))
    from ._arrays import ops_of

    return ops_of(a).any_nonzero(a)


def iter_results(
    kernel: Any,
    spec: BatchSpec,
    indices: Iterable[int] | None = None,
    *,
    keep_rows: bool = False,
) -> Iterator[tuple[Chunk, Results, tuple[np.ndarray, tuple[np.ndarray, ...]] | None]]:
    """THE chunk iterator: for each chunk of ``kernel.chunk_size`` rows (all of them, or those
    of ``indices``), read the rows, pad them, call the kernel inside the boundary and cut the
    results to the chunk's rows. Yields ``(chunk, results, rows)``; ``rows`` is the unpadded
    ``(u, ctx)`` read from the inputs when ``keep_rows`` (a store hashes them), else None."""
    cs = kernel.chunk_size
    for chunk in chunks(spec.n, cs, indices):
        try:  # reading (lazy inputs) fails as an input error, not the model's
            u, ctx = spec.chunk(chunk.lo, chunk.hi)
        except BatchJacError as e:
            raise add_context(e, str(chunk)) from e
        out = call(kernel, *pad_args(u, ctx, cs, spec.xp), chunk, rows=chunk.rows)
        yield chunk, out, ((u, ctx) if keep_rows else None)
        del out, u, ctx  # the next chunk's buffers then take this one's place, not join it


def run_chunks(kernel: Any, spec: BatchSpec, sink: ArraySink, *,
               on_chunk: Callable[[int], None] | None = None) -> None:
    """Compute rows ``0..n`` chunk by chunk, in order, into ``sink``."""
    for chunk, out, _ in iter_results(kernel, spec):
        sink.write(chunk.lo, chunk.hi, out)
        del out
        if on_chunk is not None:
            on_chunk(chunk.rows)


def run_single(kernel: Any, spec: BatchSpec) -> Results:
    """All rows in one chunk: the kernel's arrays without another copy."""
    u, ctx = pad_chunk(spec, 0, spec.n, kernel.chunk_size)
    return call(kernel, u, ctx, f"rows 0:{spec.n}", rows=spec.n)
