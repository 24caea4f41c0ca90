"""What the resumable stores share: refusing what may not be replaced, saving a unit (data,
fsync, then its done record) and checking the units kept from an interrupted run."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import StoreExistsError, StoreRecomputeWarning
from .._runner import chunk_bounds
from .arrays import ArrayInfo
from .formats import ChunkWriter, Format
from .manifest import hash_arrays
from .workdir import WorkDir


def unit_rows(index: int, chunk_size: int, n: int) -> tuple[int, int]:
    chunk = chunk_bounds(index, chunk_size, n)
    return chunk.lo, chunk.hi


def check_target(out: Path, fmt: Format, work: WorkDir, overwrite: bool,
                 what: str = "batchjac output") -> dict[str, Any] | None:
    """The manifest of the finished output at ``out`` (None if there is none), after refusing
    what batchjac may not replace: a file or directory that is not a finished output (unless
    ``overwrite``, and never a directory batchjac did not make) and a work directory that is
    not batchjac's."""
    existing = fmt.read_manifest(out) if os.path.lexists(out) else None
    if os.path.lexists(out) and existing is None:
        if not overwrite:
            raise StoreExistsError(
                f"The output {os.fspath(out)!r} exists and is not a finished {what}. Choose "
                f"another output path, or pass overwrite=True (--overwrite) to replace it.")
        if not fmt.removable(out):
            raise StoreExistsError(
                f"The output {os.fspath(out)!r} is a directory batchjac did not make; it will not "
                f"delete it, even with overwrite. Remove it yourself or choose another path.")
    if not work.ours():
        raise StoreExistsError(
            f"{os.fspath(work.path)!r} exists but was not made by batchjac (batchjac keeps "
            f"unfinished outputs there). Move it away, or choose another output path.")
    if existing is None and not overwrite:
        for sibling in fmt.foreign_siblings(out, work):
            raise StoreExistsError(
                f"{os.fspath(sibling)!r} exists beside the output {os.fspath(out)!r}, where "
                f"batchjac keeps the output's other files, and is not part of a finished {what}. "
                f"Choose another output path, or pass overwrite=True (--overwrite) to write the "
                f"output anyway (a file batchjac does not write is left as it is).")
    return existing

def save_chunk(writer: ChunkWriter, work: WorkDir, index: int, lo: int, hi: int,
               values: dict[str, np.ndarray], in_hash: str) -> dict[str, Any]:
    """Write one computed chunk (data, fsync), then record it as done: the one way a chunk
    is saved, by this process or by a Dask worker. Returns its record."""
    result_hash = hash_arrays(list(values.values()))
    writer.write(index, lo, hi, values)
    work.record(index, lo, hi, in_hash, result_hash)
    return {"lo": lo, "hi": hi, "input": in_hash, "result": result_hash}


def verify_kept(fmt: Format, work: WorkDir, arrays: list[ArrayInfo],
                done: dict[int, dict[str, Any]], chunk_size: int, n: int,
                unit: str = "chunk", stacklevel: int = 5) -> None:
    """Read every done chunk back and compare it with the digest of the result recorded when
    it was written; a chunk that differs (or cannot be read) is dropped from ``done`` and its
    record deleted, so it is computed again: the finished output is then still the one an
    uninterrupted run writes, and nothing is returned that the model did not compute."""
    for index in sorted(done):
        lo, hi = unit_rows(index, chunk_size, n)
        try:
            intact = hash_arrays(fmt.read_chunk(work.data, arrays, index, lo, hi)) \
                == done[index].get("result")
        except (OSError, ValueError, KeyError):
            intact = False
        if intact:
            continue
        warnings.warn(
            f"{os.fspath(work.out)!r}: the stored result of {unit} {index} (rows {lo}:{hi}) in "
            f"{os.fspath(work.path)!r} differs from the digest recorded when it was written (it "
            f"was changed on disk since); it is computed again.", StoreRecomputeWarning,
            stacklevel=stacklevel)  # the caller of jacobian()
        work.forget(index)
        del done[index]
