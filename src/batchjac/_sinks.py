"""Sinks: where finished chunks go. In memory, or any writable array such as an ``np.memmap``.

A memory-mapped result is flushed after each chunk and its pages released from this process
(``madvise(MADV_DONTNEED)`` on a shared mapping, after ``msync``: the data stays in the file
and page cache), so resident memory stays flat however large the result is.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np


class ArraySink:
    """Writes chunks into ``jac`` (and ``outputs``) by slice assignment."""

    def __init__(self, jac: Any, outputs: Any | None = None) -> None:
        self.jac = jac
        self.outputs = outputs
        pairs = [(t, _shared_mmap(t)) for t in (jac, outputs)]
        self._targets = [t for t, m in pairs if m is not None]
        self._maps = [m for _, m in pairs if m is not None]

    def write(self, lo: int, hi: int, jac: np.ndarray, y: np.ndarray | None) -> None:
        self.jac[lo:hi] = jac
        if self.outputs is not None and y is not None:
            self.outputs[lo:hi] = y
        for target, (arr, mm) in zip(self._targets, self._maps):
            span = _row_span(target, arr, lo, hi)
            if span is None:  # a view of the memmap: flush and release all of it
                arr.flush()
                if hasattr(mm, "madvise"):
                    mm.madvise(mmap.MADV_DONTNEED)
            elif span[1]:
                mm.flush(*span)  # msync of the rows written: they are on disk when this returns
                if hasattr(mm, "madvise"):
                    mm.madvise(mmap.MADV_DONTNEED, *span)


def _shared_mmap(arr: Any) -> tuple[np.memmap, Any] | None:
    """The (memmap, mmap) pair behind ``arr`` if it is a writable shared mapping."""
    base = arr
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or getattr(base, "mode", None) not in ("r+", "w+"):
        return None
    mm = getattr(base, "_mmap", None)
    return (base, mm) if mm is not None else None


def _row_span(target: Any, base: np.memmap, lo: int, hi: int) -> tuple[int, int] | None:
    """(offset, length) in the mmap of rows ``lo:hi``, page-aligned, when ``target`` is the
    C-contiguous memmap itself; None otherwise."""
    if target is not base or not base.flags.c_contiguous or base.ndim == 0:
        return None
    row = base.strides[0] if base.shape[0] > 1 else base.itemsize * max(1, base.size)
    start = base.offset % mmap.ALLOCATIONGRANULARITY + lo * row
    begin = start - start % mmap.PAGESIZE
    end = start + (hi - lo) * row
    return begin, max(0, end - begin)
