"""The normalised description of one batch: which arrays, which of them is unknown, and how
the model's inputs are put back together from the unknown and the known parts.

Everything here is numpy; backends call :func:`assemble` with their own ``concat``/``take``
to rebuild the model's inputs inside their compiled function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._xp import NUMPY, ArrayOps

InputKind = Literal["single", "concat", "tuple", "dict"]


@dataclass(frozen=True)
class Layout:
    """How the model's inputs are assembled from ``u`` (the unknowns) and ``ctx`` (the rest).

    - ``concat``: the model takes one array, ``concat([u, ctx[0]], -1)`` (the
      ``jacobian(model, unknown, known)`` form).
    - ``single``/``tuple``/``dict``: the model takes ``n_inputs`` arrays (one, a positional
      tuple, or a dict with ``keys``); input ``wrt_index`` holds the unknowns. If ``columns`` is
      set only those feature columns of it are unknown and the input is rebuilt as
      ``concat([u, ctx[0]], -1)[..., perm]`` (``perm`` is None when the unknown columns are
      already the leading ones). The remaining inputs follow in ``ctx`` in model order.
    """

    kind: InputKind
    n_inputs: int
    wrt_index: int = 0
    keys: tuple[str, ...] | None = None
    columns: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None


def assemble(
    layout: Layout,
    u: Any,
    ctx: Sequence[Any],
    concat: Callable[[list[Any]], Any],
    take: Callable[[Any, tuple[int, ...]], Any],
) -> list[Any]:
    """Rebuild the model's input list from ``u`` and ``ctx`` with framework ops.

    ``concat(list)`` joins along the last axis; ``take(x, idx)`` gathers last-axis columns.
    """
    if layout.kind == "concat":
        return [concat([u, ctx[0]])]
    rest = list(ctx)
    if layout.columns is not None:
        full = concat([u, rest.pop(0)])
        if layout.perm is not None:
            full = take(full, layout.perm)
    else:
        full = u
    rest.insert(layout.wrt_index, full)
    return rest


@dataclass
class BatchSpec:
    """A validated batch: the raw input arrays and the layout. Chunks are cut on demand, so
    no full-size copy of the inputs is ever made.

    An array may be *lazy*: anything with ``shape``, ``dtype`` and row slices ``a[lo:hi]`` that
    read those rows only (a batchjac file reader, an h5py dataset, a Zarr array, an
    ``np.memmap``). Then the inputs are streamed from disk chunk by chunk, and NaN/Inf, which
    cannot be checked up front without reading everything, are checked in each chunk as it is
    read (``finite_check``).
    """

    arrays: list[Any]  # as given: [unknown, known] for concat, else model inputs
    layout: Layout
    dtype: np.dtype  # compute dtype, float32 or float64
    n: int
    unknown_shape: tuple[int, ...]
    names: tuple[str, ...]  # one per array, for messages
    #: per array: check NaN/Inf in each chunk as it is read (lazy inputs, nan_policy="raise")
    finite_check: tuple[bool, ...] = ()
    #: the kind of ``arrays`` (numpy, or a framework's own arrays kept on their device: see
    #: :mod:`batchjac._arrays`); chunks are cut, cast and padded through it
    xp: ArrayOps = NUMPY

    @property
    def k(self) -> int:
        return math.prod(self.unknown_shape)

    def chunk(self, lo: int, hi: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Rows ``lo:hi`` as ``(u, ctx)``, floating arrays cast to the compute dtype. Known
        values that the model receives concatenated with the unknowns (the ``(unknown, known)``
        form, the known columns beside ``wrt``) are cast to it whatever their dtype: they join
        one floating array (integer known columns would otherwise fail in a framework's
        concat, e.g. TensorFlow's ConcatV2)."""
        lay, xp = self.layout, self.xp
        rows = self.rows(lo, hi)
        if lay.kind == "concat":
            u = xp.cast(rows[0], self.dtype)
            return u, (xp.cast(rows[1], self.dtype),)
        src = rows[lay.wrt_index]
        ctx: list[np.ndarray] = []
        if lay.columns is not None:
            cols = np.asarray(lay.columns)
            known = np.setdiff1d(np.arange(src.shape[-1]), cols)
            if lay.perm is None:
                u, kn = src[..., : len(cols)], src[..., len(cols):]
            else:
                u, kn = xp.take(src, lay.columns), xp.take(src, tuple(int(c) for c in known))
            ctx.append(xp.cast(kn, self.dtype))
        else:
            u = src
        ctx.extend(_cast(a, self.dtype, xp) for i, a in enumerate(rows) if i != lay.wrt_index)
        return xp.cast(u, self.dtype), tuple(ctx)

    def rows(self, lo: int, hi: int) -> list[np.ndarray]:
        """Rows ``lo:hi`` of every input array as given (read from disk for lazy arrays)."""
        out = []
        for i, a in enumerate(self.arrays):
            if isinstance(a, np.memmap):  # copy, then drop the pages from resident memory
                part = np.array(a[lo:hi])
                _release(a, lo, hi)
            else:
                part = a[lo:hi]
            if i < len(self.finite_check) and self.finite_check[i]:
                check_finite_rows(part, self.names[i], lo)
            out.append(part)
        return out

    def ctx_specs(self) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
        """Per-row shape and dtype of each ctx array, as :meth:`chunk` produces them."""
        lay = self.layout

        def cast(a: np.ndarray) -> np.dtype:
            dt = self.xp.dtype_of(a)
            return self.dtype if dt.kind == "f" else dt

        def per_row(a: Any) -> tuple[int, ...]:
            return tuple(int(d) for d in a.shape[1:])

        specs: list[tuple[tuple[int, ...], np.dtype]] = []
        if lay.kind == "concat":
            specs.append((per_row(self.arrays[1]), self.dtype))
        else:
            if lay.columns is not None:
                src = self.arrays[lay.wrt_index]
                width = int(src.shape[-1]) - len(lay.columns)
                specs.append(((*per_row(src)[:-1], width), self.dtype))
            specs.extend((per_row(a), cast(a)) for i, a in enumerate(self.arrays)
                         if i != lay.wrt_index)
        return tuple(specs)

    def on_host(self, rows: int) -> BatchSpec:
        """The first ``rows`` rows as numpy (everything when the arrays are numpy already):
        what the probes read, which run once per model on a few rows."""
        if self.xp.kind == "numpy":
            return self
        n = min(self.n, rows)
        return BatchSpec(arrays=[self.xp.to_numpy(a[:n]) for a in self.arrays],
                         layout=self.layout, dtype=self.dtype, n=n,
                         unknown_shape=self.unknown_shape, names=self.names)


@dataclass
class TangentSpec(BatchSpec):
    """A batch whose chunks carry per-instance directions after the model's own arrays:
    ``(u, (*ctx, v))``, as an ``hvp`` kernel takes its tangents and the products and
    estimators their directions and probes (of the batch's array kind, cut and cast where they
    live; ``tangents`` may be lazy: anything whose row slices ``[lo:hi]`` give those rows)."""

    tangents: Any = None

    @classmethod
    def of(cls, spec: BatchSpec, tangents: Any) -> TangentSpec:
        """``spec``'s batch with ``tangents`` beside it."""
        return cls(arrays=spec.arrays, layout=spec.layout, dtype=spec.dtype, n=spec.n,
                   unknown_shape=spec.unknown_shape, names=spec.names,
                   finite_check=spec.finite_check, xp=spec.xp, tangents=tangents)

    def chunk(self, lo: int, hi: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        u, ctx = super().chunk(lo, hi)
        return u, (*ctx, self.xp.cast(self.tangents[lo:hi], self.dtype))


def _cast(a: Any, dtype: np.dtype, xp: ArrayOps = NUMPY) -> Any:
    """Floating arrays go to the compute dtype; integer and bool inputs (ids, flags) stay."""
    if xp.dtype_of(a).kind == "f":
        return xp.cast(a, dtype)
    return xp.contiguous(a)


def check_finite_rows(a: np.ndarray, name: str, offset: int, *, whole: bool = False) -> None:
    """Raise InputError naming the first row (counted from the start of the batch) with NaN/Inf.
    ``whole``: ``a`` is the whole input (checked up front), so the message can count the bad rows."""
    if a.dtype.kind != "f" or a.size == 0:
        return
    finite = np.isfinite(a)
    if finite.all():
        return
    from ._errors import InputError

    bad_rows = ~finite.reshape(a.shape[0], -1).all(axis=1)
    row = int(np.argmax(bad_rows))
    where = np.argwhere(~finite[row])
    pos = tuple(int(i) for i in where[0]) if where.size else ()
    val = a[row][pos] if pos else a[row]
    where_found = (f"; {int(bad_rows.sum())} row(s) in all have NaN/Inf" if whole else
                   f" (found while reading rows {offset}:{offset + a.shape[0]}; inputs read from disk "
                   f"are checked chunk by chunk)")
    raise InputError(
        f"`{name}` has a non-finite value ({val}) in row {offset + row}"
        f"{f' at {pos}' if pos else ''}{where_found}. Clean or drop such rows, or pass "
        f"nan_policy='propagate' to get NaN Jacobians for them."
    )


def _release(a: np.memmap, lo: int, hi: int) -> None:
    """Drop the pages of rows ``lo:hi`` of a C-contiguous memmap from this process's resident
    memory (they stay in the page cache and the file); a no-op where that is not possible."""
    import mmap

    base: Any = a
    while base is not None and not isinstance(getattr(base, "_mmap", None), mmap.mmap):
        base = getattr(base, "base", None)
    mm = getattr(base, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or a is not base or not a.flags.c_contiguous \
            or a.ndim == 0 or hi <= lo:
        return
    row = a.strides[0]
    start = a.offset % mmap.ALLOCATIONGRANULARITY + lo * row
    begin = start - start % mmap.PAGESIZE
    end = min(len(mm), start + (hi - lo) * row)
    if end > begin:
        mm.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def sample_inputs(signature: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Two rows of a model's inputs (halves and ones, in their dtypes) as numpy, as the model
    takes them: positional, or by name (a Keras clone is built on them). ``signature``: the bound
    model's :class:`batchjac._backends._base.Signature`."""
    lay = signature.layout
    u = np.full((2, *signature.unknown_shape), 0.5, signature.dtype)
    ctx = tuple(np.ones((2, *shape), dt) for shape, dt in signature.ctx)
    inputs = assemble(lay, u, ctx, concat=lambda xs: np.concatenate(xs, axis=-1),
                      take=lambda x, idx: np.take(x, list(idx), axis=-1))
    if lay.kind == "dict":
        assert lay.keys is not None
        return (), dict(zip(lay.keys, inputs))
    return tuple(inputs), {}
