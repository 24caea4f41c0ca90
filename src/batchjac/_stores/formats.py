"""The file formats of the stores, behind one protocol (:class:`Format`).

A format creates the data of a store in its work directory (``OUT.partial/data``), gives a
:class:`ChunkWriter` that writes computed units into it durably, reads a unit back (to check
it against its digest), and commits the finished data to ``OUT`` in one rename. All of them
chunk by rows, storage chunks aligned with the computed units (:mod:`.arrays`), and none knows
what its arrays mean: names, shapes, dtypes, axis names and attributes come from the caller.

- Zarr (``.zarr``): a group with one array per name; Blosc-LZ4 compressed; dimension names and
  attributes from the caller, the manifest in the group's attributes. Written in place.
- HDF5 (``.h5``/``.hdf5``): one gzip-compressed, chunked dataset per name; each array's
  attributes as string datasets, the manifest in the root attribute ``batchjac``. HDF5 files
  can be corrupted by a kill in the middle of a metadata write, so units are staged as
  ``.npy`` files and the HDF5 file is assembled once all are done.
- ``.npy`` (:class:`NpyFormat`): the main array in ``OUT`` itself, each other array in
  ``<stem>.<name>.npy`` beside it and the manifest in ``<stem>.manifest.json``; written
  through ``np.memmap`` into preallocated files (a full disk is reported at creation rather
  than by SIGBUS in the middle). Files beside the output that are not part of a finished
  output are refused unless overwriting, and a file batchjac did not make is never deleted.
- a directory of ``.npy`` files (:class:`NpyDirFormat`): ``OUT/<name>.npy`` for every array,
  ``OUT/manifest.json`` and optionally a ``summary.json`` the caller derives from the manifest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import BatchJacError, InputError, StoreError, StoreWriteError
from .._io import InputFileError
from .._sinks import ArraySink
from .arrays import ArrayInfo, fill
from .durable import check_regular, create_new, fsync_dir, fsync_file, fsync_tree, move, write_json_atomic
from .manifest import is_complete_manifest, load_manifest
from .npy import create_npy, load_npy, map_npy, read_npy_rows
from .workdir import WorkDir


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

    def foreign_siblings(self, out: Path, work: WorkDir) -> list[Path]:
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


# -- .npy: the main array in OUT, the others beside it ------------------------------------------

class NpyFormat(Format):
    """``OUT`` holds array ``main``; array ``name`` of ``others`` is ``<stem>.<name>.npy``
    beside it (when the store has it), and the manifest is ``<stem>.manifest.json``."""

    name = "npy"

    def __init__(self, main: str, others: Sequence[str] = ()) -> None:
        self.main = main
        self.others = tuple(others)

    def _sibling(self, out: Path, suffix: str) -> Path:
        stem = out.name[: -len(out.suffix)] if out.suffix else out.name
        return out.with_name(f"{stem}.{suffix}")

    def _siblings(self, out: Path) -> dict[str, Path]:
        """The file of each array of ``others``, by name."""
        return {name: self._sibling(out, f"{name}.npy") for name in self.others}

    def _sidecar(self, out: Path) -> Path:
        return self._sibling(out, "manifest.json")

    def final_paths(self, out: Path) -> list[Path]:
        return [out, *self._siblings(out).values(), self._sidecar(out)]

    def create(self, data: Path, arrays: list[ArrayInfo]) -> None:
        for a in arrays:
            create_npy(data / f"{a.name}.npy", a)

    def writer(self, data: Path, arrays: list[ArrayInfo]) -> ChunkWriter:
        return NpyWriter(data, arrays)

    def _committing(self, out: Path, stored: dict[str, Any] | None) -> bool:
        """Whether the sidecar manifest beside ``out`` is the one the commit of the store
        ``stored`` (its work manifest) writes first: that commit was interrupted."""
        sidecar = self._sidecar(out)
        side = load_manifest(sidecar) if stored is not None and os.path.lexists(sidecar) else None
        return side is not None and stored is not None and all(
            side.get(k) == stored.get(k) for k in ("job", "plan", "arrays"))

    def reclaim(self, data: Path, out: Path, manifest: dict[str, Any]) -> None:
        # commit moves the other arrays' files out, then the main one (the commit point);
        # killed in between, those files are beside the output, under the sidecar manifest
        # that commit wrote first for this very store
        if not os.path.lexists(data / f"{self.main}.npy"):
            return
        listed = manifest.get("arrays", {})
        moved = {name: path for name, path in self._siblings(out).items()
                 if name in listed and not os.path.lexists(data / f"{name}.npy")}
        if moved and self._committing(out, manifest):
            for name, path in moved.items():
                check_regular(path)
                os.replace(path, data / f"{name}.npy")

    def foreign_siblings(self, out: Path, work: WorkDir) -> list[Path]:
        stored = None
        with contextlib.suppress(StoreError):  # a work dir with links is dealt with later
            stored = work.manifest()
        ours = self._committing(out, stored)
        listed = stored.get("arrays", {}) if ours and stored is not None else {}
        found = []
        if os.path.lexists(self._sidecar(out)) and not ours:
            found.append(self._sidecar(out))
        found += [path for name, path in self._siblings(out).items()
                  if os.path.lexists(path) and name not in listed]
        return found

    def read_chunk(self, data: Path, arrays: list[ArrayInfo], index: int, lo: int,
                   hi: int) -> list[np.ndarray]:
        return [read_npy_rows(data / f"{a.name}.npy", a, lo, hi) for a in arrays]

    def commit(self, data: Path, out: Path, manifest: dict[str, Any], arrays: list[ArrayInfo],
               n_chunks: int) -> None:
        sidecar = self._sidecar(out)
        names = {a.name for a in arrays}
        for name, path in self._siblings(out).items():
            if name not in names and os.path.lexists(path):
                # the file of the output being replaced (its manifest, still there, lists it)
                # would describe another main array; a file batchjac did not make is never
                # deleted
                old = load_manifest(sidecar) if os.path.lexists(sidecar) else None
                if old is not None and name in old.get("arrays", {}):
                    path.unlink()
        write_json_atomic(sidecar, manifest)
        for name, path in self._siblings(out).items():
            if name in names:
                move(data / f"{name}.npy", path)
        move(data / f"{self.main}.npy", out)  # the commit point
        fsync_dir(out.parent)

    def read_manifest(self, out: Path) -> dict[str, Any] | None:
        sidecar = self._sidecar(out)
        if not (out.is_file() and sidecar.is_file()):
            return None
        manifest = load_manifest(sidecar)
        if not is_complete_manifest(manifest):
            return None
        assert manifest is not None
        try:
            shape = tuple(np.load(out, mmap_mode="r").shape)
        except (OSError, ValueError):
            return None
        if shape != tuple(manifest.get("arrays", {}).get(self.main, {}).get("shape", ())):
            return None  # the .npy was replaced by something else
        return manifest

    def open(self, out: Path, name: str) -> Any:
        path = {self.main: out, **self._siblings(out)}.get(name)
        listed = (load_manifest(self._sidecar(out)) or {}).get("arrays", {})
        if path is None or not path.exists() or name not in listed:  # not a file of another
            raise InputFileError(f"{os.fspath(out)!r} has no array {name!r}.")
        return np.load(path, mmap_mode="r")


class NpyWriter(ChunkWriter):
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


# -- a directory of .npy files ------------------------------------------------------------------

class NpyDirFormat(Format):
    """``OUT/`` holding one ``<name>.npy`` per array and ``manifest.json``, and the
    ``summary.json`` that ``summary`` makes of the final manifest (when given)."""

    name = "npy-dir"

    def __init__(self, summary: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.summary = summary

    def create(self, data: Path, arrays: list[ArrayInfo]) -> None:
        for a in arrays:  # preallocated, space reserved, never through a link
            create_npy(data / f"{a.name}.npy", a)

    def writer(self, data: Path, arrays: list[ArrayInfo]) -> ChunkWriter:
        return NpyWriter(data, arrays)  # the same .npy files as a single-file store's

    def read_chunk(self, data: Path, arrays: list[ArrayInfo], index: int, lo: int,
                   hi: int) -> list[np.ndarray]:
        return [read_npy_rows(data / f"{a.name}.npy", a, lo, hi) for a in arrays]

    def commit(self, data: Path, out: Path, manifest: dict[str, Any], arrays: list[ArrayInfo],
               n_chunks: int) -> None:
        if data.exists():
            if self.summary is not None:
                write_json_atomic(data / "summary.json", self.summary(manifest))
            write_json_atomic(data / "manifest.json", manifest)
            fsync_dir(data)
            if os.path.lexists(out):  # an output being overwritten (checked removable before)
                self.remove(out)
            os.rename(data, out)  # the commit point
        elif not out.exists():
            raise BatchJacError(f"The finished output {os.fspath(data)!r} is missing.")
        fsync_dir(out.parent)

    def read_manifest(self, out: Path) -> dict[str, Any] | None:
        if not (out / "manifest.json").is_file():
            return None
        manifest = load_manifest(out / "manifest.json")
        if not is_complete_manifest(manifest):
            return None
        return manifest

    def open(self, out: Path, name: str) -> Any:
        path = out / f"{name}.npy"
        if not path.exists():
            raise InputError(f"{os.fspath(out)!r} has no array {name!r}.")
        return np.load(path, mmap_mode="r")

    def removable(self, out: Path) -> bool:
        if out.is_dir() and not out.is_symlink():
            return load_manifest(out / "manifest.json") is not None
        return super().removable(out)

    def remove(self, out: Path) -> None:
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        elif os.path.lexists(out):
            out.unlink()


# -- Zarr ---------------------------------------------------------------------------------------

class ZarrFormat(Format):
    name = "zarr"

    def _zarr(self) -> Any:
        try:
            import zarr
        except ImportError:
            from .._io import install_hint

            raise InputError(f"Writing Zarr stores needs zarr: {install_hint('zarr')}.") from None
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
                fill_value=fill(a.dtype), dimension_names=list(a.dims), attributes=a.attrs,
                # all-zero chunks are still written: the files do not depend on the values
                config={"write_empty_chunks": True},
            )
        fsync_tree(data / "store.zarr")

    def writer(self, data: Path, arrays: list[ArrayInfo]) -> ChunkWriter:
        return ZarrWriter(self._zarr(), data / "store.zarr", arrays)

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
        return manifest if is_complete_manifest(manifest) else None

    def open(self, out: Path, name: str) -> Any:
        group = self._zarr().open_group(str(out), mode="r")
        if name not in group:
            raise InputFileError(f"{os.fspath(out)!r} has no array {name!r}.")
        return group[name]

    def removable(self, out: Path) -> bool:
        if out.is_dir():
            return any((out / n).exists() for n in ("zarr.json", ".zgroup", ".zarray"))
        return super().removable(out)


class ZarrWriter(ChunkWriter):
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


# -- HDF5 ---------------------------------------------------------------------------------------

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
        return StagedWriter(data / "chunks")

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
        if not os.path.lexists(data / "out.h5"):
            tmp = data / "out.h5.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a stale one (or a link planted there: removed, not followed)
            self._assemble(tmp, data / "chunks", manifest, arrays, n_chunks)
            fsync_file(tmp)
            os.replace(tmp, data / "out.h5")
        check_regular(data / "out.h5")
        os.replace(data / "out.h5", out)  # the commit point (replaces an overwritten output)
        fsync_dir(out.parent)

    def _assemble(self, tmp: Path, staged: Path, manifest: dict[str, Any],
                  arrays: list[ArrayInfo], n_chunks: int) -> None:
        """The HDF5 file of the staged units, with the manifest, written to ``tmp``."""
        h5py = self._h5py()
        with h5py.File(tmp, "x") as f:  # created exclusively (O_EXCL): no link is followed
            dsets = {}
            for a in arrays:
                dsets[a.name] = f.create_dataset(
                    a.name, shape=a.shape, dtype=np.dtype(a.dtype),
                    chunks=(max(1, a.chunk_rows), *a.shape[1:]) if a.shape[0] else None,
                    compression="gzip", compression_opts=1, shuffle=True,
                    fillvalue=fill(a.dtype))
                for key, value in a.attrs.items():  # names: datasets, attributes are small
                    if key not in f:
                        f.create_dataset(key, data=np.array(value, dtype=h5py.string_dtype()))
                dsets[a.name].attrs["dimension_names"] = np.array(a.dims, dtype=h5py.string_dtype())
            cs, n = manifest["plan"]["chunk_size"], manifest["plan"]["rows"]
            for index in range(n_chunks):
                lo, hi = index * cs, min(n, (index + 1) * cs)
                for a in arrays:
                    dsets[a.name][lo:hi] = load_npy(staged / f"{index:08d}.{a.name}.npy")
            f.attrs["batchjac"] = json.dumps(manifest, sort_keys=True)

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
        return manifest if is_complete_manifest(manifest) else None

    def open(self, out: Path, name: str) -> Any:
        f = self._h5py().File(out, "r")
        if name not in f:
            f.close()
            raise InputFileError(f"{os.fspath(out)!r} has no dataset {name!r}.")
        return f[name]


class StagedWriter(ChunkWriter):
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
