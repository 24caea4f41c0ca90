"""Resumable stores: Jacobians (and outputs) written chunk by chunk to ``.npy``, HDF5 or Zarr,
crash-safe and resumable.

``jacobian(model, ..., out="jac.zarr")`` (and ``batchjac compute``) run here. The guarantees:

- **Nothing half-done is visible under the output's name.** Work happens in a sibling directory
  ``OUT.partial/``; the finished output is moved to ``OUT`` in one rename (the commit point),
  so an ``OUT`` that exists is complete, and it carries its manifest (``complete: true``).
- **A kill at any moment loses at most the chunks in flight.** Each chunk's data is written
  and fsynced first, then the chunk is recorded as done by a small record in
  ``OUT.partial/done/`` written to a temporary file, fsynced and renamed into place (atomic).
  One record per chunk, rather than one manifest rewritten per chunk, keeps the cost per chunk
  constant and lets several writers (Dask workers) record chunks without a lock.
- **Same command, same bytes.** Chunk boundaries, the mode and the chunk size are fixed when
  the store is created and read back when it is resumed (``mode="auto"`` is decided by the cost
  model and the kernel is the backend's first implementation, XLA for TensorFlow, never by
  timing, for stores), every chunk is computed with the same compiled kernel, and the store's
  metadata holds no times. A run that was killed and resumed writes a store
  bitwise identical to one that was not.
- **Only the same job may resume.** The manifest records the job: the model's fingerprint
  (:mod:`batchjac._fingerprint`, or a file's hash from the command line), the batchjac and
  framework versions, the inputs' shapes, dtypes and column names, the layout and every option
  that changes the result. Each done chunk also records the sha256 of the input rows it was
  computed from; a resumed run re-reads those rows and compares, before computing anything.
  (A hash of whole input files up front would cost a full extra read on every run; per-chunk
  hashes cost nothing extra on a fresh run, check exactly the rows whose results are kept, and
  ignore rows not yet computed, which are read from the current inputs anyway.) The model's
  outputs on fixed probe inputs are recorded too and compared with a tolerance, which catches
  a changed model even where the fingerprint cannot see inside it. A different job is refused
  unless ``overwrite=True``.
- **Kept chunks are checked, and links are never followed.** Each done record also holds the
  sha256 of the chunk's result as written; a resumed run reads every kept chunk back and
  compares before trusting it (a chunk changed on disk since is computed again, with a
  warning, so the finished output is still the one an uninterrupted run writes). Work files
  are opened without following symbolic links (``O_NOFOLLOW``, new files with ``O_EXCL``) and
  a resumed work directory must hold only regular files and directories: a link planted there
  would make the remaining chunks go into the file it points to, the kept chunks be read from
  it and the finished output be that link. Such a store is refused (``overwrite=True``
  discards it: the links are removed, never what they point to).

Formats (all chunked by rows, chunk boundaries aligned with the computation's chunks, so no
storage chunk is shared by two computed chunks):

- Zarr (``.zarr``, a group with arrays ``jacobians`` and ``outputs``; Blosc-LZ4 compressed;
  dimension names, column names and the manifest in its attributes). Written in place.
- HDF5 (``.h5``/``.hdf5``; datasets ``/jacobians`` and ``/outputs``, gzip-compressed and
  chunked; names in ``/unknown_names`` and ``/output_names``, the manifest in the root attribute
  ``batchjac``). HDF5 files can be corrupted by a kill in the middle of a metadata write, so
  chunks are staged as ``.npy`` files and the HDF5 file is assembled once all are done.
- ``.npy`` (through ``np.lib.format.open_memmap``; the file is preallocated, so a full disk is
  reported at creation rather than by SIGBUS in the middle). Outputs go to
  ``<stem>.outputs.npy`` and the manifest, with the column names, to ``<stem>.manifest.json``;
  such files that are not part of a finished output are refused unless ``overwrite=True``, and
  a file batchjac did not make is never deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import shutil
import stat
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import (
    InputError,
    StoreBusyError as StoreBusyError,
    StoreError as StoreError,
    StoreExistsError as StoreExistsError,
    StoreMismatchError as StoreMismatchError,
    StoreRecomputeWarning as StoreRecomputeWarning,
    StoreWriteError as StoreWriteError,
)
from ._io import InputFileError
from ._runner import chunk_bounds
from ._sinks import ArraySink
from ._spec import BatchSpec
from ._version import __version__

STORE_VERSION = 1
WORK_SUFFIX = ".partial"
MARKER = ".batchjac-work"
#: target size of one storage chunk of the Jacobians (rows are a divisor of the chunk size)
STORAGE_CHUNK_BYTES = 16 * 2**20
#: rows of the model's outputs on fixed random inputs, recorded to recognise the model
PROBE_ROWS = 4
PROBE_VALUES = 64

FORMAT_SUFFIXES = {".npy": "npy", ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".he5": "hdf5",
                   ".zarr": "zarr"}


@dataclass(frozen=True)
class Store:
    """Where and how to write a resumable result: ``jacobian(..., out=Store("jac.zarr"))``.

    ``out="jac.zarr"`` is short for ``out=Store("jac.zarr")``. ``overwrite`` replaces an
    output (or unfinished store) of a *different* job; an unfinished store of the same job is
    always resumed. ``model_id`` replaces the model's fingerprint (the command line passes the
    model file's hash). ``unknown_names``/``output_names`` label the columns in the metadata
    (by default the unknowns take the input file's column names, when it has any).
    """

    path: str | os.PathLike[str]
    overwrite: bool = False
    model_id: str | None = None
    unknown_names: Sequence[str] | None = None
    output_names: Sequence[str] | None = None


@dataclass(frozen=True)
class StoreResult:
    """What ``jacobian(..., out=path)`` returns: where the result is and how it was made."""

    path: str
    format: str
    rows: int
    mode: str
    chunk_size: int
    chunks: int
    computed_chunks: int
    resumed_chunks: int
    seconds: float
    shape: tuple[int, ...]
    outputs_shape: tuple[int, ...] | None

    def open(self, name: str = "jacobians") -> Any:
        """The stored array, read-only and lazy (``np.memmap``, h5py dataset or Zarr array)."""
        return open_store(self.path, name)

    def summary(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rows_per_second"] = self.rows / self.seconds if self.seconds > 0 else None
        return data


def is_store_target(out: Any) -> bool:
    return isinstance(out, (str, os.PathLike, Store))


def as_store(out: Any) -> Store:
    return out if isinstance(out, Store) else Store(out)


def format_of(path: str | os.PathLike[str]) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMAT_SUFFIXES:
        raise InputFileError(
            f"Unknown output format {suffix or '(no suffix)'!r} for {os.fspath(path)!r}; batchjac "
            f"writes .npy, .h5/.hdf5 (HDF5) and .zarr (Zarr)."
        )
    return FORMAT_SUFFIXES[suffix]


def open_store(path: str | os.PathLike[str], name: str = "jacobians") -> Any:
    """Open array ``name`` ("jacobians" or "outputs") of a finished store, read-only."""
    fmt = _FORMATS[format_of(path)]
    out = Path(path)
    if fmt.read_manifest(out) is None:
        raise InputFileError(f"{os.fspath(path)!r} is not a finished batchjac output.")
    return fmt.open(out, name)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a finished store, or None if ``path`` is not one."""
    return _FORMATS[format_of(path)].read_manifest(Path(path))


# -- array descriptions ---------------------------------------------------------------------

@dataclass(frozen=True)
class ArrayInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk_rows: int
    dims: tuple[str, ...]
    attrs: dict[str, Any]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * np.dtype(self.dtype).itemsize


def _fill(dtype: str) -> Any:
    """Fill value of unwritten elements: NaN for floats, 0 for integers and booleans."""
    kind = np.dtype(dtype).kind
    return float("nan") if kind == "f" else (False if kind == "b" else 0)


def _dims(prefix: str, shape: tuple[int, ...]) -> list[str]:
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


# -- formats --------------------------------------------------------------------------------

class ChunkWriter:
    """Writes computed chunks into the work directory's data and makes them durable."""

    def write(self, index: int, lo: int, hi: int, arrays: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release files (idempotent)."""


class Format:
    name: str

    def final_paths(self, out: Path) -> list[Path]:
        """Every path the finished output occupies (the main one first)."""
        return [out]

    def create(self, data: Path, arrays: list[ArrayInfo]) -> None:
        raise NotImplementedError

    def writer(self, data: Path, arrays: list[ArrayInfo]) -> ChunkWriter:
        raise NotImplementedError

    def clean(self, data: Path) -> None:
        """Remove temporaries a kill may have left in the data (before resuming)."""

    def reclaim(self, data: Path, out: Path, manifest: dict[str, Any]) -> None:
        """Before resuming: undo the first steps of a commit a kill interrupted before its
        commit point (data already moved out of the work directory is moved back)."""

    def read_chunk(self, data: Path, arrays: list[ArrayInfo], index: int, lo: int,
                   hi: int) -> list[np.ndarray]:
        """Rows ``lo:hi`` of every array as stored in the data (to check a done chunk against
        the digest of its result)."""
        raise NotImplementedError

    def foreign_siblings(self, out: Path, work: _WorkDir) -> list[Path]:
        """Files beside ``out`` where the output would go (other than ``out``) that exist
        and are not part of this store (when ``out`` is not a finished output)."""
        return []

    def commit(self, data: Path, out: Path, manifest: dict[str, Any], arrays: list[ArrayInfo],
               n_chunks: int) -> None:
        """Write the final manifest into the data and move it to ``out`` (idempotent: it may
        be run again after a kill in the middle)."""
        raise NotImplementedError

    def read_manifest(self, out: Path) -> dict[str, Any] | None:
        raise NotImplementedError

    def open(self, out: Path, name: str) -> Any:
        raise NotImplementedError

    def removable(self, out: Path) -> bool:
        """Whether ``out`` may be deleted to overwrite it (never a directory that is not ours)."""
        return out.is_file() or out.is_symlink()

    def remove(self, out: Path) -> None:
        for p in self.final_paths(out):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()


class NpyFormat(Format):
    name = "npy"

    def final_paths(self, out: Path) -> list[Path]:
        stem = out.name[: -len(out.suffix)] if out.suffix else out.name
        return [out, out.with_name(stem + ".outputs.npy"), out.with_name(stem + ".manifest.json")]

    def create(self, data: Path, arrays: list[ArrayInfo]) -> None:
        for a in arrays:
            create_npy(data / f"{a.name}.npy", a)

    def writer(self, data: Path, arrays: list[ArrayInfo]) -> ChunkWriter:
        return _NpyWriter(data, arrays)

    def _committing(self, out: Path, stored: dict[str, Any] | None) -> bool:
        """Whether the sidecar manifest beside ``out`` is the one the commit of the store
        ``stored`` (its work manifest) writes first: that commit was interrupted."""
        sidecar = self.final_paths(out)[2]
        side = _load_manifest(sidecar) if stored is not None and os.path.lexists(sidecar) else None
        return side is not None and stored is not None and all(
            side.get(k) == stored.get(k) for k in ("job", "plan", "arrays"))

    def reclaim(self, data: Path, out: Path, manifest: dict[str, Any]) -> None:
        # commit moves the outputs file out, then the Jacobians (the commit point); killed in
        # between, the outputs file is beside the output, under the sidecar manifest that
        # commit wrote first for this very store
        outputs_path = self.final_paths(out)[1]
        src = data / "outputs.npy"
        if "outputs" not in manifest.get("arrays", {}) or os.path.lexists(src) \
                or not os.path.lexists(data / "jacobians.npy"):
            return
        if self._committing(out, manifest):
            _check_regular(outputs_path)
            os.replace(outputs_path, src)

    def foreign_siblings(self, out: Path, work: _WorkDir) -> list[Path]:
        _, outputs_path, sidecar = self.final_paths(out)
        stored = None
        with contextlib.suppress(StoreError):  # a work dir with links is dealt with later
            stored = work.manifest()
        ours = self._committing(out, stored)
        found = []
        if os.path.lexists(sidecar) and not ours:
            found.append(sidecar)
        if os.path.lexists(outputs_path) and not (
                ours and stored is not None and "outputs" in stored.get("arrays", {})):
            found.append(outputs_path)
        return found

    def read_chunk(self, data: Path, arrays: list[ArrayInfo], index: int, lo: int,
                   hi: int) -> list[np.ndarray]:
        return [read_npy_rows(data / f"{a.name}.npy", a, lo, hi) for a in arrays]

    def commit(self, data: Path, out: Path, manifest: dict[str, Any], arrays: list[ArrayInfo],
               n_chunks: int) -> None:
        jac_path, outputs_path, sidecar = self.final_paths(out)
        names = {a.name for a in arrays}
        if "outputs" not in names and os.path.lexists(outputs_path):
            # the outputs of the output being replaced (its manifest, still there, lists them)
            # would describe other Jacobians; a file batchjac did not make is never deleted
            old = _load_manifest(sidecar) if os.path.lexists(sidecar) else None
            if old is not None and "outputs" in old.get("arrays", {}):
                outputs_path.unlink()
        write_json_atomic(sidecar, manifest)
        if "outputs" in names:
            _move(data / "outputs.npy", outputs_path)
        _move(data / "jacobians.npy", jac_path)  # the commit point
        fsync_dir(out.parent)

    def read_manifest(self, out: Path) -> dict[str, Any] | None:
        sidecar = self.final_paths(out)[2]
        if not (out.is_file() and sidecar.is_file()):
            return None
        manifest = _load_manifest(sidecar)
        if not _is_complete_manifest(manifest):
            return None
        assert manifest is not None
        try:
            shape = tuple(np.load(out, mmap_mode="r").shape)
        except (OSError, ValueError):
            return None
        if shape != tuple(manifest.get("arrays", {}).get("jacobians", {}).get("shape", ())):
            return None  # the .npy was replaced by something else
        return manifest

    def open(self, out: Path, name: str) -> Any:
        jac_path, outputs_path, sidecar = self.final_paths(out)
        path = {"jacobians": jac_path, "outputs": outputs_path}.get(name)
        listed = (_load_manifest(sidecar) or {}).get("arrays", {})
        if path is None or not path.exists() or name not in listed:  # not a file of another
            raise InputFileError(f"{os.fspath(out)!r} has no array {name!r}.")
        return np.load(path, mmap_mode="r")


class _NpyWriter(ChunkWriter):
    def __init__(self, data: Path, arrays: list[ArrayInfo]) -> None:
        self.maps = {a.name: map_npy(data / f"{a.name}.npy", a) for a in arrays}
        self.sink = ArraySink(self.maps)

    def write(self, index: int, lo: int, hi: int, arrays: dict[str, np.ndarray]) -> None:
        # ArraySink flushes (msync) the rows written and drops their pages from memory
        self.sink.write(lo, hi, arrays)

    def close(self) -> None:
        maps, self.maps = self.maps, {}
        self.sink = None  # type: ignore[assignment]
        for mm in maps.values():  # the mappings close when the last reference goes
            mm.flush()


class ZarrFormat(Format):
    name = "zarr"

    def _zarr(self) -> Any:
        try:
            import zarr
        except ImportError:
            raise InputError("Writing Zarr stores needs zarr: pip install batchjac[io].") from None
        return zarr

    def create(self, data: Path, arrays: list[ArrayInfo]) -> None:
        zarr = self._zarr()
        from zarr.codecs import BloscCodec

        root = zarr.open_group(str(data / "store.zarr"), mode="w", zarr_format=3)
        for a in arrays:
            root.create_array(
                a.name, shape=a.shape, dtype=a.dtype, chunks=(a.chunk_rows, *a.shape[1:]),
                # measured on Jacobian chunks: faster than zstd, and a better ratio
                compressors=[BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle")],
                fill_value=_fill(a.dtype), dimension_names=list(a.dims), attributes=a.attrs,
                # all-zero chunks are still written: the files do not depend on the values
                config={"write_empty_chunks": True},
            )
        fsync_tree(data / "store.zarr")

    def writer(self, data: Path, arrays: list[ArrayInfo]) -> ChunkWriter:
        return _ZarrWriter(self._zarr(), data / "store.zarr", arrays)

    def clean(self, data: Path) -> None:
        # zarr writes each chunk file as "<name>.<uuid>.partial" and renames it into place
        for root, _, files in os.walk(data / "store.zarr"):
            for name in files:
                if name.endswith(".partial"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(root, name))

    def read_chunk(self, data: Path, arrays: list[ArrayInfo], index: int, lo: int,
                   hi: int) -> list[np.ndarray]:
        group = self._zarr().open_group(str(data / "store.zarr"), mode="r")
        return [np.asarray(group[a.name][lo:hi]) for a in arrays]

    def commit(self, data: Path, out: Path, manifest: dict[str, Any], arrays: list[ArrayInfo],
               n_chunks: int) -> None:
        src = data / "store.zarr"
        if src.exists():
            group = self._zarr().open_group(str(src), mode="r+")
            group.attrs["batchjac"] = manifest
            fsync_file(src / "zarr.json")
            if out.exists():  # an output being overwritten (checked removable before)
                self.remove(out)
            os.rename(src, out)  # the commit point
        elif not out.exists():
            raise StoreWriteError(f"The finished Zarr store {os.fspath(src)!r} is missing.")
        fsync_dir(out.parent)

    def read_manifest(self, out: Path) -> dict[str, Any] | None:
        if not (out / "zarr.json").is_file():
            return None
        try:
            group = self._zarr().open_group(str(out), mode="r")
            manifest = group.attrs.get("batchjac")
        except Exception:
            return None
        return manifest if _is_complete_manifest(manifest) else None

    def open(self, out: Path, name: str) -> Any:
        group = self._zarr().open_group(str(out), mode="r")
        if name not in group:
            raise InputFileError(f"{os.fspath(out)!r} has no array {name!r}.")
        return group[name]

    def removable(self, out: Path) -> bool:
        if out.is_dir():
            return any((out / n).exists() for n in ("zarr.json", ".zgroup", ".zarray"))
        return super().removable(out)


class _ZarrWriter(ChunkWriter):
    def __init__(self, zarr: Any, path: Path, arrays: list[ArrayInfo]) -> None:
        group = zarr.open_group(str(path), mode="r+")
        self.path = path
        self.arrays = {a.name: (group[a.name], a) for a in arrays}

    def write(self, index: int, lo: int, hi: int, arrays: dict[str, np.ndarray]) -> None:
        for name, values in arrays.items():
            arr, info = self.arrays[name]
            arr[lo:hi] = values
            base = self.path / name / "c"
            for r in range(lo // info.chunk_rows, -(-hi // info.chunk_rows)):
                fsync_tree(base / str(r))
            fsync_dir(base)


class HDF5Format(Format):
    name = "hdf5"

    def _h5py(self) -> Any:
        try:
            import h5py
        except ImportError:
            raise InputError("Writing HDF5 files needs h5py: pip install batchjac[io].") from None
        return h5py

    def create(self, data: Path, arrays: list[ArrayInfo]) -> None:
        (data / "chunks").mkdir(parents=True, exist_ok=True)
        self._h5py()

    def writer(self, data: Path, arrays: list[ArrayInfo]) -> ChunkWriter:
        return _StagedWriter(data / "chunks")

    def clean(self, data: Path) -> None:
        for p in (data / "chunks").glob("*.tmp"):
            with contextlib.suppress(OSError):
                p.unlink()
        with contextlib.suppress(OSError):
            (data / "out.h5.tmp").unlink()

    def read_chunk(self, data: Path, arrays: list[ArrayInfo], index: int, lo: int,
                   hi: int) -> list[np.ndarray]:
        return [load_npy(data / "chunks" / f"{index:08d}.{a.name}.npy") for a in arrays]

    def commit(self, data: Path, out: Path, manifest: dict[str, Any], arrays: list[ArrayInfo],
               n_chunks: int) -> None:
        h5py = self._h5py()
        tmp = data / "out.h5.tmp"
        staged = data / "chunks"
        if not os.path.lexists(data / "out.h5"):
            plan = manifest["plan"]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a stale one (or a link planted there: removed, not followed)
            with h5py.File(tmp, "x") as f:  # created exclusively (O_EXCL): no link is followed
                dsets = {}
                for a in arrays:
                    dsets[a.name] = f.create_dataset(
                        a.name, shape=a.shape, dtype=np.dtype(a.dtype),
                        chunks=(max(1, a.chunk_rows), *a.shape[1:]) if a.shape[0] else None,
                        compression="gzip", compression_opts=1, shuffle=True,
                        fillvalue=_fill(a.dtype))
                    for key, value in a.attrs.items():  # names: datasets, attributes are small
                        if key not in f:
                            f.create_dataset(key, data=np.array(value, dtype=h5py.string_dtype()))
                    dsets[a.name].attrs["dimension_names"] = np.array(a.dims, dtype=h5py.string_dtype())
                cs, n = plan["chunk_size"], plan["rows"]
                for index in range(n_chunks):
                    lo, hi = index * cs, min(n, (index + 1) * cs)
                    for a in arrays:
                        dsets[a.name][lo:hi] = load_npy(staged / f"{index:08d}.{a.name}.npy")
                f.attrs["batchjac"] = json.dumps(manifest, sort_keys=True)
            fsync_file(tmp)
            os.replace(tmp, data / "out.h5")
        _check_regular(data / "out.h5")
        os.replace(data / "out.h5", out)  # the commit point (replaces an overwritten output)
        fsync_dir(out.parent)

    def read_manifest(self, out: Path) -> dict[str, Any] | None:
        if not out.is_file():
            return None
        try:
            with self._h5py().File(out, "r") as f:
                text = f.attrs.get("batchjac")
        except Exception:
            return None
        if text is None:
            return None
        try:
            manifest = json.loads(text)
        except ValueError:
            return None
        return manifest if _is_complete_manifest(manifest) else None

    def open(self, out: Path, name: str) -> Any:
        f = self._h5py().File(out, "r")
        if name not in f:
            f.close()
            raise InputFileError(f"{os.fspath(out)!r} has no dataset {name!r}.")
        return f[name]


class _StagedWriter(ChunkWriter):
    def __init__(self, staged: Path) -> None:
        self.staged = staged

    def write(self, index: int, lo: int, hi: int, arrays: dict[str, np.ndarray]) -> None:
        with contextlib.suppress(FileNotFoundError):  # assembled before: not from this chunk
            os.unlink(self.staged.parent / "out.h5")
        for name, values in arrays.items():
            final = self.staged / f"{index:08d}.{name}.npy"
            tmp = final.with_name(final.name + ".tmp")
            try:
                with os.fdopen(create_new(tmp), "wb") as f:
                    np.save(f, values)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
        fsync_dir(self.staged)


_FORMATS: dict[str, Format] = {"npy": NpyFormat(), "zarr": ZarrFormat(), "hdf5": HDF5Format()}


# -- durable file operations ----------------------------------------------------------------

def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fsync_file(path)


def fsync_tree(path: Path) -> None:
    if not path.exists():
        return
    if path.is_file():
        fsync_file(path)
        return
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(Path(root, name))
        fsync_dir(Path(root))


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with os.fdopen(create_new(tmp), "w") as f:
            json.dump(data, f, sort_keys=True, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def _move(src: Path, dst: Path) -> None:
    """Rename ``src`` (a regular file of the work directory) to ``dst``; already done (after a
    kill in the middle) is fine."""
    if os.path.lexists(src):
        _check_regular(src)
        os.replace(src, dst)
    elif not dst.exists():
        raise StoreWriteError(f"The finished data {os.fspath(src)!r} is missing.")


def _load_manifest(path: Path, follow: bool = True) -> dict[str, Any] | None:
    """The manifest in ``path``, or None; ``follow=False`` for work files: a link there is
    refused (StoreError), not read."""
    try:
        with (open(path) if follow else os.fdopen(open_regular(path), "r")) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "job" in manifest else None


# -- work files: never through a link ---------------------------------------------------------

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class _NotRegularFileError(StoreError):
    def __init__(self, path: Path | str) -> None:
        self.path = os.fspath(path)
        super().__init__(
            f"{self.path!r} is a symbolic link or not a regular file. batchjac does not follow "
            f"links in its work files: it would write the remaining chunks into, read kept chunks "
            f"from, or commit as the output, whatever the link points to.")


def _check_regular(path: Path | str) -> None:
    """Refuse ``path`` unless it is a regular file (a link is not followed)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise _NotRegularFileError(path)


def open_regular(path: Path | str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file ``path``, opened without following a link at its
    last component (``O_NOFOLLOW``) and checked (``fstat``) to be a regular file; a link, a
    FIFO or a device is refused with a StoreError naming it."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        if os.path.islink(path):
            raise _NotRegularFileError(path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _NotRegularFileError(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_new(path: Path | str, mode: int = 0o666) -> int:
    """A descriptor of a new regular file ``path`` opened for writing. A stale file under that
    name (a temporary left by a kill) is removed first; a link there is removed itself, never
    followed, and the file is created exclusively (``O_EXCL``), so no link is written through."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)


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


def _is_complete_manifest(manifest: Any) -> bool:
    return isinstance(manifest, dict) and manifest.get("complete") is True and "job" in manifest


# -- hashing --------------------------------------------------------------------------------

def hash_arrays(arrays: Sequence[np.ndarray]) -> str:
    sha = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        sha.update(f"{a.dtype.str}{a.shape}".encode())
        sha.update(a.view(np.uint8).reshape(-1).data if a.size else b"")
    return sha.hexdigest()


def _digest(hashes: Sequence[str]) -> str:
    return hashlib.sha256("".join(hashes).encode()).hexdigest()


# -- the job --------------------------------------------------------------------------------

def _jsonable(value: Any) -> Any:
    """Tuples as lists, numpy scalars as Python numbers, keys sorted: what a JSON round trip
    gives (so a manifest written fresh and one read back from disk serialise alike)."""
    return json.loads(json.dumps(value, default=_json_default, sort_keys=True))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.dtype):
        return obj.name
    return repr(obj)


def _names_of(arr: Any) -> tuple[str, ...] | None:
    return getattr(arr, "columns", None)


def unknown_names(spec: BatchSpec) -> list[str] | None:
    """Column names of the unknowns, when the input they come from has column names."""
    lay = spec.layout
    target = spec.arrays[0 if lay.kind == "concat" else lay.wrt_index]
    names = _names_of(target)
    if names is None or len(spec.unknown_shape) != 1:
        return None
    if lay.kind != "concat" and lay.columns is not None:
        return [names[c] for c in lay.columns]
    return list(names)


def _check_names(names: Sequence[str] | None, shape: tuple[int, ...], what: str) -> list[str] | None:
    if names is None:
        return None
    names = [str(n) for n in names]
    if len(shape) != 1 or len(names) != shape[0]:
        raise InputError(f"{len(names)} {what} names were given, but the {what}s have shape "
                         f"{shape}; give one name per {what} (a 1-D {what} axis).")
    return names


def _framework_version(backend: str) -> str:
    from ._backends import REGISTRY

    module = sys.modules.get(REGISTRY.get(backend, ("", backend, ""))[1])
    return f"{backend} {getattr(module, '__version__', '?')}"


def _probe(bound: Any, spec: BatchSpec) -> dict[str, Any]:
    """The model's outputs on fixed random inputs (shapes and dtypes of this batch)."""
    rng = np.random.default_rng(20240611)
    u = rng.standard_normal((PROBE_ROWS, *spec.unknown_shape)).astype(spec.dtype)
    ctx = []
    for shape, dt in spec.ctx_specs():
        dt = np.dtype(dt)
        if dt.kind == "f":
            ctx.append(rng.standard_normal((PROBE_ROWS, *shape)).astype(dt))
        else:
            ctx.append(np.zeros((PROBE_ROWS, *shape), dt))
    y = np.asarray(bound.forward(u, tuple(ctx)), dtype=np.float64).reshape(-1)
    finite = y[np.isfinite(y)]
    # non-finite values as None: JSON (and Zarr attributes) have no NaN
    return {"values": [float(v) if np.isfinite(v) else None for v in y[:PROBE_VALUES]],
            "abs_sum": float(np.abs(finite).sum()), "size": int(y.size)}


def _same_probe(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.get("size") != b.get("size") or len(a.get("values", ())) != len(b.get("values", ())):
        return False
    va = np.array([np.nan if v is None else v for v in a["values"]], np.float64)
    vb = np.array([np.nan if v is None else v for v in b["values"]], np.float64)
    if not np.array_equal(np.isfinite(va), np.isfinite(vb)):
        return False
    scale = max(float(np.abs(va[np.isfinite(va)]).max()) if np.isfinite(va).any() else 0.0, 1e-30)
    close = np.allclose(va[np.isfinite(va)], vb[np.isfinite(vb)], rtol=1e-4, atol=1e-5 * scale)
    sa, sb = float(a["abs_sum"]), float(b["abs_sum"])
    return bool(close and abs(sa - sb) <= 1e-4 * max(abs(sa), abs(sb), 1e-30))


def _difference(stored: Any, now: Any, path: str = "") -> str | None:
    """The first leaf where two JSON values differ, as 'path: stored X, now Y'."""
    if isinstance(stored, dict) and isinstance(now, dict):
        for key in sorted(set(stored) | set(now)):
            found = _difference(stored.get(key), now.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(stored, list) and isinstance(now, list) and len(stored) == len(now):
        for i, (s, n) in enumerate(zip(stored, now)):
            found = _difference(s, n, f"{path}[{i}]")
            if found:
                return found
        return None
    if stored != now:
        show = [v if len(repr(v)) < 80 else repr(v)[:77] + "..." for v in (stored, now)]
        return f"{path}: the store has {show[0]!r}, this call {show[1]!r}"
    return None


# -- the run --------------------------------------------------------------------------------

class _WorkDir:
    """``OUT.partial/``: marker, lock, manifest, done records and the data being written."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = Path(os.fspath(out) + WORK_SUFFIX)
        self.manifest_path = self.path / "manifest.json"
        self.done = self.path / "done"
        self.data = self.path / "data"
        self._lock_fd: int | None = None

    def ours(self) -> bool:
        """Made by batchjac (marker), or an empty directory (a kill right after mkdir); never
        a link to a directory (batchjac would work in whatever it points to)."""
        if not os.path.lexists(self.path):
            return True
        if self.path.is_symlink() or not self.path.is_dir():
            return False
        return (self.path / MARKER).exists() or not any(self.path.iterdir())

    def claim(self) -> None:
        self.path.mkdir(exist_ok=True)
        marker = self.path / MARKER
        if not os.path.isfile(marker) or marker.is_symlink():
            with os.fdopen(create_new(marker), "w") as f:
                f.write(f"Unfinished batchjac output for {self.out.name}: run the same "
                        f"command again to continue, or delete this directory.\n")
        self._lock()

    def _lock(self) -> None:
        import fcntl

        lock = self.path / "lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
        except OSError:
            if lock.is_symlink():
                raise StoreError(
                    f"{os.fspath(lock)!r} is a symbolic link; batchjac does not follow links in "
                    f"its work directory. Delete {os.fspath(self.path)!r} (an unfinished batchjac "
                    f"output) and run again.") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreBusyError(
                f"{os.fspath(self.out)!r} is being written by another process (it holds "
                f"{os.fspath(self.path / 'lock')!r}); wait for it to finish or stop it."
            ) from None
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def manifest(self) -> dict[str, Any] | None:
        if not os.path.lexists(self.manifest_path):
            return None
        return _load_manifest(self.manifest_path, follow=False)

    def unsafe_entry(self) -> Path | None:
        """The first entry of the work directory that is neither a regular file nor a
        directory (a symbolic link, a FIFO, a device...), or None."""
        for root, dirs, files in os.walk(self.path):  # links to directories are not entered
            for name in sorted(dirs + files):
                path = os.path.join(root, name)
                try:
                    mode = os.lstat(path).st_mode
                except FileNotFoundError:
                    continue
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    return Path(path)
        return None

    def vet(self, overwrite: bool) -> None:
        """Before anything in the work directory is used: refuse one holding links or other
        non-regular files (a link planted there would be written through, read from and
        committed as the output), or, with ``overwrite``, discard it (removing the links, never
        what they point to). Needs the lock (:meth:`claim`)."""
        bad = self.unsafe_entry()
        if bad is None:
            return
        if overwrite:
            self.reset()
            return
        raise StoreError(
            f"{_NotRegularFileError(bad)} It is in the unfinished store "
            f"{os.fspath(self.path)!r}, which batchjac will not resume. Pass overwrite=True "
            f"(--overwrite) to discard it and start again (the link is removed, not what it "
            f"points to), or delete that directory.")

    def forget(self, index: int) -> None:
        """Drop the done record of chunk ``index`` (it is computed again)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.done / f"{index:08d}.json")

    def reset(self) -> None:
        """Empty the directory but for its marker and lock (a fresh start)."""
        with contextlib.suppress(FileNotFoundError):
            self.manifest_path.unlink()  # first: without it nothing below counts as done
        fsync_dir(self.path)
        for child in self.path.iterdir():
            if child.name in (MARKER, "lock"):
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def done_records(self, n_chunks: int, chunk_size: int, n: int) -> dict[int, dict[str, Any]]:
        records: dict[int, dict[str, Any]] = {}
        if not self.done.exists():
            return records
        for entry in os.listdir(self.done):
            if not re.fullmatch(r"\d{8}\.json", entry):
                if entry.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(self.done / entry)
                continue
            rec = _load_record(self.done / entry)
            index = int(entry[:8])
            lo, hi = index * chunk_size, min(n, (index + 1) * chunk_size)
            if rec is None or index >= n_chunks or rec.get("lo") != lo or rec.get("hi") != hi:
                continue
            records[index] = rec
        return records

    def record(self, index: int, lo: int, hi: int, input_hash: str, result_hash: str,
               extra: dict[str, Any] | None = None) -> None:
        """Mark chunk ``index`` done (atomic); ``extra`` is kept in the record (small, JSON)."""
        path = self.done / f"{index:08d}.json"
        tmp = self.done / f"{index:08d}.json.tmp"
        data = json.dumps({**(extra or {}), "index": index, "lo": lo, "hi": hi,
                           "input": input_hash, "result": result_hash}, sort_keys=True)
        try:
            with os.fdopen(create_new(tmp), "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def remove(self) -> None:
        """Delete the work directory. It is renamed away first (atomic), so a kill in the
        middle of deleting it never leaves a half-deleted work directory (without its marker)
        under its name; the renamed remains are swept by the next run (:meth:`sweep`)."""
        self.release()
        trash = self.path.with_name(f"{self.path.name}.removed-{os.getpid()}-{time.time_ns()}")
        try:
            os.rename(self.path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def sweep(self) -> None:
        """Delete the remains of work directories whose deletion was interrupted."""
        prefix = f"{self.path.name}.removed-"
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.path.parent):
                if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)


def _load_record(path: Path) -> dict[str, Any] | None:
    try:
        with os.fdopen(open_regular(path), "r") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _write_error(e: OSError, out: Path, what: str) -> StoreWriteError:
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    reason = "the disk is full" if full else (e.strerror or str(e))
    hint = ("Free some space and run the same command again: finished chunks are kept and the "
            "output stays marked incomplete until every chunk is written." if full else
            "Fix the cause and run the same command again: finished chunks are kept.")
    return StoreWriteError(f"Writing {what} of {os.fspath(out)!r} failed: {reason} "
                           f"({type(e).__name__}: {e}). {hint}", e.errno)


def compute_to_store(
    model: Any,
    spec: BatchSpec,
    backend: str,
    *,
    store: Store,
    mode: str,
    chunk_size: int | None,
    max_memory: int | str | None,
    return_outputs: bool,
    nan_policy: str,
    options: dict[str, Any],
    explain: bool,
    progress: bool | Callable[[int], None],
    compute_chunks: Callable[..., None] | None = None,
) -> StoreResult:
    """Compute into a resumable store (see the module docstring for the guarantees).

    ``compute_chunks`` computes and writes the chunks still to do (the local threaded loop by
    default); the Dask path hands in one whose workers compute and write them (same records,
    same guarantees; only input rows and small records pass through this process)."""
    from ._bind import plan_for, prepare

    start = time.perf_counter()
    out = Path(store.path)
    fmt = _FORMATS[format_of(out)]
    work = _WorkDir(out)

    work.sweep()
    existing = check_target(out, fmt, work, store.overwrite)

    bound = prepare(model, spec, backend, options)
    assert bound.output_shape is not None
    job, arrays_meta = _describe_job(spec, backend, bound.output_shape, store, mode, chunk_size,
                                     max_memory, return_outputs, options, model, nan_policy)
    probe = _probe(bound, spec)

    if existing is not None:  # a finished output: the same job has nothing left to do
        problem = _job_problem(existing, job, probe)
        if problem is None:
            problem = _verify_complete(existing, spec)
        if problem is None:
            if work.path.exists() and (work.path / MARKER).exists():
                work.remove()  # left over from a kill after the commit
            plan = existing["plan"]
            return _result(out, fmt, plan, arrays_meta, computed=0, resumed=plan["chunks"],
                           seconds=time.perf_counter() - start)
        if not store.overwrite:
            raise StoreMismatchError(
                f"The output {os.fspath(out)!r} exists and was made by a different job ({problem}). "
                f"Choose another output path, or pass overwrite=True (--overwrite) to replace it."
            )

    _ensure_parent(out)
    try:
        work.claim()
    except OSError as e:
        raise _write_error(e, out, "the work directory") from e
    try:
        work.vet(store.overwrite)
        compute = _compute_chunks if compute_chunks is None else compute_chunks
        return _run(bound, spec, fmt, work, out, store, job, arrays_meta, probe, mode=mode,
                    chunk_size=chunk_size, max_memory=max_memory, return_outputs=return_outputs,
                    explain=explain, progress=progress, start=start, plan_for=plan_for,
                    compute=compute)
    finally:
        work.release()


def check_target(out: Path, fmt: Format, work: _WorkDir, overwrite: bool,
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


def _ensure_parent(out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_error(e, out, "the output's directory") from e


def _describe_job(spec: BatchSpec, backend: str, output_shape: tuple[int, ...], store: Store,
                  mode: str, chunk_size: int | None, max_memory: int | str | None,
                  return_outputs: bool, options: dict[str, Any], model: Any, nan_policy: str
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    from ._fingerprint import model_fingerprint

    fingerprint = store.model_id or model_fingerprint(model)
    u_names = _check_names(store.unknown_names, spec.unknown_shape, "unknown")
    if u_names is None:
        u_names = unknown_names(spec)
    y_names = _check_names(store.output_names, output_shape, "output")
    inputs = [{"shape": list(a.shape), "dtype": np.dtype(a.dtype).name,
               "columns": list(cols) if (cols := _names_of(a)) is not None else None}
              for a in spec.arrays]
    job = _jsonable({
        "batchjac": __version__,
        "framework": _framework_version(backend),
        "model": fingerprint,
        "inputs": inputs,
        "layout": dataclasses.asdict(spec.layout),
        "options": {
            "dtype": spec.dtype.name, "mode": mode, "chunk_size": chunk_size,
            "max_memory": max_memory, "nan_policy": nan_policy,
            "with_outputs": return_outputs, "backend": backend, "backend_options": options,
            "format": format_of(store.path), "unknown_names": u_names, "output_names": y_names,
        },
    })
    arrays_meta = {"unknown_names": u_names, "output_names": y_names,
                   "output_shape": list(output_shape)}
    return job, arrays_meta


def _job_problem(stored: dict[str, Any], job: dict[str, Any], probe: dict[str, Any]) -> str | None:
    if stored.get("store_version") != STORE_VERSION:
        return f"store format version {stored.get('store_version')!r}, this batchjac writes {STORE_VERSION}"
    diff = _difference(stored.get("job"), job)
    if diff is not None:
        return diff
    if not _same_probe(stored.get("probe", {}), probe):
        return ("the model's outputs on fixed probe inputs differ from those recorded: it is not "
                "the model the store was made with")
    return None


def _settle_variant(bound: Any, spec: BatchSpec, mode: str, chunk_size: int,
                    with_outputs: bool) -> str | None:
    """The kernel implementation every chunk of the store is computed with, recorded in the
    plan so that resumed chunks and chunks computed on Dask workers use it too: the backend's
    first variant (XLA for TensorFlow), never a timed choice, because two uninterrupted runs
    of the same command must write the same bytes as well."""
    del spec
    kernel = bound.kernel(mode, chunk_size, with_outputs)
    variant: str = kernel.variants[0]
    kernel.use(variant)
    return variant


def _rows(index: int, chunk_size: int, n: int) -> tuple[int, int]:
    chunk = chunk_bounds(index, chunk_size, n)
    return chunk.lo, chunk.hi


def _input_hash(spec: BatchSpec, lo: int, hi: int) -> tuple[str, np.ndarray, tuple[np.ndarray, ...]]:
    u, ctx = spec.chunk(lo, hi)
    return hash_arrays([u, *ctx]), u, ctx


def _verify_complete(manifest: dict[str, Any], spec: BatchSpec) -> str | None:
    plan = manifest["plan"]
    hashes = [_input_hash(spec, *_rows(i, plan["chunk_size"], plan["rows"]))[0]
              for i in range(plan["chunks"])]
    if _digest(hashes) != manifest.get("digests", {}).get("inputs"):
        return "the input rows differ from those the output was computed from"
    return None


def _arrays(plan: dict[str, Any], meta: dict[str, Any], spec: BatchSpec, with_outputs: bool
            ) -> list[ArrayInfo]:
    n, y_shape = plan["rows"], tuple(meta["output_shape"])
    j_shape = (n, *y_shape, *spec.unknown_shape)
    attrs = {k: meta[k] for k in ("unknown_names", "output_names") if meta.get(k) is not None}
    row_bytes = math.prod(j_shape[1:]) * spec.dtype.itemsize
    rows = storage_rows(plan["chunk_size"], row_bytes, n)
    infos = [ArrayInfo("jacobians", j_shape, spec.dtype.name, rows,
                       ("row", *_dims("output", y_shape), *_dims("unknown", spec.unknown_shape)), attrs)]
    if with_outputs:
        y_attrs = {"output_names": meta["output_names"]} if meta.get("output_names") else {}
        infos.append(ArrayInfo("outputs", (n, *y_shape), spec.dtype.name, rows,
                               ("row", *_dims("output", y_shape)), y_attrs))
    return infos


def _run(bound: Any, spec: BatchSpec, fmt: Format, work: _WorkDir, out: Path, store: Store,
         job: dict[str, Any], meta: dict[str, Any], probe: dict[str, Any], *, mode: Any,
         chunk_size: int | None, max_memory: int | str | None, return_outputs: bool, explain: bool,
         progress: bool | Callable[[int], None], start: float, plan_for: Any,
         compute: Callable[..., None]) -> StoreResult:
    stored = work.manifest()
    if stored is not None:
        problem = _job_problem(stored, job, probe)
        if problem is not None:
            if not store.overwrite:
                raise StoreMismatchError(
                    f"{os.fspath(out)!r} has an unfinished store in {os.fspath(work.path)!r} made "
                    f"by a different job ({problem}). Pass overwrite=True (--overwrite) to discard "
                    f"it and start again, or choose another output path."
                )
            stored = None
    if stored is None:
        work.reset()
        planned = plan_for(spec, bound, mode=mode, chunk_size=chunk_size, max_memory=max_memory)
        plan = {"mode": planned.mode, "chunk_size": planned.chunk_size,
                "chunks": planned.n_chunks, "rows": spec.n, "reason": planned.reason,
                "variant": _settle_variant(bound, spec, planned.mode, planned.chunk_size,
                                           return_outputs)}
        arrays = _arrays(plan, meta, spec, return_outputs)
        manifest: dict[str, Any] = {
            "store_version": STORE_VERSION, "complete": False, "job": job, "plan": plan,
            "probe": probe, "metadata": meta,
            "arrays": {a.name: {"shape": list(a.shape), "dtype": a.dtype, "chunk_rows": a.chunk_rows}
                       for a in arrays},
        }
        try:
            work.data.mkdir()
            work.done.mkdir()
            fmt.create(work.data, arrays)
            write_json_atomic(work.manifest_path, _jsonable(manifest))  # the store now exists
        except OSError as e:
            raise _write_error(e, out, "the new store") from e
        manifest = _jsonable(manifest)
    else:
        manifest = dict(stored)
        plan = manifest["plan"]
        arrays = _arrays(plan, manifest["metadata"], spec, return_outputs)
        try:
            fmt.reclaim(work.data, out, manifest)
        except OSError as e:
            raise _write_error(e, out, "the store") from e
        fmt.clean(work.data)

    if explain:
        sys.stderr.write(f"batchjac: {plan['reason']}\n")
    cs, n, n_chunks = plan["chunk_size"], plan["rows"], plan["chunks"]
    done = work.done_records(n_chunks, cs, n)
    for index in sorted(done):  # the rows behind every kept result must be the same rows
        if _input_hash(spec, *_rows(index, cs, n))[0] != done[index]["input"]:
            lo, hi = _rows(index, cs, n)
            problem = (f"rows {lo}:{hi} of the inputs differ from those chunk {index} was "
                       f"computed from")
            if not store.overwrite:
                raise StoreMismatchError(
                    f"{os.fspath(out)!r} has an unfinished store in {os.fspath(work.path)!r} made "
                    f"from other inputs ({problem}). Pass overwrite=True (--overwrite) to discard "
                    f"it and start again, or choose another output path.")
            work.reset()
            return _run(bound, spec, fmt, work, out, store, job, meta, probe, mode=mode,
                        chunk_size=chunk_size, max_memory=max_memory,
                        return_outputs=return_outputs, explain=explain, progress=progress,
                        start=start, plan_for=plan_for, compute=compute)

    verify_kept(fmt, work, arrays, done, cs, n)
    todo = [i for i in range(n_chunks) if i not in done]
    bar = progress_bar(progress, n, sum(done[i]["hi"] - done[i]["lo"] for i in done))
    try:
        if todo:
            compute(bound, spec, fmt, work, out, arrays, plan, todo, return_outputs, bar, done)
        hashes = [done[i]["input"] for i in range(n_chunks)]
        results = [done[i]["result"] for i in range(n_chunks)]
        final = _jsonable(dict(manifest, complete=True,
                               digests={"inputs": _digest(hashes), "results": _digest(results)}))
        try:
            fmt.commit(work.data, out, final, arrays, n_chunks)
        except OSError as e:
            raise _write_error(e, out, "the finished output") from e
    except BaseException:
        if bar is not None:  # erase the bar: the error message is what matters now
            bar.leave = False
        raise
    finally:
        if bar is not None:
            bar.close()
    work.remove()
    return _result(out, fmt, plan, meta, computed=len(todo), resumed=n_chunks - len(todo),
                   seconds=time.perf_counter() - start)


def save_chunk(writer: ChunkWriter, work: _WorkDir, index: int, lo: int, hi: int,
               values: dict[str, np.ndarray], in_hash: str) -> dict[str, Any]:
    """Write one computed chunk (data, fsync), then record it as done: the one way a chunk
    is saved, by this process or by a Dask worker. Returns its record."""
    result_hash = hash_arrays(list(values.values()))
    writer.write(index, lo, hi, values)
    work.record(index, lo, hi, in_hash, result_hash)
    return {"lo": lo, "hi": hi, "input": in_hash, "result": result_hash}


def verify_kept(fmt: Format, work: _WorkDir, arrays: list[ArrayInfo],
                done: dict[int, dict[str, Any]], chunk_size: int, n: int,
                unit: str = "chunk", stacklevel: int = 5) -> None:
    """Read every done chunk back and compare it with the digest of the result recorded when
    it was written; a chunk that differs (or cannot be read) is dropped from ``done`` and its
    record deleted, so it is computed again: the finished output is then still the one an
    uninterrupted run writes, and nothing is returned that the model did not compute."""
    for index in sorted(done):
        lo, hi = _rows(index, chunk_size, n)
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


def _compute_chunks(bound: Any, spec: BatchSpec, fmt: Format, work: _WorkDir, out: Path,
                    arrays: list[ArrayInfo], plan: dict[str, Any], todo: list[int],
                    with_outputs: bool, bar: Any, done: dict[int, dict[str, Any]]) -> None:
    """Compute the chunks in ``todo`` in order. Writing a chunk (data, fsync, then its done
    record) runs in one background thread while the next chunk is computed: fsync waits on
    the disk, not the CPU. At most one chunk is being written at a time, and records are made
    in chunk order."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from ._runner import iter_results

    cs = plan["chunk_size"]
    kernel = bound.kernel(plan["mode"], cs, with_outputs, variant=plan.get("variant"))
    try:
        writer = fmt.writer(work.data, arrays)
    except OSError as e:
        raise _write_error(e, out, "the store") from e

    def save(index: int, lo: int, hi: int, values: dict[str, np.ndarray], in_hash: str) -> None:
        done[index] = save_chunk(writer, work, index, lo, hi, values, in_hash)

    pending: tuple[Future[None], int, int, int] | None = None

    def finish() -> None:
        nonlocal pending
        if pending is None:
            return
        future, index, lo, hi = pending
        pending = None
        try:
            future.result()
        except OSError as e:
            raise _write_error(e, out, f"chunk {index} (rows {lo}:{hi})") from e
        if bar is not None:
            bar.update(hi - lo)

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchjac-writer")
    try:
        for chunk, out_, rows in iter_results(kernel, spec, todo, keep_rows=True):
            assert rows is not None
            in_hash = hash_arrays([rows[0], *rows[1]])
            # as stored (the arrays' dtype): the digest is checked against the stored bytes
            values = {a.name: np.ascontiguousarray(out_[a.name], dtype=a.dtype) for a in arrays}
            finish()
            pending = (pool.submit(save, chunk.index, chunk.lo, chunk.hi, values, in_hash),
                       chunk.index, chunk.lo, chunk.hi)
        finish()
    finally:
        try:  # a chunk being written when something else failed is still finished and recorded
            if pending is not None:
                with contextlib.suppress(Exception):
                    pending[0].result()
        finally:
            pool.shutdown(wait=True)
            writer.close()


class _Callback:
    def __init__(self, fn: Callable[[int], None]) -> None:
        self.fn = fn
        self.leave = True

    def update(self, rows: int) -> None:
        self.fn(rows)

    def close(self) -> None:
        pass


def progress_bar(progress: bool | Callable[[int], None], total: int, initial: int = 0) -> Any:
    """None, a tqdm bar on stderr (rows, rows/s, ETA), or the caller's function wrapped alike
    (``update(rows)``, ``close()``)."""
    if callable(progress):
        return _Callback(progress)
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="row", unit_scale=True, file=sys.stderr,
                dynamic_ncols=True, smoothing=0.1, desc="batchjac")


def _result(out: Path, fmt: Format, plan: dict[str, Any], meta: dict[str, Any], *, computed: int,
            resumed: int, seconds: float) -> StoreResult:
    n = plan["rows"]
    manifest = fmt.read_manifest(out) or {}
    arrays = manifest.get("arrays", {})
    shape = tuple(arrays.get("jacobians", {}).get("shape", ()))
    y = arrays.get("outputs")
    return StoreResult(path=os.fspath(out), format=fmt.name, rows=n, mode=plan["mode"],
                       chunk_size=plan["chunk_size"], chunks=plan["chunks"],
                       computed_chunks=computed, resumed_chunks=resumed, seconds=seconds,
                       shape=shape, outputs_shape=tuple(y["shape"]) if y else None)
