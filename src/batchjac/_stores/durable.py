"""Durable file operations of the stores, and work files opened without following links.

- Data reaches the disk before it is relied on: files and directories are fsynced, and small
  files (manifests, records) are written to a temporary file, fsynced and renamed into place.
- Work files are never reached through a symbolic link: they are opened with ``O_NOFOLLOW``
  and checked (``fstat``) to be regular files, new files are created with ``O_EXCL`` after any
  stale file or link under their name is removed (the link itself, never what it points to),
  and files are renamed into place only after :func:`check_regular`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from .._errors import StoreError, StoreWriteError
from .._tune.files import fsync_dir as fsync_dir  # (one directory fsync: the tuning cache's)

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# -- fsync ------------------------------------------------------------------------------------

def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)




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


def write_atomic(path: Path, text: str, tmp: Path, *, sync_dir: bool = True) -> None:
    """Write ``text`` to ``tmp`` (created new, never through a link), fsync it and rename it to
    ``path``: a reader sees the old file or the whole new one. ``sync_dir`` also makes the
    rename durable (done records skip it: one per chunk, and a lost record only recomputes)."""
    try:
        with os.fdopen(create_new(tmp), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(path.parent)


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, sort_keys=True, indent=1), path.with_name(f".{path.name}.tmp"))


def move(src: Path, dst: Path) -> None:
    """Rename ``src`` (a regular file of the work directory) to ``dst``; already done (after a
    kill in the middle) is fine."""
    if os.path.lexists(src):
        check_regular(src)
        os.replace(src, dst)
    elif not dst.exists():
        raise StoreWriteError(f"The finished data {os.fspath(src)!r} is missing.")


def write_error(e: OSError, out: Path, what: str) -> StoreWriteError:
    """The error for a failed write of ``what`` (of the output ``out``): a full disk is said
    so, and every message says that finished units are kept."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    reason = "the disk is full" if full else (e.strerror or str(e))
    hint = ("Free some space and run the same command again: finished chunks are kept and the "
            "output stays marked incomplete until every chunk is written." if full else
            "Fix the cause and run the same command again: finished chunks are kept.")
    return StoreWriteError(f"Writing {what} of {os.fspath(out)!r} failed: {reason} "
                           f"({type(e).__name__}: {e}). {hint}", e.errno)


# -- work files: never through a link ---------------------------------------------------------

class NotRegularFileError(StoreError):
    def __init__(self, path: Path | str) -> None:
        self.path = os.fspath(path)
        super().__init__(
            f"{self.path!r} is a symbolic link or not a regular file. batchjac does not follow "
            f"links in its work files: it would write the remaining chunks into, read kept chunks "
            f"from, or commit as the output, whatever the link points to.")


def check_regular(path: Path | str) -> None:
    """Refuse ``path`` unless it is a regular file (a link is not followed)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise NotRegularFileError(path)


def open_regular(path: Path | str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file ``path``, opened without following a link at its
    last component (``O_NOFOLLOW``) and checked (``fstat``) to be a regular file; a link, a
    FIFO or a device is refused with a StoreError naming it."""
    try:
        fd = os.open(path, flags | NOFOLLOW | CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        if os.path.islink(path):
            raise NotRegularFileError(path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(path)
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
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, mode)


def load_json(path: Path, follow: bool = True) -> Any:
    """The JSON value in ``path``, or None if it cannot be read or parsed; ``follow=False``
    for work files: a link there is refused (StoreError), not read."""
    try:
        with (open(path) if follow else os.fdopen(open_regular(path), "r")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
