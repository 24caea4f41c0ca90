"""The Jacobian store: ``jacobian(model, ..., out="jac.zarr")`` (and ``batchjac compute``)
computed chunk by chunk into a resumable store (see :mod:`batchjac._stores`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import InputError, StoreMismatchError
from .._spec import BatchSpec
from .._version import __version__
from .api import Store, StoreResult, format_of, store_format
from .arrays import ArrayInfo, dims, storage_rows
from .durable import write_error, write_json_atomic
from .formats import Format
from .manifest import (
    STORE_VERSION,
    digest,
    framework_version,
    hash_arrays,
    job_problem,
    jsonable,
    probe as probe_model,
)
from .progress import progress_bar
from .resume import check_target, save_chunk, unit_rows, verify_kept
from .workdir import MARKER, WorkDir


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
    from .._bind import plan_for, prepare

    start = time.perf_counter()
    out = Path(store.path)
    fmt = store_format(out)
    work = WorkDir(out)

    work.sweep()
    existing = check_target(out, fmt, work, store.overwrite)

    bound = prepare(model, spec, backend, options)
    assert bound.output_shape is not None
    job, arrays_meta = describe_job(spec, backend, bound.output_shape, store, mode, chunk_size,
                                     max_memory, return_outputs, options, model, nan_policy)
    probe = probe_model(bound, spec)

    if existing is not None:  # a finished output: the same job has nothing left to do
        problem = job_problem(existing, job, probe)
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
        raise write_error(e, out, "the work directory") from e
    try:
        work.vet(store.overwrite)
        compute = _compute_chunks if compute_chunks is None else compute_chunks
        return _run(bound, spec, fmt, work, out, store, job, arrays_meta, probe, mode=mode,
                    chunk_size=chunk_size, max_memory=max_memory, return_outputs=return_outputs,
                    explain=explain, progress=progress, start=start, plan_for=plan_for,
                    compute=compute)
    finally:
        work.release()

def _ensure_parent(out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(e, out, "the output's directory") from e


def describe_job(spec: BatchSpec, backend: str, output_shape: tuple[int, ...], store: Store,
                  mode: str, chunk_size: int | None, max_memory: int | str | None,
                  return_outputs: bool, options: dict[str, Any], model: Any, nan_policy: str
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    from .._fingerprint import model_fingerprint

    fingerprint = store.model_id or model_fingerprint(model)
    u_names = _check_names(store.unknown_names, spec.unknown_shape, "unknown")
    if u_names is None:
        u_names = unknown_names(spec)
    y_names = _check_names(store.output_names, output_shape, "output")
    inputs = [{"shape": list(a.shape), "dtype": np.dtype(a.dtype).name,
               "columns": list(cols) if (cols := _names_of(a)) is not None else None}
              for a in spec.arrays]
    job = jsonable({
        "batchjac": __version__,
        "framework": framework_version(backend),
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

def _input_hash(spec: BatchSpec, lo: int, hi: int) -> tuple[str, np.ndarray, tuple[np.ndarray, ...]]:
    u, ctx = spec.chunk(lo, hi)
    return hash_arrays([u, *ctx]), u, ctx


def _verify_complete(manifest: dict[str, Any], spec: BatchSpec) -> str | None:
    plan = manifest["plan"]
    hashes = [_input_hash(spec, *unit_rows(i, plan["chunk_size"], plan["rows"]))[0]
              for i in range(plan["chunks"])]
    if digest(hashes) != manifest.get("digests", {}).get("inputs"):
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
                       ("row", *dims("output", y_shape), *dims("unknown", spec.unknown_shape)), attrs)]
    if with_outputs:
        y_attrs = {"output_names": meta["output_names"]} if meta.get("output_names") else {}
        infos.append(ArrayInfo("outputs", (n, *y_shape), spec.dtype.name, rows,
                               ("row", *dims("output", y_shape)), y_attrs))
    return infos


def _run(bound: Any, spec: BatchSpec, fmt: Format, work: WorkDir, out: Path, store: Store,
         job: dict[str, Any], meta: dict[str, Any], probe: dict[str, Any], *, mode: Any,
         chunk_size: int | None, max_memory: int | str | None, return_outputs: bool, explain: bool,
         progress: bool | Callable[[int], None], start: float, plan_for: Any,
         compute: Callable[..., None]) -> StoreResult:
    stored = work.manifest()
    if stored is not None:
        problem = job_problem(stored, job, probe)
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
            write_json_atomic(work.manifest_path, jsonable(manifest))  # the store now exists
        except OSError as e:
            raise write_error(e, out, "the new store") from e
        manifest = jsonable(manifest)
    else:
        manifest = dict(stored)
        plan = manifest["plan"]
        arrays = _arrays(plan, manifest["metadata"], spec, return_outputs)
        try:
            fmt.reclaim(work.data, out, manifest)
        except OSError as e:
            raise write_error(e, out, "the store") from e
        fmt.clean(work.data)

    if explain:
        sys.stderr.write(f"batchjac: {plan['reason']}\n")
    cs, n, n_chunks = plan["chunk_size"], plan["rows"], plan["chunks"]
    done = work.done_records(n_chunks, cs, n)
    for index in sorted(done):  # the rows behind every kept result must be the same rows
        if _input_hash(spec, *unit_rows(index, cs, n))[0] != done[index]["input"]:
            lo, hi = unit_rows(index, cs, n)
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
        final = jsonable(dict(manifest, complete=True,
                               digests={"inputs": digest(hashes), "results": digest(results)}))
        try:
            fmt.commit(work.data, out, final, arrays, n_chunks)
        except OSError as e:
            raise write_error(e, out, "the finished output") from e
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

def _compute_chunks(bound: Any, spec: BatchSpec, fmt: Format, work: WorkDir, out: Path,
                    arrays: list[ArrayInfo], plan: dict[str, Any], todo: list[int],
                    with_outputs: bool, bar: Any, done: dict[int, dict[str, Any]]) -> None:
    """Compute the chunks in ``todo`` in order. Writing a chunk (data, fsync, then its done
    record) runs in one background thread while the next chunk is computed: fsync waits on
    the disk, not the CPU. At most one chunk is being written at a time, and records are made
    in chunk order."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from .._runner import iter_results

    cs = plan["chunk_size"]
    kernel = bound.kernel(plan["mode"], cs, with_outputs, variant=plan.get("variant"))
    try:
        writer = fmt.writer(work.data, arrays)
    except OSError as e:
        raise write_error(e, out, "the store") from e

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
            raise write_error(e, out, f"chunk {index} (rows {lo}:{hi})") from e
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
