"""Compiled JAX kernels remembered on disk: a later process loads the executable instead of
compiling it again.

A JAX kernel's first call in a fresh process is its trace, XLA's compilation and one run,
the compilation the larger part. The tuning cache (:mod:`batchjac._tune.cache`) already spares a
second process the races; this module spares it the compilation, the larger part of what is
left: XLA's executable is serialized (``jax.experimental.serialize_executable``, a few MB at
most for the benchmark's models) into the same cache directory, and loading it back takes a
fraction of the compilation (measured: docs/thresholds.md, ``MIN_COMPILE_SECONDS``).

The key is the lowered module's text (StableHLO, with every constant a traced function bakes
in: a closure's weights are part of it, so new weight values never load an old executable),
the compiler options, the call's argument and result structures (two callables can lower to
one text with different pytrees: a Flax ``apply`` with its params against a plain function),
the versions of JAX, jaxlib and batchjac's own files, and the machine (XLA compiles for this
CPU's instruction set).

An executable is machine code, and JAX's loader is a pickle (``deserialize_and_load`` warns
that untrusted bytes can run code): only bytes this user's cache signed reach it
(:mod:`batchjac._tune.cache` refuses a directory others can write and checks every file's
HMAC), the pickle is scanned first and refused where it names anything but the few JAX and
numpy classes an executable holds (:func:`_only_known_classes`), and nothing else is
unpickled: the argument and result trees are the traced function's own (``lowered.in_tree``,
``lowered.out_tree``), and the loaded executable's argument shapes and dtypes must equal the
call's, else it is a miss. The trace is not skipped: the text comes from it, and the trace is
what JAX's own persistent compilation cache needs too. That cache is not used because it is a
process-wide setting (``jax_compilation_cache_dir``) that would cache every ``jax.jit`` of
the user's program in batchjac's directory; this one touches batchjac's kernels only.

Nothing here is ever an error: a payload that fails to load, a module with host callbacks
(their executables hold pointers into this process) or one that cannot be serialized is
compiled as usual, and so is every kernel of a JAX without the module's text or the
serializer (:mod:`.compat`). ``BATCHJAC_CACHE=off`` reads and writes nothing. Writing happens in a
background thread once the call that compiled has its result (:func:`release`) and no kernel
has been called for :data:`WRITE_DELAY` (:func:`used`: a call in chunks keeps it waiting, at
most :data:`MAX_WRITE_WAIT`): serializing
an executable beside a first run takes some of the run's cores. A directory that never held
an executable is not searched (:meth:`~batchjac._tune.cache.TuneCache.has_payloads`): the key,
the module's text hashed, costs a first call milliseconds, and is then made by the writer,
after the call. The directory keeps at most ``BATCHJAC_CACHE_MAX_BYTES`` of
executables (1 GB by default), the least recently used removed first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from ..._tune.cache import TuneKey, default_cache
from .._base import made_beside
from . import compat

#: XLA's compiler options: strings, or Python booleans for its boolean flags (it refuses "false")
Options = dict[str, str | bool]
#: compilations shorter than this are not worth a file (reading one back costs a few ms:
#: docs/thresholds.md)
MIN_COMPILE_SECONDS = 0.02
#: seconds without a kernel call the writer waits for before it serializes an executable:
#: its key and serialization hold Python's lock (and a core), which the call that compiled,
#: returning meanwhile, would otherwise wait for; the chunks after the first one of a call
#: keep it waiting (a call in chunks whose writer wrote after its first chunk was measurably
#: slower than native: docs/thresholds.md)
WRITE_DELAY = 0.05
#: ... but no longer than this after the executable was queued
MAX_WRITE_WAIT = 2.0
#: when a kernel was last called or returned (time.monotonic), for the writer's wait
_LAST_USE = [0.0]


def used() -> None:
    """A kernel is called now (the writer waits for a quiet moment, :data:`WRITE_DELAY`)."""
    _LAST_USE[0] = time.monotonic()


def _quiet(queued: float) -> None:
    while True:
        now = time.monotonic()
        wait = min(_LAST_USE[0] + WRITE_DELAY, queued + MAX_WRITE_WAIT) - now
        if wait <= 0:
            return
        time.sleep(wait)

_WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="batchjac-executables")
#: executables written or loaded by this process, by key digest (written once, not again)
_SEEN: set[str] = set()
#: executables compiled by calls that have not returned yet: written by :func:`release`
_PENDING: list[tuple[Any, TuneKey | None, Any, Any, Options]] = []
_PENDING_LOCK = threading.Lock()


def _key(lowered: Any, options: Options) -> TuneKey | None:
    """The module's text without source locations hashed (its MLIR bytecode is quicker to make
    but holds the caller's file and line, which differ between two scripts calling the same
    model: measured here, a second process then compiled again), with the options and the
    argument and result structures."""
    text, both = compat.module_text(lowered), compat.trees(lowered)
    if text is None or both is None:  # a lowering without a text form or trees: compile as usual
        return None
    trees = [str(tree) for tree in both]
    if "callback" in text:  # host callbacks: an executable bound to this process
        return None
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    extra = json.dumps([sorted(options.items()), trees])
    return TuneKey.make(f"hlo-sha256:{digest}", extra, "executable", jax.default_backend(),
                        framework="jax")


def compile(lowered: Any, options: Options | None = None, *,
            starting: Callable[[], object] = lambda: None,
            beside: bool = False) -> tuple[Any, bool]:
    """``lowered.compile(compiler_options=options)``, or the executable an earlier process
    compiled for the same module, options, versions and machine; and whether it was loaded.
    ``starting`` is called just before XLA compiles, or once the executable is loaded (the
    probes beside a first kernel start then: XLA compiles outside Python's lock). A build
    compiled ``beside`` the calls (the tier-up thread) is queued for writing at once: no
    call returns its result, and a process whose only call ran the quick build would
    otherwise exit without it."""

    options = dict(options or {})
    cache = default_cache()
    searched, key, loaded = _lookup(cache, lowered, options)
    if loaded is not None:
        starting()
        return loaded, True
    starting()
    start = time.perf_counter()
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    if cache.enabled and (key is not None or not searched) \
            and time.perf_counter() - start >= MIN_COMPILE_SECONDS:
        if beside:
            _WRITER.submit(_store, cache, key, compiled, lowered, options, time.monotonic())
            return compiled, False
        with _PENDING_LOCK:
            _PENDING.append((cache, key, compiled, lowered, options))
        _WRITER.submit(_started)  # the writer's thread made now, not when the call returns
    return compiled, False


def load(lowered: Any, options: Options | None = None, *,
         starting: Callable[[], object] = lambda: None) -> Any:
    """The executable an earlier process compiled for this module and options, or None (no
    compilation here: the caller decides what to compile instead)."""
    _, _, loaded = _lookup(default_cache(), lowered, dict(options or {}))
    if loaded is not None:
        starting()
    return loaded


def _lookup(cache: Any, lowered: Any, options: Options
            ) -> tuple[bool, TuneKey | None, Any]:
    """``(searched, key, executable or None)``: whether the cache holds payloads to search,
    the module's key where it does, and the executable stored under it, loaded."""
    searched = cache.enabled and cache.has_payloads()
    key = _key(lowered, options) if searched else None
    payload = cache.get_bytes(key) if key is not None else None
    loaded = _load(payload, lowered) if payload is not None else None
    if loaded is not None:
        assert key is not None
        _SEEN.add(key.digest())
    return searched, key, loaded


def _started() -> None:
    """Nothing: submitted once an executable is queued, so that the writer's thread exists
    before the call's result. Made by :func:`release` instead, it waited for the memory map
    (XLA freeing the first call's temporaries: a thread's stack is mapped memory)."""


def release() -> None:
    """Queue the executables compiled so far for writing: called when a call (or a chunk of
    one) has its result."""
    used()
    if not _PENDING:
        return
    with _PENDING_LOCK:
        pending = _PENDING[:]
        _PENDING.clear()
    queued = time.monotonic()
    for cache, key, compiled, lowered, options in pending:
        _WRITER.submit(_store, cache, key, compiled, lowered, options, queued)


def _load(payload: bytes, lowered: Any) -> Any:
    """The executable in ``payload`` for the call ``lowered`` traced, or None: a pickle that
    names other classes than an executable's, an executable this jaxlib cannot load, or one
    whose arguments are not the call's (the trees are the traced function's own)."""
    if not _only_known_classes(payload):
        return None
    loaded = compat.deserialize(payload, lowered)
    if loaded is None:
        return None
    try:
        if _arguments(loaded.args_info) != _arguments(lowered.args_info):
            return None
        return loaded
    except Exception:  # an executable this jaxlib cannot load: compile instead
        return None


def _arguments(args_info: Any) -> list[tuple[Any, ...]]:
    """Each argument's shape, dtype and donation, from a stage's ``args_info``."""
    return [(tuple(a.shape), str(a.dtype), bool(getattr(a, "donated", False)))
            for a in jax.tree_util.tree_leaves(args_info)]


def _only_known_classes(payload: bytes) -> bool:
    """Whether the pickle in ``payload`` names only the classes an executable holds
    (:data:`~batchjac._backends.jax.compat.EXECUTABLE_CLASSES`), read with
    :mod:`pickletools` (which runs nothing). A name pushed in a way this scan does not follow
    counts as unknown: the scan refuses what it cannot prove."""
    import pickletools

    known = compat.EXECUTABLE_CLASSES
    pushed: list[str | None] = []  # what each op left on top of the stack, where a string
    memo: dict[int, str | None] = {}
    strings = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING",
               "BINSTRING", "SHORT_BINSTRING")
    try:
        for op, arg, _ in pickletools.genops(payload):
            name = op.name
            if name in strings:
                pushed.append(arg if isinstance(arg, str) else None)
            elif name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg if isinstance(arg, int) else -1] = pushed[-1] if pushed else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                pushed.append(memo.get(arg) if isinstance(arg, int) else None)
            elif name in ("GLOBAL", "INST"):
                module, _, qualname = str(arg).partition(" ")
                if (module, qualname) not in known:
                    return False
                pushed.append(None)
            elif name == "STACK_GLOBAL":
                named = (pushed[-2], pushed[-1]) if len(pushed) > 1 else (None, None)
                if named not in known:
                    return False
                pushed.append(None)
            elif name.startswith("EXT"):  # the copyreg registry: names not in the pickle
                return False
            else:
                pushed.append(None)
    except Exception:  # not a pickle pickletools can read
        return False
    return True


def _store(cache: Any, key: TuneKey | None, compiled: Any, lowered: Any,
           options: Options, queued: float = 0.0) -> None:
    # before the imports too: importing serialize_executable holds Python's lock for a while,
    # which a first call returning meanwhile waited for (docs/thresholds.md)
    _quiet(queued or time.monotonic())  # (the calls return before this takes Python's lock)
    if compat.serializer() is None:  # (imported here) a JAX without one: nothing remembered
        return
    if key is None:  # (not searched for: made here, after the call)
        key = _key(lowered, options)
    if key is None or key.digest() in _SEEN:
        return
    _SEEN.add(key.digest())
    with contextlib.suppress(Exception):  # not serializable: nothing remembered
        blob = compat.serialize(compiled)  # (the trees: the trace's own)
        if blob is not None and _only_known_classes(blob):  # (one a later process would
            cache.put_bytes(key, blob)  # refuse is not written)


def compiled_beside(timeout: float | None = None) -> None:
    """Wait until the builds queued beside the calls so far are compiled (tests)."""
    made_beside(timeout)


def flush(timeout: float | None = None) -> None:
    """Wait for the builds compiling beside the calls, write the executables compiled so far
    and wait for them (tests, and processes about to exit)."""
    compiled_beside(timeout)
    release()
    _WRITER.submit(lambda: None).result(timeout)
