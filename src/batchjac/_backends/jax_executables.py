"""Compiled JAX kernels remembered on disk: a later process loads the executable instead of
compiling it again.

A JAX kernel's first call in a fresh process is its trace, XLA's compilation and one run;
measured on the project's 2-core CPU (idle), W1 traces and lowers in ~50 ms and compiles in
~60 ms, W3 compiles in ~150 ms. The tuning cache (:mod:`batchjac._tunecache`) already spares a
second process the races; this module spares it the compilation, the larger part of what is
left: XLA's executable is serialized (``jax.experimental.serialize_executable``, 0.07-2 MB for
W1-W4) into the same cache directory, and loading it back takes 2-14 ms.

The key is the lowered module's text (StableHLO, with every constant a traced function bakes
in: a closure's weights are part of it, so new weight values never load an old executable),
the compiler options, the versions of JAX and jaxlib and the machine (XLA compiles for this
CPU's instruction set). The trace is not skipped: the text comes from it, and the trace is
what JAX's own persistent compilation cache needs too. That cache is not used because it is a
process-wide setting (``jax_compilation_cache_dir``) that would cache every ``jax.jit`` of
the user's program in batchjac's directory; this one touches batchjac's kernels only.

Nothing here is ever an error: a payload that fails to load, a module with host callbacks
(their executables hold pointers into this process) or one that cannot be serialized is
compiled as usual. ``BATCHJAC_CACHE=off`` reads and writes nothing. Writing happens in a
background thread, after the kernel has run, so it adds nothing to the call that compiled.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
from typing import Any

import jax

from .._tunecache import TuneKey, default_cache

#: compilations shorter than this are not worth a file (reading one back costs a few ms)
MIN_COMPILE_SECONDS = 0.02

_WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="batchjac-executables")
#: executables written or loaded by this process, by key digest (written once, not again)
_SEEN: set[str] = set()


def _key(lowered: Any, options: dict[str, str]) -> TuneKey | None:
    """The module's text without source locations hashed (its MLIR bytecode is quicker to make
    but holds the caller's file and line, which differ between two scripts calling the same
    model: measured here, a second process then compiled again)."""
    try:
        text = lowered.as_text(debug_info=False)
    except Exception:  # a lowering without a text form: compile as usual
        return None
    if "callback" in text:  # host callbacks: an executable bound to this process
        return None
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    extra = json.dumps(sorted(options.items()))
    return TuneKey.make(f"hlo-sha256:{digest}", extra, "executable", jax.default_backend(),
                        framework="jax")


def compile(lowered: Any, options: dict[str, str] | None = None) -> tuple[Any, bool]:
    """``lowered.compile(compiler_options=options)``, or the executable an earlier process
    compiled for the same module, options, versions and machine; and whether it was loaded."""
    import time

    options = dict(options or {})
    cache = default_cache()
    key = _key(lowered, options) if cache.enabled else None
    if key is not None:
        payload = cache.get_bytes(key)
        if payload is not None:
            loaded = _load(payload)
            if loaded is not None:
                _SEEN.add(key.digest())
                return loaded, True
    start = time.perf_counter()
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    if key is not None and time.perf_counter() - start >= MIN_COMPILE_SECONDS \
            and key.digest() not in _SEEN:
        _SEEN.add(key.digest())
        _WRITER.submit(_store, cache, key, compiled)
    return compiled, False


def _load(payload: bytes) -> Any:
    from jax.experimental import serialize_executable

    try:
        blob, in_tree, out_tree = _split(payload)
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    except Exception:  # an executable this jaxlib cannot load: compile instead
        return None


def _store(cache: Any, key: TuneKey, compiled: Any) -> None:
    import pickle

    from jax.experimental import serialize_executable

    with contextlib.suppress(Exception):  # not serializable: nothing remembered
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        trees = pickle.dumps((in_tree, out_tree))
        cache.put_bytes(key, len(trees).to_bytes(8, "little") + trees + blob)


def _split(payload: bytes) -> tuple[bytes, Any, Any]:
    import pickle

    size = int.from_bytes(payload[:8], "little")
    # our own checksummed file, in a directory only its owner can write (as the executable is)
    in_tree, out_tree = pickle.loads(payload[8:8 + size])
    return payload[8 + size:], in_tree, out_tree


def flush(timeout: float | None = None) -> None:
    """Wait for the executables queued for writing (tests, and processes about to exit)."""
    _WRITER.submit(lambda: None).result(timeout)
