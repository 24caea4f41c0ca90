"""The normalised description of one batch: which arrays, which of them is unknown, and how
the model's inputs are put back together from the unknown and the known parts.

Everything here is numpy; backends call :func:`assemble` with their own ``concat``/``take``
to rebuild the model's inputs inside their compiled function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

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
    no full-size copy of the inputs is ever made."""

    arrays: list[np.ndarray]  # as given: [unknown, known] for concat, else model inputs
    layout: Layout
    dtype: np.dtype  # compute dtype, float32 or float64
    n: int
    unknown_shape: tuple[int, ...]
    names: tuple[str, ...]  # one per array, for messages

    @property
    def k(self) -> int:
        return int(np.prod(self.unknown_shape, dtype=np.int64))

    def chunk(self, lo: int, hi: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Rows ``lo:hi`` as ``(u, ctx)``, floating arrays cast to the compute dtype."""
        lay = self.layout
        if lay.kind == "concat":
            u = np.ascontiguousarray(self.arrays[0][lo:hi], dtype=self.dtype)
            return u, (_cast(self.arrays[1][lo:hi], self.dtype),)
        src = self.arrays[lay.wrt_index][lo:hi]
        ctx: list[np.ndarray] = []
        if lay.columns is not None:
            cols = np.asarray(lay.columns)
            known = np.setdiff1d(np.arange(src.shape[-1]), cols)
            if lay.perm is None:
                u, kn = src[..., : len(cols)], src[..., len(cols):]
            else:
                u, kn = src[..., cols], src[..., known]
            ctx.append(_cast(kn, self.dtype))
        else:
            u = src
        ctx.extend(_cast(a[lo:hi], self.dtype) for i, a in enumerate(self.arrays) if i != lay.wrt_index)
        return np.ascontiguousarray(u, dtype=self.dtype), tuple(ctx)

    def ctx_specs(self) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
        """Per-row shape and dtype of each ctx array, as :meth:`chunk` produces them."""
        _, ctx = self.chunk(0, 0)
        return tuple((c.shape[1:], c.dtype) for c in ctx)


def _cast(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Floating arrays go to the compute dtype; integer and bool inputs (ids, flags) stay."""
    if a.dtype.kind == "f":
        return np.ascontiguousarray(a, dtype=dtype)
    return np.ascontiguousarray(a)
