"""The files of the tuning cache, handled as files that someone else may have planted: the
trust checks of a directory, reads that follow no link and open only regular files, atomic
writes, the folder's signing key and the HMAC under it, and the eviction of payloads.

:mod:`batchjac._tune.cache` decides what to store and when; this module decides only how a
file is read and written safely (its docstring says what the cache trusts).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: the file that holds the folder's signing key (random bytes, readable by its owner only)
KEY_FILE = "key"
#: the signing key's length in bytes
KEY_BYTES = 32


def distrust(path: Path, *, follow: bool) -> str | None:
    """Why ``path`` is not a directory only this user can write (None: it is; "" when it does
    not exist). ``follow`` follows a symbolic link at ``path`` itself, whose target is checked."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except OSError as err:
        return f"{path} cannot be examined ({os_error_text(err)})"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (batchjac follows none inside its cache)"
    if not stat.S_ISDIR(st.st_mode):
        return ""  # (a file where the directory should be: writing says so, reading misses)
    if os.name != "posix":
        return None
    me = os.geteuid()
    if st.st_uid != me:
        return f"{path} is owned by user id {st.st_uid}, not by you (user id {me})"
    if st.st_mode & 0o022:
        who = " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "other users"))
                           if st.st_mode & bit)
        return f"{path} can be written by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``, a regular file of this user's: a symbolic link is
    not followed, and a FIFO, a device or a directory is not read (an OSError that says so;
    FileNotFoundError when nothing is there)."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "it is a symbolic link (batchjac follows none inside "
                                       "its cache)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "it is not a regular file (a FIFO, a device or a "
                                        "directory is never read)")
        if os.name == "posix" and st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"it is owned by user id {st.st_uid}, not by you")
        chunks, left = [], limit
        while left > 0:
            block = os.read(fd, min(left, 1 << 22))
            if not block:
                break
            chunks.append(block)
            left -= len(block)
        return b"".join(chunks)
    finally:
        os.close(fd)


def touch(path: Path) -> None:
    """Create ``path`` (mode 0600) if it is not there; a link or a FIFO there is not followed
    or opened for long (O_NOFOLLOW, O_NONBLOCK: an OSError)."""
    flags = (os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_CLOEXEC", 0))
    fd = os.open(path, flags, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
    finally:
        os.close(fd)


def signing_key(folder: Path, *, create: bool) -> bytes | None:
    """The folder's signing key (:data:`KEY_FILE`), made with ``create`` where there is none;
    None where there is none, or it is not a regular file of this user's of the right size.
    Two processes making it at once agree: it is written under a temporary name and linked to
    its name, which fails for the second (who then reads the first one's)."""
    path = folder / KEY_FILE
    for _ in range(2):
        try:
            key = read_regular(path, KEY_BYTES + 1)
            return key if len(key) == KEY_BYTES else None
        except FileNotFoundError:
            if not create:
                return None
        except OSError:
            return None
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".key.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links: the last writer's key wins
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        fsync_dir(folder)
    return None


def writable_key(folder: Path) -> bytes:
    """The folder's signing key, made where there is none; an OSError where it cannot be."""
    secret = signing_key(folder, create=True)
    if secret is None:
        raise OSError(errno.EINVAL, f"its signing key {folder / KEY_FILE} is not a regular file "
                                    f"of yours of {KEY_BYTES} bytes")
    return secret


def sign(secret: bytes, document: Mapping[str, Any]) -> str:
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(secret, text.encode("utf-8"), hashlib.sha256).hexdigest()


def evict_payloads(folder: Path, limit: int, *, keep: Path) -> None:
    """Remove the least recently used payloads (by modification time, which a read renews)
    until those left take at most ``limit`` bytes; ``keep`` (the one just written) stays.
    Another process removing the same file meanwhile is not an error."""
    entries = []
    for entry in os.scandir(folder):  # (the folder passed the trust checks: no link to follow)
        if entry.name.endswith(".bin") and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                entries.append((st.st_mtime, st.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    for _, size, name in sorted(entries):
        if total <= limit:
            break
        if name == str(keep):
            continue
        with contextlib.suppress(OSError):
            os.unlink(name)
            total -= size


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file: a temporary file in
    the same directory (a rename is atomic only within one file system), flushed to disk before
    it replaces ``path``, so that a crash leaves the old file or the new one, not an empty one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def replace(src: str, dst: Path) -> None:
    # Windows refuses to replace a file another process has open (a reader, or a writer's
    # replace in flight) with PermissionError; such a window is short.
    attempts = 5 if os.name == "nt" else 1
    for attempt in range(attempts):
        try:
            os.replace(src, dst)
            return
        except PermissionError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.01 * (attempt + 1))


def fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX); best effort: a lost rename only loses a decision."""
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def os_error_text(err: OSError) -> str:
    return f"{type(err).__name__}: {err}"
