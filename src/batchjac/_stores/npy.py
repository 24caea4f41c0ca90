"""The ``.npy`` work files of the stores: created preallocated, mapped, read by rows and
loaded, never through a link (:mod:`.durable`), and checked to hold the array expected."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import StoreError
from .arrays import ArrayInfo
from .durable import create_new, open_regular


def _npy_header(f: Any, path: Path | str, info: ArrayInfo | None) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data offset) of the open .npy ``f``; checked against ``info``."""
    version = np.lib.format.read_magic(f)
    read = {(1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read is None:
        raise StoreError(f"{os.fspath(path)!r} is not a .npy file batchjac wrote "
                         f"(format version {version}).")
    shape, fortran, dtype = read(f)
    if info is not None and (fortran or tuple(shape) != tuple(info.shape)
                             or dtype != np.dtype(info.dtype)):
        raise StoreError(
            f"{os.fspath(path)!r} holds a {'Fortran-ordered ' if fortran else ''}{dtype} array "
            f"of shape {tuple(shape)}, not the store's {info.dtype} array of shape {info.shape}: "
            f"it is not the file batchjac made. Pass overwrite=True (--overwrite) to start again.")
    return tuple(shape), dtype, f.tell()


def create_npy(path: Path, info: ArrayInfo) -> None:
    """A new .npy file for ``info``, created exclusively (never through a link), with its
    blocks reserved now: a full disk fails here, not with SIGBUS in a memmap write."""
    dtype = np.dtype(info.dtype)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": tuple(info.shape)}
    with os.fdopen(create_new(path), "wb") as f:
        try:
            np.lib.format.write_array_header_1_0(f, header)
        except ValueError:  # a header over 64 KiB
            np.lib.format.write_array_header_2_0(f, header)
        size = f.tell() + math.prod(info.shape) * dtype.itemsize
        f.truncate(size)
        f.flush()
        if hasattr(os, "posix_fallocate") and size:
            os.posix_fallocate(f.fileno(), 0, size)
        os.fsync(f.fileno())


def map_npy(path: Path, info: ArrayInfo) -> np.memmap:
    """The work .npy ``path`` mapped for writing (``np.memmap``, mode r+), opened without
    following links and checked to hold ``info``'s array."""
    with os.fdopen(open_regular(path, os.O_RDWR), "r+b") as f:
        shape, dtype, offset = _npy_header(f, path, info)
        # the mapping keeps its own duplicate of the descriptor
        return np.memmap(f, dtype=dtype, mode="r+", shape=shape, offset=offset)


def read_npy_rows(path: Path, info: ArrayInfo, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo:hi`` of the work .npy ``path`` (read, not mapped: one chunk in memory)."""
    with os.fdopen(open_regular(path), "rb") as f:
        shape, dtype, offset = _npy_header(f, path, info)
        row = math.prod(shape[1:]) * dtype.itemsize
        f.seek(offset + lo * row)
        buf = f.read((hi - lo) * row)
    if len(buf) != (hi - lo) * row:
        raise ValueError(f"{os.fspath(path)!r} is shorter than its header says")
    return np.frombuffer(buf, dtype).reshape((hi - lo, *shape[1:]))


def load_npy(path: Path) -> np.ndarray:
    """A whole work .npy file (a staged chunk), opened without following links."""
    with os.fdopen(open_regular(path), "rb") as f:
        return np.load(f, allow_pickle=False)
