"""Tuning decisions remembered across processes, so that a second process runs the tuned kernel
on its first call instead of timing the alternatives again.

batchjac times alternatives where its cost model cannot decide (forward against reverse mode,
chunk sizes, TensorFlow's XLA against its graph). Those timings cost a few chunks and a
compilation or more each; a cached decision costs one small file read. The cache is a
directory of small JSON files, one per :class:`TuneKey`::

    <cache dir>/v1/<sha256 of the key>.json
    {"schema": "batchjac-tunecache", "version": 1,
     "key": {"model": ..., "signature": ..., "what": ..., "shape": ..., "versions": ..., "machine": ...},
     "decision": {"mode": "forward", "chunk_size": 1000, ...},
     "written": "2025-01-01T00:00:00Z"}

Binary payloads (a compiled JAX executable, :mod:`batchjac._backends.jax.executables`) sit
beside them as ``<sha256 of the key>.bin``: one header line (the key, the payload's size and
sha256) and the bytes, read back only when size and checksum match (:meth:`TuneCache.get_bytes`).

The cache directory is ``$BATCHJAC_CACHE_DIR``, else ``$XDG_CACHE_HOME/batchjac``, else
``~/.cache/batchjac`` (:func:`batchjac._config.cache_dir`); ``BATCHJAC_CACHE=off`` reads
nothing and writes nothing, not even the directory.

What a cache can get wrong, and what this module does about it:

- **A wrong decision.** A decision only ever chooses among alternatives that all compute the
  same result, so the worst a stale one does is run slower. Still, the key holds what the
  timing depended on: the model's computation (:func:`batchjac._fingerprint.
  computation_fingerprint`, blind to weight values, which do not change timings), the batch
  signature, the decision and shape bucket, the versions of batchjac, Python and the framework
  (a new release changes kernels), and the machine (CPU model, core count, GPU). Each file
  holds its key in readable form; a file whose stored key is not the asked one (a hash
  collision, a file copied from elsewhere) is ignored. The caller may pass a validator, and a
  decision it rejects (an unknown mode, a chunk size of the wrong type) is ignored too.
- **A torn file.** Writes go to a temporary file in the same directory, are flushed to disk
  (``fsync``) and renamed over the final name (``os.replace``, atomic): a reader sees the old
  file or the new one, never part of one, and of two processes writing the same key at once
  one wins whole.
- **A cache in the way.** A corrupt, truncated, foreign or unreadable file, or a directory
  that cannot be written, is never an error: batchjac carries on as if there were no cache,
  with one :class:`~batchjac._errors.TuneCacheWarning` per process for reading and one for
  writing (a cache problem repeats on every call; one warning says it, a thousand bury it).

What the cache trusts, and where it refuses to work. A decision can skip a probe (the
row-interaction verdict) and a payload is machine code that XLA runs, so a file planted by
someone else must never be read:

- **Only a directory that is yours alone.** Before anything is read or written, the cache
  directory (followed, if it is a symbolic link: a symlinked ``~/.cache`` is common) must be
  owned by the user running batchjac and not writable by group or others, as ssh and pip ask of
  theirs; its ``v2/`` folder the same and no symbolic link. Otherwise one
  :class:`~batchjac._errors.TuneCacheWarning` says why and how to fix it, and the cache is off
  for the rest of the process (nothing read, nothing written, nothing removed).
- **Only regular files, never through a link.** Every file inside is opened with
  ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat``: a symbolic link, a FIFO or a device
  is a miss with a warning (a FIFO never blocks), and so is a file another user owns.
- **Only files this cache signed.** The folder holds a random key (``v2/key``, 32 bytes, mode
  0600, made on the first write); every decision and every payload header carries an HMAC-SHA256
  of its whole content under it. A file copied from another cache, or rewritten to claim
  another key (an executable of another model under this model's key), fails the check and
  is a miss. The key's ``versions`` holds, beside the version string, an identity of the
  installed batchjac's files (:func:`code_id`), so another checkout of the same version never
  reads this one's decisions.
- **No code from the disk.** Nothing read back is unpickled by batchjac; a JAX executable's
  trees are rebuilt from the traced function (:mod:`batchjac._backends.jax.executables`).

Files are created readable by their owner only (``mkstemp``): the cache is per user, and
another user's decisions are not to be trusted any more than their files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import os
import platform
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._config import CACHE_MAX_BYTES, cache_dir, cache_enabled, cache_max_bytes
from .._errors import InputError, InputTypeError, TuneCacheWarning
from .._version import __version__
from . import files as _files
from .files import KEY_BYTES as KEY_BYTES, KEY_FILE as KEY_FILE

#: what the "schema" field of every cache file says
SCHEMA = "batchjac-tunecache"
#: the file format; a change that older readers would misread bumps it (and the directory);
#: 2: every file signed with the folder's key (version 1's files, unsigned, are never read)
VERSION = 2
#: no file batchjac writes is larger: a larger one is foreign, and is not read whole
MAX_BYTES = 1 << 20
#: the largest binary payload kept (:meth:`TuneCache.put_bytes`: a compiled executable)
MAX_BLOB_BYTES = 64 << 20
#: the file whose presence says that a payload was stored in the directory
PAYLOADS_MARK = "payloads"

#: a decision validator: a callable that raises or returns False to reject a decision, or a
#: schema ``{field: spec}`` where spec is a type (or tuple of types), a set or list of the
#: allowed values, or a predicate
Validator = Callable[[dict[str, Any]], object] | Mapping[str, Any]

#: the distributions whose versions a decision depends on, per framework name (the key's
#: ``versions``); any other name is taken for a distribution's own name
_FRAMEWORK_DISTRIBUTIONS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "tensorflow": (("tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-macos",
                                   "tf-nightly")),
                   ("keras", ("keras",))),
    "torch": (("torch", ("torch",)),),
    "jax": (("jax", ("jax",)), ("jaxlib", ("jaxlib",))),
    "numpy": (("numpy", ("numpy",)),),
}
_FRAMEWORK_DISTRIBUTIONS["keras"] = _FRAMEWORK_DISTRIBUTIONS["tensorflow"]


@dataclasses.dataclass(frozen=True)
class TuneKey:
    """What a tuning decision depends on; equal keys may share a decision.

    All fields are strings (an int ``shape`` is turned into its decimal string, so that
    ``shape=1000`` and ``shape="1000"`` are one key). Build one with :meth:`make`, which
    fingerprints the model and resolves ``versions`` and ``machine``; the constructor takes
    the fields as they are.

    - ``model``: :func:`~batchjac._fingerprint.computation_fingerprint` of the model
      (architecture, dtypes and code, not weight values: a retrained model times the same);
    - ``signature``: the batch signature (layout, dtype, per-row shapes), built by the caller;
    - ``what``: which decision ("mode", "rows", "variant", ...);
    - ``shape``: the shape bucket it was timed on (a chunk size, a bucket of N);
    - ``versions``: batchjac, Python and framework versions (:func:`versions`);
    - ``machine``: CPU model, architecture, core count and GPU (:func:`machine_id`).
    """

    model: str
    signature: str
    what: str
    shape: str | int = ""
    versions: str = ""
    machine: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.shape, int) and not isinstance(self.shape, bool):
            object.__setattr__(self, "shape", str(self.shape))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, str):
                raise InputTypeError(
                    f"TuneKey.{field.name} must be a string"
                    f"{' or an int' if field.name == 'shape' else ''}; got "
                    f"{type(value).__name__} {value!r}. Build keys with TuneKey.make(), "
                    "which turns a model into its fingerprint.")

    @classmethod
    def make(cls, model: Any, signature: str, what: str, shape: str | int = "", *,
             framework: str | None = None, gpu: str | None = None) -> TuneKey:
        """The key of decision ``what`` for ``model`` on this machine and these versions.

        ``model`` is the model itself (it is fingerprinted with
        :func:`~batchjac._fingerprint.computation_fingerprint`, which walks the whole object:
        callers timing many decisions for one model should fingerprint it once and pass the
        string). ``framework`` ("tensorflow", "torch", "jax", "numpy" or a distribution's
        name) adds that framework's versions, read from the installed package metadata without
        importing it; ``gpu`` is the accelerator's name, as the backend reports it.
        """
        if not isinstance(model, str):
            from .._fingerprint import computation_fingerprint

            model = computation_fingerprint(model)
        return cls(model=model, signature=signature, what=what, shape=shape,
                   versions=versions(framework), machine=machine_id(gpu))

    def fields(self) -> dict[str, str]:
        """The fields as a dict, as the cache file stores them."""
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def digest(self) -> str:
        """sha256 (hex) of the fields and the file format: the cache file's name."""
        text = json.dumps({"schema": SCHEMA, "version": VERSION, **self.fields()},
                          sort_keys=True, ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()


def versions(framework: str | None = None) -> str:
    """``"batchjac=0.1.0;python=3.11;torch=2.5.1"``: the versions a timing depends on.

    The framework's versions are an imported framework's ``__version__``, else the installed
    distributions' metadata (:mod:`importlib.metadata`), so nothing is imported; a framework
    that is not installed reads ``none``.

    >>> versions().startswith("batchjac=")
    True
    """
    if framework is not None and (not isinstance(framework, str) or not framework.strip()):
        raise InputTypeError(f"`framework` must be a framework's name such as 'torch'; "
                             f"got {type(framework).__name__} {framework!r}.")
    return _versions(None if framework is None else framework.strip().lower())


@functools.cache  # a metadata look-up scans sys.path
def _versions(name: str | None) -> str:
    from importlib import metadata

    parts = [f"batchjac={__version__}+{code_id()}",
             f"python={sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}"]
    if name is not None:
        for label, candidates in _FRAMEWORK_DISTRIBUTIONS.get(name, ((name, (name,)),)):
            # an imported framework's own __version__ (its package's, as the metadata says):
            # a metadata look-up parses files, a few milliseconds of a first call
            found = getattr(sys.modules.get(label), "__version__", None)
            if isinstance(found, str) and found:
                parts.append(f"{label}={found}")
                continue
            found = "none"
            for dist in candidates:
                with contextlib.suppress(metadata.PackageNotFoundError):
                    found = metadata.version(dist)
                    break
            parts.append(f"{label}={found}")
    return ";".join(parts)


@functools.cache
def code_id() -> str:
    """An identity of the installed batchjac's files: each module's path, size and modification
    time, hashed (16 hex digits). Two checkouts or installs of one version differ, and so does
    one whose code was edited: a decision or an executable is read back only by the code that
    wrote it. Stat calls, not the files' bytes: this is made on a first call, and reading and
    hashing every module costs that call several times more than their stats."""
    sha = hashlib.sha256()
    _stat_tree(os.path.dirname(os.path.abspath(__file__)), "", sha)
    return sha.hexdigest()[:16]


def _stat_tree(folder: str, prefix: str, sha: Any) -> None:
    """Feed each ``*.py`` file's path, size and mtime under ``folder`` into ``sha``, sorted
    (scandir's entries carry what os.walk would stat again)."""
    with contextlib.suppress(OSError), os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "__pycache__":
                    _stat_tree(entry.path, f"{prefix}{entry.name}/", sha)
            elif entry.name.endswith(".py"):
                st = entry.stat()
                sha.update(f"{prefix}{entry.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())


def machine_id(gpu: str | None = None) -> str:
    """``"cpu=<model name>;arch=x86_64;cores=16[;gpu=<name>]"``: the machine a timing was made
    on. The CPU part is read once per process (:func:`_cpu_id`); ``gpu`` is the accelerator's
    name, given by the caller (only the backend knows which device it runs on)."""
    text = _cpu_id()
    if gpu:
        text += f";gpu={' '.join(str(gpu).split())}"
    return text


@functools.cache
def _cpu_id() -> str:
    model = ""
    with contextlib.suppress(OSError, UnicodeDecodeError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:  # Linux; elsewhere, or on CPUs whose entry has no model name: platform's
            name, _, value = line.partition(":")
            if name.strip() == "model name" and value.strip():
                model = value.strip()
                break
    model = model or platform.processor() or "unknown"
    return f"cpu={' '.join(model.split())};arch={platform.machine()};cores={os.cpu_count()}"


# -- the store ----------------------------------------------------------------------------------


class TuneCache:
    """A directory of tuning decisions (see the module docstring); ``directory=None`` is a
    disabled cache: :meth:`get` finds nothing and :meth:`put` writes nothing.

    Instances hold no state but the directory: any number of them, in any number of threads
    and processes, may share one directory. A directory that fails the trust checks (owned by
    someone else, writable by others, a symbolic link inside) is refused for the whole process.
    """

    def __init__(self, directory: str | os.PathLike[str] | None, *,
                 max_payload_bytes: int = CACHE_MAX_BYTES) -> None:
        self._dir = None if directory is None else Path(directory)
        #: the most the binary payloads may take (the least recently used go first)
        self.max_payload_bytes = max_payload_bytes

    def __repr__(self) -> str:
        return f"TuneCache({str(self._dir)!r})" if self._dir is not None else "TuneCache(None)"

    @property
    def enabled(self) -> bool:
        return self._dir is not None and str(self._dir) not in _REFUSED

    @property
    def directory(self) -> Path | None:
        return self._dir

    def path(self, key: TuneKey) -> Path | None:
        """The file that holds ``key``'s decision (None for a disabled cache)."""
        _check_key(key)
        if self._dir is None:
            return None
        return self._dir / f"v{VERSION}" / f"{key.digest()}.json"

    def _folder(self, *, create: bool) -> Path | None:
        """The ``v<VERSION>`` folder, once the directory passed the trust checks; None when the
        cache is disabled, refused, or (``create=False``) not made yet. ``create=True`` makes
        the directories (mode 0700) first; an OSError doing so is the caller's to report."""
        if self._dir is None or str(self._dir) in _REFUSED:
            return None
        folder = self._dir / f"v{VERSION}"
        if create:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # (a non-directory: lstat says so below)
                folder.mkdir(mode=0o700)
        problem = _files.distrust(self._dir, follow=True)
        if problem is None:
            problem = _files.distrust(folder, follow=False)
        if problem == "":  # not there (yet)
            return None
        if problem is not None:
            _refuse(self._dir, problem)
            return None
        return folder

    def get(self, key: TuneKey, validate: Validator | None = None) -> dict[str, Any] | None:
        """The decision stored for ``key``, or None when there is none usable.

        None, with one :class:`TuneCacheWarning` per process, too when the file cannot be read,
        is not a cache file of this version, holds another key, is not signed by this cache, or
        holds a decision that ``validate`` rejects: a problem of the cache is never an error,
        nor a wrong choice. ``validate`` is a callable (it rejects a decision by raising or
        returning False) or a schema ``{field: spec}``, spec a type or tuple of types, a set or
        list of the allowed values, or a predicate; every field of a schema must be present.
        The dict returned is the decision as JSON reads it back (tuples become lists) and is
        the caller's to keep.
        """
        path = self.path(key)
        folder = self._folder(create=False) if path is not None else None
        if path is None or folder is None:
            return None
        try:
            raw = _files.read_regular(path, MAX_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):  # nothing stored (yet)
            return None
        except OSError as err:
            _warn_once("read", f"batchjac cannot read the tuning cache file {path}: "
                       f"{_files.os_error_text(err)}.", _READ_FIX)
            return None
        decision, problem = _parse(raw, key, _files.signing_key(folder, create=False))
        if problem is None and decision is not None and validate is not None:
            problem = _rejection(decision, validate)
        if problem is not None or decision is None:
            _warn_once("read", f"batchjac ignores the tuning cache file {path}: {problem}.", _READ_FIX)
            return None
        return decision

    def put(self, key: TuneKey, decision: Mapping[str, Any]) -> None:
        """Store ``decision`` for ``key``, atomically, replacing what was stored.

        ``decision`` must be a dict with string keys of JSON values (a mistake there is the
        caller's, and raises :class:`~batchjac._errors.InputTypeError`). A directory that
        cannot be written is not an error: one :class:`TuneCacheWarning` per process, and the
        decision is simply not remembered.
        """
        path = self.path(key)
        _encode(key, decision, b"")  # the caller's mistakes are errors, cache or not
        if path is None:
            return
        try:
            folder = self._folder(create=True)
            if folder is None:
                return
            _files.atomic_write(path, _encode(key, decision, _files.writable_key(folder)))
        except OSError as err:
            _warn_once("write", f"batchjac cannot write its tuning cache in {path.parent}: "
                       f"{_files.os_error_text(err)}; the decision is not remembered (the next process "
                       "times the alternatives again).", _WRITE_FIX)

    # -- binary payloads (a compiled executable) ------------------------------------------------

    def blob_path(self, key: TuneKey) -> Path | None:
        """The file that holds ``key``'s payload (None for a disabled cache)."""
        path = self.path(key)
        return None if path is None else path.with_suffix(".bin")

    def has_payloads(self) -> bool:
        """Whether a payload was ever stored in this directory (one ``lstat``): a lookup in a
        directory without any is skipped, and with it the key's making, which for a compiled
        executable is the kernel's whole text hashed."""
        if self._dir is None or str(self._dir) in _REFUSED:
            return False
        try:
            st = os.lstat(self._dir / f"v{VERSION}" / PAYLOADS_MARK)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)

    def get_bytes(self, key: TuneKey) -> bytes | None:
        """The payload stored for ``key`` with :meth:`put_bytes`, or None when there is none
        usable: a file that is truncated, corrupt (its checksum does not match), of another
        format or key, or not signed by this cache is ignored with one
        :class:`TuneCacheWarning` per process, as in :meth:`get`. A payload is handed to a
        framework's loader (a compiled executable, machine code), which might crash on damaged
        bytes or run planted ones: the checksum and the signature are why none ever reaches it."""
        path = self.blob_path(key)
        folder = self._folder(create=False) if path is not None else None
        if path is None or folder is None:
            return None
        try:
            raw = _files.read_regular(path, MAX_BLOB_BYTES + MAX_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            _warn_once("read", f"batchjac cannot read the cache file {path}: "
                       f"{_files.os_error_text(err)}.", _READ_FIX)
            return None
        head, sep, payload = raw.partition(b"\n")
        header, problem = (_parse(head, key, _files.signing_key(folder, create=False)) if sep
                           else (None, "it has no header line"))
        if problem is None and header is not None:
            if header.get("bytes") != len(payload):
                problem = (f"it holds {len(payload)} bytes of payload where its header says "
                           f"{header.get('bytes')!r} (truncated)")
            elif header.get("sha256") != hashlib.sha256(payload).hexdigest():
                problem = "its payload does not match its checksum (corrupt)"
        if problem is not None or header is None:
            _warn_once("read", f"batchjac ignores the cache file {path}: {problem}.", _READ_FIX)
            return None
        with contextlib.suppress(OSError):  # used now: the last to go when space is made
            os.utime(path, follow_symlinks=False)
        return payload

    def put_bytes(self, key: TuneKey, payload: bytes) -> None:
        """Store ``payload`` (at most ``MAX_BLOB_BYTES``) for ``key``, atomically: one signed
        header line (the key, the payload's size and sha256) and the bytes. A directory that
        cannot be written is not an error (one warning per process, as in :meth:`put`)."""
        if not isinstance(payload, (bytes, bytearray)):
            raise InputTypeError(f"A cache payload must be bytes; got {type(payload).__name__}.")
        if len(payload) > MAX_BLOB_BYTES:
            return  # (a huge executable is cheaper to compile again than to keep)
        path = self.blob_path(key)
        if path is None:
            return
        try:
            folder = self._folder(create=True)
            if folder is None:
                return
            header = _encode(key, {"bytes": len(payload),
                                   "sha256": hashlib.sha256(payload).hexdigest()},
                             _files.writable_key(folder), indent=None)
            _files.touch(folder / PAYLOADS_MARK)  # (before the payload: never one unseen)
            _files.atomic_write(path, header + b"\n" + bytes(payload))
            _files.evict_payloads(folder, self.max_payload_bytes, keep=path)
        except OSError as err:
            _warn_once("write", f"batchjac cannot write its cache in {path.parent}: "
                       f"{_files.os_error_text(err)}; the payload is not remembered.", _WRITE_FIX)


def default_cache() -> TuneCache:
    """The cache the environment asks for: disabled with ``BATCHJAC_CACHE=off``, else in
    :func:`~batchjac._config.cache_dir`. The environment is read on every call (it is cheap),
    so a change of ``BATCHJAC_CACHE_DIR`` takes effect; an invalid ``BATCHJAC_CACHE`` raises
    :class:`~batchjac._errors.InputError`. Without a home directory to put it in, the cache
    is disabled with a warning; an invalid ``BATCHJAC_CACHE_MAX_BYTES`` raises too."""
    if not cache_enabled():
        return TuneCache(None)
    limit = cache_max_bytes()
    try:
        return TuneCache(cache_dir(), max_payload_bytes=limit)
    except InputError as err:
        _warn_once("write", str(err), "")
        return TuneCache(None)


_READ_FIX = ("batchjac times the alternatives again and overwrites the file. If this persists, "
             "delete the cache directory, or set BATCHJAC_CACHE=off.")
_WRITE_FIX = ("Set BATCHJAC_CACHE_DIR to a directory you can write, or BATCHJAC_CACHE=off to do "
              "without the cache.")

# -- trust ----------------------------------------------------------------------------------------

#: cache directories refused in this process (their problem said once): the cache is off there
_REFUSED: set[str] = set()


def _refuse(directory: Path, problem: str) -> None:
    """Turn the cache in ``directory`` off for this process, with one warning that says why."""
    with _warned_lock:
        _REFUSED.add(str(directory))
    _warn_once(
        "trust",
        f"batchjac does not use the tuning cache in {directory}: {problem}. Files there could "
        "be planted by someone else, and a cached executable is code that runs; the cache is "
        "off for this process (results are the same, first calls are slower).",
        f"Use a directory that only you own and can write (chmod go-w {directory}, or set "
        "BATCHJAC_CACHE_DIR to another one), or set BATCHJAC_CACHE=off to do without it.")


# -- reading, writing, checking -----------------------------------------------------------------


def _check_key(key: object) -> None:
    if not isinstance(key, TuneKey):
        raise InputTypeError(f"A tuning cache key must be a TuneKey; got {type(key).__name__} "
                             f"{key!r}. Build one with TuneKey.make(model, signature, what, shape).")


def _encode(key: TuneKey, decision: Mapping[str, Any], secret: bytes, *,
            indent: int | None = 1) -> bytes:
    """The file's bytes: the document (schema, version, key, decision, when) and its signature
    under ``secret`` (:func:`_files.sign`), as JSON."""
    if not isinstance(decision, Mapping) or not all(isinstance(k, str) for k in decision):
        raise InputTypeError(f"A tuning decision must be a dict with string keys; got "
                             f"{type(decision).__name__} {decision!r:.200}.")
    document = {"schema": SCHEMA, "version": VERSION, "key": key.fields(),
                "decision": dict(decision),
                "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        document["mac"] = _files.sign(secret, document)
        text = json.dumps(document, sort_keys=True, indent=indent)
    except (TypeError, ValueError) as err:
        raise InputTypeError(f"A tuning decision must hold JSON values only (str, int, float, bool, "
                             f"None, lists and dicts of them); {decision!r:.200} does not: {err}. "
                             "Convert numpy scalars with int() or float().") from None
    data = text.encode("utf-8")
    if len(data) > MAX_BYTES:
        raise InputError(f"A tuning decision must be small (at most {MAX_BYTES} bytes as JSON); "
                         f"this one is {len(data)} bytes. Store the decision, not the data behind it.")
    return data


def _parse(raw: bytes, key: TuneKey, secret: bytes | None
           ) -> tuple[dict[str, Any] | None, str | None]:
    """(decision, None), or (None, what is wrong with the file): its format, its key, and its
    signature under ``secret`` (None: the folder has no signing key)."""
    if len(raw) > MAX_BYTES:
        return None, f"it is larger than any file batchjac writes ({MAX_BYTES} bytes)"
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        return None, f"it is not valid JSON (truncated or corrupt: {err})"
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        return None, f"it is not a batchjac tuning cache file (no \"schema\": {SCHEMA!r})"
    if document.get("version") != VERSION:
        return None, (f"it is of cache format version {document.get('version')!r}; this batchjac "
                      f"reads version {VERSION}")
    stored = document.get("key")
    expected = key.fields()
    if stored != expected:
        if isinstance(stored, dict):
            differ = sorted(k for k in expected.keys() | stored.keys()
                            if stored.get(k) != expected.get(k))
            detail = f"its {', '.join(differ)} differ"
        else:
            detail = f"it holds no key but {stored!r:.100}"
        return None, (f"it belongs to another key ({detail}: a hash collision, or a file copied "
                      "from another cache)")
    decision = document.get("decision")
    if not isinstance(decision, dict):
        return None, f"its decision is {type(decision).__name__} {decision!r:.100}, not a JSON object"
    mac = document.pop("mac", None)
    if secret is None:
        return None, (f"this cache has no signing key to check it against ({KEY_FILE} is missing "
                      "or damaged: a file copied from elsewhere)")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _files.sign(secret, document)):
        return None, ("its signature does not match this cache's key (written by another cache, "
                      "or changed since it was written)")
    return decision, None


def _rejection(decision: dict[str, Any], validate: Validator) -> str | None:
    """Why ``validate`` rejects ``decision``, or None when it accepts it."""
    if isinstance(validate, Mapping):
        for name, spec in validate.items():
            if name not in decision:
                return f"its decision {decision!r:.200} has no {name!r}"
            if not _matches(decision[name], spec):
                return (f"its decision's {name!r} is {decision[name]!r:.100}, which is not "
                        f"{_describe(spec)}")
        return None
    if not callable(validate):
        raise InputTypeError(f"`validate` must be a callable or a dict of field specs; got "
                             f"{type(validate).__name__} {validate!r:.100}.")
    try:
        verdict = validate(decision)
    except Exception as err:
        return f"the caller's check rejects its decision {decision!r:.200}: {type(err).__name__}: {err}"
    if verdict is False:
        return f"the caller's check rejects its decision {decision!r:.200}"
    return None


def _is_types(spec: Any) -> bool:
    return isinstance(spec, type) or (isinstance(spec, tuple) and bool(spec)
                                      and all(isinstance(s, type) for s in spec))


def _matches(value: Any, spec: Any) -> bool:
    if _is_types(spec):
        types_ = spec if isinstance(spec, tuple) else (spec,)
        if isinstance(value, bool) and bool not in types_:  # JSON's true is not a chunk size
            return False
        return isinstance(value, types_)
    if isinstance(spec, (set, frozenset, list, tuple)):
        return any(type(value) is type(allowed) and value == allowed for allowed in spec)
    if callable(spec):
        try:
            return bool(spec(value))
        except Exception:
            return False
    raise InputTypeError(f"A decision schema's spec must be a type, a tuple of types, a set or list of "
                         f"allowed values, or a predicate; got {type(spec).__name__} {spec!r:.100}.")


def _describe(spec: Any) -> str:
    if _is_types(spec):
        types_ = spec if isinstance(spec, tuple) else (spec,)
        return "of type " + " or ".join(t.__name__ for t in types_)
    if isinstance(spec, (set, frozenset, list, tuple)):
        return "one of " + ", ".join(sorted(repr(s) for s in spec))
    return f"accepted by {getattr(spec, '__name__', repr(spec))}"


# -- one warning per process and kind -----------------------------------------------------------

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(kind: str, message: str, fix: str) -> None:
    """Warn about a cache problem of ``kind`` ("read" or "write") once per process: the same
    problem comes back on every call, and batchjac works without the cache."""
    with _warned_lock:
        if kind in _warned:
            return
        _warned.add(kind)
    later = f"Later problems {'reading' if kind == 'read' else 'writing'} the cache are not reported."
    warnings.warn(" ".join(p for p in (message, fix, later) if p), TuneCacheWarning, stacklevel=3)


def _reset_warnings() -> None:
    """Forget which warnings were given (for tests: each one starts a 'process' afresh)."""
    with _warned_lock:
        _warned.clear()
