"""What a store holds: named arrays of one row per instance, laid out in storage chunks.

The caller of a store describes its arrays per instance (:class:`ArraySpec`: a name, the shape
and dtype of one instance's value, optionally names of the axes and attributes for the
metadata); :func:`layout` turns them into the arrays of a store of ``n`` rows
(:class:`ArrayInfo`), chunked by rows so that no storage chunk is shared by two computed units.
Nothing here knows what the arrays mean (Jacobians, solutions, Hessians...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: target size of one storage chunk of an array (rows are a divisor of the unit size)
STORAGE_CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ArraySpec:
    """One array of a store, described per instance: array ``name`` has shape
    ``(n, *shape)`` and dtype ``dtype``. ``dims`` names every axis, the row axis first (for
    the metadata of formats that keep it: Zarr dimension names, HDF5 attributes); by default
    ``("row", "axis_1", ...)``. ``attrs`` are small JSON metadata kept with the array."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[str, ...] | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)


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


def layout(specs: Sequence[ArraySpec], n: int, unit_rows: int, shared: bool = False
           ) -> list[ArrayInfo]:
    """The arrays of a store of ``n`` rows computed in units of ``unit_rows`` rows. Storage
    chunks hold a divisor of ``unit_rows`` rows: per array (the largest under
    STORAGE_CHUNK_BYTES), or with ``shared`` the first array's for every array (the others
    chunked alike: for arrays whose rows are no larger than the first one's)."""
    def row_bytes(s: ArraySpec) -> int:
        return math.prod(s.shape) * np.dtype(s.dtype).itemsize

    common = storage_rows(unit_rows, row_bytes(specs[0]), n) if shared and specs else 0
    infos = []
    for s in specs:
        rows = common or storage_rows(unit_rows, row_bytes(s), n)
        names = s.dims if s.dims is not None else ("row", *(f"axis_{i + 1}" for i in range(len(s.shape))))
        infos.append(ArrayInfo(s.name, (n, *s.shape), np.dtype(s.dtype).name, rows, tuple(names),
                               dict(s.attrs)))
    return infos
