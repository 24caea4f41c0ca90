"""The Jacobian store: ``jacobian(model, ..., out="jac.zarr")`` (and ``batchjac compute``)
computed chunk by chunk into a resumable store, through the resume protocol
(:mod:`.resume`). This module only says what the job is: the model, inputs and options that
identify it, its arrays (``jacobians``, ``(N, *output, *unknown)``, and ``outputs``,
``(N, *output)``, when asked for), its plan (mode, chunk size, kernel implementation) and how
one chunk is computed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import InputError
from .._spec import BatchSpec
from .._version import __version__
from .api import JACOBIANS, OUTPUTS, Store, StoreResult, format_of, store_format
from .arrays import ArraySpec, dims
from .manifest import framework_version, hash_arrays, jsonable, probe
from .resume import Job, Outcome, Target, run
from .units import Pending, Unit, UnitFunction

#: the Dask path's unit loop: ``(bound, spec, with_outputs, pending)``
ChunkLoop = Callable[[Any, BatchSpec, bool, Pending], None]


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
    compute_chunks: ChunkLoop | None = None,
) -> StoreResult:
    """Compute into a resumable store (see :mod:`batchjac._stores` for the guarantees).

    ``compute_chunks`` computes and writes the chunks still to do (the local threaded loop by
    default); the Dask path hands in one whose workers compute and write them (same records,
    same guarantees; only input rows and small records pass through this process)."""
    start = time.perf_counter()
    out = Path(store.path)
    bound: list[Any] = []  # bound once the target is checked

    def describe() -> Job:
        from .._bind import prepare

        bound.append(prepare(model, spec, backend, options))
        return _job(bound[0], model, spec, backend, store, mode=mode, chunk_size=chunk_size,
                    max_memory=max_memory, with_outputs=return_outputs, nan_policy=nan_policy,
                    options=options, explain=explain)

    def on_cluster(pending: Pending) -> None:
        assert compute_chunks is not None
        compute_chunks(bound[0], spec, return_outputs, pending)

    outcome = run(Target(out, store_format(out), store.overwrite), describe, progress=progress,
                  loop=None if compute_chunks is None else on_cluster)
    return _result(out, outcome, seconds=time.perf_counter() - start)


def _job(bound: Any, model: Any, spec: BatchSpec, backend: str, store: Store, *, mode: Any,
         chunk_size: int | None, max_memory: int | str | None, with_outputs: bool,
         nan_policy: str, options: dict[str, Any], explain: bool) -> Job:
    """The Jacobian store's job, for the resume protocol."""
    assert bound.output_shape is not None
    output_shape = tuple(bound.output_shape)
    description, meta = describe_job(spec, backend, output_shape, store, mode, chunk_size,
                                     max_memory, with_outputs, options, model, nan_policy)

    def plan() -> dict[str, Any]:
        from .._bind import plan_for

        planned = plan_for(spec, bound, mode=mode, chunk_size=chunk_size, max_memory=max_memory)
        return {"mode": planned.mode, "chunk_size": planned.chunk_size,
                "chunks": planned.n_chunks, "rows": spec.n, "reason": planned.reason,
                "variant": _settle_variant(bound, planned.mode, planned.chunk_size, with_outputs,
                                           asked=mode != "auto")}

    def announce(manifest: dict[str, Any]) -> None:
        if explain:
            sys.stderr.write(f"batchjac: {manifest['plan']['reason']}\n")

    return Job(
        description=description, probe=probe(bound, spec),
        arrays=_arrays(meta, spec, with_outputs),
        input_hash=lambda lo, hi: hash_arrays(_rows(spec, lo, hi)),
        plan=plan, compute=lambda manifest: _chunks(bound, spec, manifest["plan"], with_outputs,
                                                   asked=mode != "auto"),
        extras=lambda _: {"metadata": meta}, announce=announce,
        shared_chunks=True, chunk_rows=True)


def _rows(spec: BatchSpec, lo: int, hi: int) -> list[np.ndarray]:
    """Input rows ``lo:hi``, every input array (what a chunk's input hash is of)."""
    u, ctx = spec.chunk(lo, hi)
    return [u, *ctx]


def _chunks(bound: Any, spec: BatchSpec, plan: dict[str, Any], with_outputs: bool, *,
            asked: bool) -> UnitFunction:
    """The function computing one chunk, with the store's kernel (mode, chunk size and
    implementation recorded in its plan); ``asked``: the call asked for that mode (computed or
    refused, never swapped)."""
    from .._backends import CallBudget, under
    from .._runner import iter_results

    budget = CallBudget(mode_asked=asked)
    kernel = under(bound.kernel(plan["mode"], plan["chunk_size"], with_outputs,
                                variant=plan.get("variant"), budget=budget), budget)

    def chunk(index: int, lo: int, hi: int) -> Unit:
        for _, results, rows in iter_results(kernel, spec, [index], keep_rows=True):
            assert rows is not None
            return Unit(results, hash_arrays([rows[0], *rows[1]]))
        raise AssertionError(f"chunk {index} has no rows")

    return chunk


def describe_job(spec: BatchSpec, backend: str, output_shape: tuple[int, ...], store: Store,
                 mode: str, chunk_size: int | None, max_memory: int | str | None,
                 return_outputs: bool, options: dict[str, Any], model: Any, nan_policy: str
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job (what identifies it) and the metadata (column names, output shape) of a
    Jacobian store."""
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


def _settle_variant(bound: Any, mode: str, chunk_size: int, with_outputs: bool, *,
                    asked: bool) -> str | None:
    """The kernel implementation every chunk of the store is computed with, recorded in the
    plan so that resumed chunks and chunks computed on Dask workers use it too: the backend's
    first variant (XLA for TensorFlow), never a timed choice, because two uninterrupted runs
    of the same command must write the same bytes as well. ``asked``: the call asked for
    ``mode`` (a kernel that compiles when made refuses it there if it fails)."""
    from .._backends import FIRST_VARIANT, CallBudget

    kernel = bound.kernel(mode, chunk_size, with_outputs, variant=FIRST_VARIANT,
                          budget=CallBudget(mode_asked=asked))
    first: str = kernel.variants[0]  # (what it is fixed to: ``variant`` is set by its first call)
    return first


def _arrays(meta: dict[str, Any], spec: BatchSpec, with_outputs: bool) -> list[ArraySpec]:
    """The Jacobians ``(N, *output, *unknown)`` and, when asked for, the outputs
    ``(N, *output)``, in the compute dtype, with the column names as attributes."""
    y_shape = tuple(meta["output_shape"])
    attrs = {k: meta[k] for k in ("unknown_names", "output_names") if meta.get(k) is not None}
    specs = [ArraySpec(JACOBIANS, (*y_shape, *spec.unknown_shape), spec.dtype.name,
                       ("row", *dims("output", y_shape), *dims("unknown", spec.unknown_shape)), attrs)]
    if with_outputs:
        y_attrs = {"output_names": meta["output_names"]} if meta.get("output_names") else {}
        specs.append(ArraySpec(OUTPUTS, y_shape, spec.dtype.name, ("row", *dims("output", y_shape)),
                               y_attrs))
    return specs


def _result(out: Path, outcome: Outcome, *, seconds: float) -> StoreResult:
    manifest = outcome.manifest
    plan, arrays = manifest["plan"], manifest.get("arrays", {})
    y = arrays.get(OUTPUTS)
    return StoreResult(path=os.fspath(out), format=store_format(out).name, rows=plan["rows"],
                       mode=plan["mode"], chunk_size=plan["chunk_size"], chunks=plan["chunks"],
                       computed_chunks=outcome.computed, resumed_chunks=outcome.resumed,
                       seconds=seconds, shape=tuple(arrays.get(JACOBIANS, {}).get("shape", ())),
                       outputs_shape=tuple(y["shape"]) if y else None)


# -- column names ---------------------------------------------------------------------------

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
