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
        self._maps = [m for m in (_shared_mmap(jac), _shared_mmap(outputs)) if m is not None]

    def write(self, lo: int, hi: int, jac: np.ndarray, y: np.ndarray | None) -> None:
        self.jac[lo:hi] = jac
        if self.outputs is not None and y is not None:
            self.outputs[lo:hi] = y
        for arr, mm in self._maps:
            arr.flush()
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_DONTNEED)


def _shared_mmap(arr: Any) -> tuple[np.memmap, Any] | None:
    """The (memmap, mmap) pair behind ``arr`` if it is a writable shared mapping."""
    base = arr
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or getattr(base, "mode", None) not in ("r+", "w+"):
        return None
    mm = getattr(base, "_mmap", None)
    return (base, mm) if mm is not None else None
