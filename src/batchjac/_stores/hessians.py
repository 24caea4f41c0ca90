"""The second-order store: ``hessian(model, ..., out="hess.zarr")`` (and ``laplacian``,
``hvp``, and the products ``jvp`` and ``vjp``) computed chunk by chunk into a resumable
store, through the resume protocol (:mod:`.resume`) that Jacobian and solution stores run.
This module only says what the job is: the Jacobian store's description (model, inputs,
options) plus the kind of result, its arrays (``hessians`` ``(N, *output, *unknown,
*unknown)``, ``diagonals``, ``laplacians``, ``hvps``, ``jvps`` or ``vjps``, and
``outputs``/``jacobians`` when asked), its plan (order, chunk size) and how one chunk is
computed. The plan and the kernel come from the verb (:mod:`batchjac._hessian`,
:mod:`batchjac._products`), which sits above this package.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._spec import BatchSpec
from .api import JACOBIANS, OUTPUTS, Store, StoreResult, format_of
from .arrays import ArraySpec, dims
from .formats import Format, HDF5Format, NpyFormat, ZarrFormat
from .jacobians import describe_job
from .manifest import hash_arrays, probe
from .resume import Job, Outcome, Target, run
from .units import Unit, UnitFunction

#: the per-instance shape of each kind's result after the outputs' axes: ``u`` stands for the
#: unknowns' shape
_TRAILING = {"hessians": 2, "diagonals": 1, "laplacians": 0, "hvps": 1}


def second_format(path: str | os.PathLike[str], name: str) -> Format:
    """The format of a second-order store at ``path``: a ``.npy`` holds the result ``name``
    itself, with the outputs and Jacobians beside it."""
    fmt = format_of(path)
    if fmt == "npy":
        return NpyFormat(name, (OUTPUTS, JACOBIANS))
    return ZarrFormat() if fmt == "zarr" else HDF5Format()


@dataclass(frozen=True)
class SecondStoreResult(StoreResult):
    """What ``hessian(..., out=path)`` returns: a :class:`StoreResult` whose ``shape`` is the
    result's (``name``: "hessians", "diagonals", "laplacians" or "hvps"), ``mode`` its order;
    :meth:`open` reads that result by default."""

    name: str = "hessians"

    def open(self, name: str | None = None) -> Any:
        out = Path(self.path)
        return second_format(out, self.name).open(out, name or self.name)


def second_to_store(model: Any, spec: BatchSpec, backend: str, *, store: Store, name: str,
                    describe_options: dict[str, Any], bind: Callable[[], Any],
                    plan: Callable[[Any], dict[str, Any]],
                    kernel: Callable[[Any, dict[str, Any]], Any], with_outputs: bool,
                    with_jacobian: bool, explain: bool,
                    progress: bool | Callable[[int], None],
                    compute_chunks: Callable[[Any, BatchSpec, bool, Any], None] | None = None,
                    result: Callable[[tuple[int, ...]], tuple[tuple[int, ...], tuple[str, ...]]]
                    | None = None) -> SecondStoreResult:
    """Compute the second-order result ``name`` into a resumable store (the guarantees of
    :mod:`batchjac._stores`). ``bind()`` binds and probes the model; ``plan(bound)`` is the
    store's plan (``order``, ``chunk_size``, ``chunks``, ``rows``, ``reason``);
    ``kernel(bound, plan)`` the kernel every chunk is computed with. ``describe_options``
    are the options that fix the result (recorded in the job). ``compute_chunks(bound, spec,
    with_outputs, pending)`` computes and writes the chunks still to do in place of the local
    loop (the Dask path's, as for Jacobian stores). ``result(output_shape)``: the per-row
    shape and axis names of the result ``name``, where they are not a second-order kind's
    (the products of :mod:`batchjac._products`)."""
    start = time.perf_counter()
    out = Path(store.path)
    fmt = second_format(out, name)
    bound_once: list[Any] = []  # bound once the target is checked

    def describe() -> Job:
        bound = bind()
        bound_once.append(bound)
        assert bound.output_shape is not None
        y_shape = tuple(bound.output_shape)
        description, meta = describe_job(
            spec, backend, y_shape, store, describe_options["mode"], describe_options["chunk_size"],
            describe_options["max_memory"], with_outputs, describe_options["backend_options"],
            model, describe_options["nan_policy"])
        description["options"]["second_order"] = {"result": name, "with_jacobian": with_jacobian}

        def announce(manifest: dict[str, Any]) -> None:
            if explain:
                sys.stderr.write(f"batchjac: {manifest['plan']['reason']}\n")

        # the tangents of a Hessian-vector product are inputs: their rows are hashed too
        return Job(description=description, probe=probe(bound, _plain(spec)),
                   arrays=_arrays(name, y_shape, spec, with_outputs, with_jacobian,
                                  None if result is None else result(y_shape)),
                   input_hash=lambda lo, hi: hash_arrays(_rows(spec, lo, hi)),
                   plan=lambda: plan(bound),
                   compute=lambda manifest: _chunks(kernel(bound, manifest["plan"]), spec),
                   extras=lambda _: {"metadata": meta}, announce=announce,
                   shared_chunks=True, chunk_rows=True)

    def on_cluster(pending: Any) -> None:
        assert compute_chunks is not None
        compute_chunks(bound_once[0], spec, with_outputs, pending)

    outcome = run(Target(out, fmt, store.overwrite), describe, progress=progress,
                  loop=None if compute_chunks is None else on_cluster)
    return _result(out, fmt, name, outcome, seconds=time.perf_counter() - start)


def _plain(spec: BatchSpec) -> BatchSpec:
    """The batch without a hvp's tangents (what the model's probe runs on)."""
    if not hasattr(spec, "tangents"):
        return spec
    return BatchSpec(arrays=spec.arrays, layout=spec.layout, dtype=spec.dtype, n=spec.n,
                     unknown_shape=spec.unknown_shape, names=spec.names,
                     finite_check=spec.finite_check)


def _rows(spec: BatchSpec, lo: int, hi: int) -> list[np.ndarray]:
    u, ctx = spec.chunk(lo, hi)
    return [u, *ctx]


def _chunks(kernel: Any, spec: BatchSpec) -> UnitFunction:
    from .._runner import iter_results

    def chunk(index: int, lo: int, hi: int) -> Unit:
        for _, results, rows in iter_results(kernel, spec, [index], keep_rows=True):
            assert rows is not None
            return Unit(results, hash_arrays([rows[0], *rows[1]]))
        raise AssertionError(f"chunk {index} has no rows")

    return chunk


def _arrays(name: str, y_shape: tuple[int, ...], spec: BatchSpec, with_outputs: bool,
            with_jacobian: bool, result: tuple[tuple[int, ...], tuple[str, ...]] | None = None
            ) -> list[ArraySpec]:
    unk = spec.unknown_shape
    if result is not None:
        shape, named = result
        axes = ("row", *named)
    else:
        trailing = _TRAILING[name]
        shape = (*y_shape, *(unk * trailing))
        prefixes = [f"unknown{i + 1}" for i in range(trailing)] if trailing > 1 \
            else ["unknown"] * trailing
        axes = ("row", *dims("output", y_shape), *[a for p in prefixes for a in dims(p, unk)])
    specs = [ArraySpec(name, shape, spec.dtype.name, axes, {})]
    if with_jacobian:
        specs.append(ArraySpec(JACOBIANS, (*y_shape, *unk), spec.dtype.name,
                               ("row", *dims("output", y_shape), *dims("unknown", unk)), {}))
    if with_outputs:
        specs.append(ArraySpec(OUTPUTS, y_shape, spec.dtype.name, ("row", *dims("output", y_shape)), {}))
    return specs


def _result(out: Path, fmt: Format, name: str, outcome: Outcome, *, seconds: float
            ) -> SecondStoreResult:
    manifest = outcome.manifest
    plan, arrays = manifest["plan"], manifest.get("arrays", {})
    y = arrays.get(OUTPUTS)
    return SecondStoreResult(
        path=os.fspath(out), format=fmt.name, rows=plan["rows"], mode=plan["order"],
        chunk_size=plan["chunk_size"], chunks=plan["chunks"], computed_chunks=outcome.computed,
        resumed_chunks=outcome.resumed, seconds=seconds,
        shape=tuple(arrays.get(name, {}).get("shape", ())),
        outputs_shape=tuple(y["shape"]) if y else None, name=name)
