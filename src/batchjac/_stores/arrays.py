"""What a store holds: named arrays of one row per instance (:class:`ArrayInfo`), chunked by
rows so that no storage chunk is shared by two computed units."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: target size of one storage chunk of an array (rows are a divisor of the unit size)
STORAGE_CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ArrayInfo:
    """One array of a store of ``shape[0]`` rows, as the formats write it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk_rows: int
    dims: tuple[str, ...]
    attrs: dict[str, Any]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * np.dtype(self.dtype).itemsize


def fill(dtype: str) -> Any:
    """Fill value of unwritten elements: NaN for floats, 0 for integers and booleans."""
    kind = np.dtype(dtype).kind
    return float("nan") if kind == "f" else (False if kind == "b" else 0)


def dims(prefix: str, shape: tuple[int, ...]) -> list[str]:
    """Names of the axes of ``shape``: ``prefix``, or ``prefix_0``, ``prefix_1``..."""
    return [prefix] if len(shape) == 1 else [f"{prefix}_{i}" for i in range(len(shape))]


def storage_rows(chunk_size: int, row_bytes: int, n: int) -> int:
    """Rows per storage chunk: the largest divisor of ``chunk_size`` whose chunk stays under
    STORAGE_CHUNK_BYTES, so computed chunks never share a storage chunk."""
    best = 1
    for d in range(1, math.isqrt(chunk_size) + 1):
        if chunk_size % d == 0:
            for r in (d, chunk_size // d):
                if r * max(row_bytes, 1) <= STORAGE_CHUNK_BYTES and r > best:
                    best = r
    return max(1, min(best, max(n, 1)))
