"""Sinks: where finished chunks go. In memory, or any writable array such as an ``np.memmap``.

A memory-mapped result is flushed after each chunk and its pages released from this process
(``madvise(MADV_DONTNEED)`` on a shared mapping, after ``msync``: the data stays in the file
and page cache), so resident memory stays flat however large the result is.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping
from typing import Any

import numpy as np

#: results at least this large are allocated with their pages mapped at once (see new_result)
POPULATE_BYTES = 64 << 20


def new_result(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new array for a result filled chunk by chunk.

    A large one (``POPULATE_BYTES``) is an anonymous mapping whose pages the kernel maps in
    one go (``MAP_POPULATE``, Linux), rather than ``np.empty``: numpy asks transparent huge
    pages for large arrays, and where the machine's memory is fragmented the first writes
    then wait for the kernel to compact it: measured, a large result's calls then took up to
    several times their usual time, now and then, where a populated mapping costs the same
    every call (docs/thresholds.md). The array owns its mapping: it is unmapped when the
    array is freed.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    flag = getattr(mmap, "MAP_POPULATE", None)
    if nbytes < POPULATE_BYTES or flag is None:
        return np.empty(shape, dtype)
    try:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flag)
    except (OSError, ValueError):  # e.g. a limit on mappings: the ordinary allocation
        return np.empty(shape, dtype)
    return np.frombuffer(mm, dtype).reshape(shape)


class ArraySink:
    """Writes named per-instance results into writable arrays by slice assignment.

    ``targets`` maps a result's name (``"jacobians"``, ``"outputs"``, or whatever a kernel
    returns) to the array of all rows that receives it; a name the sink has no target for is
    not kept (e.g. outputs computed with the Jacobians but not asked for)."""

    def __init__(self, targets: Mapping[str, Any]) -> None:
        self.targets = {name: t for name, t in targets.items() if t is not None}
        pairs = [(t, _shared_mmap(t)) for t in self.targets.values()]
        self._mapped = [(t, m) for t, m in pairs if m is not None]

    def write(self, lo: int, hi: int, results: Mapping[str, np.ndarray]) -> None:
        for name, target in self.targets.items():
            target[lo:hi] = results[name]
        for target, (arr, mm) in self._mapped:
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
