"""``OUT.partial/``, the work directory of a store being written: its marker, its lock, its
manifest, the done records of finished units and the data being written.

One small record per finished unit (``done/00000007.json``), written to a temporary file,
fsynced and renamed into place, rather than one manifest rewritten per unit: the cost per unit
stays constant and several writers (Dask workers) record units without a lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from .._errors import StoreBusyError, StoreError
from .durable import CLOEXEC, NOFOLLOW, NotRegularFileError, create_new, fsync_dir, open_regular, write_atomic
from .manifest import load_manifest

WORK_SUFFIX = ".partial"
MARKER = ".batchjac-work"


class WorkDir:
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

    def marked(self) -> bool:
        """Whether the work directory exists and carries batchjac's marker."""
        return self.path.exists() and (self.path / MARKER).exists()

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
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | NOFOLLOW | CLOEXEC, 0o644)
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
        return load_manifest(self.manifest_path, follow=False)

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
            f"{NotRegularFileError(bad)} It is in the unfinished store "
            f"{os.fspath(self.path)!r}, which batchjac will not resume. Pass overwrite=True "
            f"(--overwrite) to discard it and start again (the link is removed, not what it "
            f"points to), or delete that directory.")

    def forget(self, index: int) -> None:
        """Drop the done record of unit ``index`` (it is computed again)."""
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
        """The records of the units done, by index (those that do not fit the plan ignored;
        temporaries a kill left deleted)."""
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
        """Mark unit ``index`` done (atomic); ``extra`` is kept in the record (small, JSON)."""
        path = self.done / f"{index:08d}.json"
        tmp = self.done / f"{index:08d}.json.tmp"
        data = json.dumps({**(extra or {}), "index": index, "lo": lo, "hi": hi,
                           "input": input_hash, "result": result_hash}, sort_keys=True)
        write_atomic(path, data, tmp, sync_dir=False)

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
