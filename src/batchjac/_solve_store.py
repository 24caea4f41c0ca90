"""Resumable output for ``batchjac solve``: solutions written block by block, crash-safe.

The same machinery and guarantees as the Jacobian stores (:mod:`batchjac._stores`), applied
to :func:`batchjac.solve`:

- Instances are solved in **blocks** of consecutive rows, fixed when the output is created
  (recorded in its manifest). Each block is one :func:`~batchjac.solve` call on rows read from
  the input files, so memory is bounded by the block whatever N is, and the inputs are
  streamed (any format :func:`batchjac._io.open_input` reads).
- Work happens in ``OUT.partial/``; each finished block's rows are written and flushed, then a
  record of the block (with the sha256 of the input rows it was solved from and its status
  counts) is made durable by an atomic rename. A kill loses at most the block in flight; the
  same command continues from the recorded blocks, after checking their input rows are
  unchanged. The finished output appears under ``OUT`` in one rename.
- **Same command, same bytes.** The mode comes from the cost model (never from timing) and
  is recorded; blocks are solved in that mode with ``reproducible=True`` (padded chunk sizes
  from the active count alone, the backend's first kernel implementation, no timing), the
  random starts of a block come from ``(seed, block start row)``, and the seed is drawn once
  and recorded when none is given. A run killed and resumed writes the same bytes as one that
  was not.
- Only the same job resumes (model fingerprint and probe outputs, inputs' shapes and dtypes,
  every option); another job is refused unless ``overwrite``.

Formats: a directory of ``.npy`` files (``x.npy``, ``residual.npy``, ... with ``manifest.json``
and ``summary.json``: the default for an ``OUT`` without a suffix), or every array in one Zarr
group (``.zarr``) or HDF5 file (``.h5``/``.hdf5``).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import BatchJacError, InputError, StoreMismatchError
from ._stores.api import FORMATS
from ._stores.arrays import ArrayInfo, dims as axis_names, storage_rows
from ._stores.durable import write_error, write_json_atomic
from ._stores.formats import Format, NpyDirFormat
from ._stores.manifest import (
    STORE_VERSION,
    digest,
    framework_version,
    hash_arrays,
    job_problem,
    jsonable,
    probe as probe_model,
)
from ._stores.progress import progress_bar
from ._stores.resume import check_target, verify_kept
from ._stores.units import unit_rows
from ._stores.workdir import MARKER, WorkDir
from ._version import __version__

#: blocks hold at least this many instances (fewer only when the memory budget says so):
#: every block pays the solver's fixed cost per iteration once
MIN_BLOCK = 4096
#: ... and at most 1/TARGET_BLOCKS of the instances, so progress and resume have steps
TARGET_BLOCKS = 16

RESULT_FIELDS = ("x", "residual", "cost", "success", "status", "iterations", "rank",
                 "rank_deficient", "start")


@dataclass(frozen=True)
class SolveInputs:
    """What to solve. ``targets``/``known`` are ``(N, ...)`` arrays or readers; ``x0``,
    ``lower``, ``upper``, ``weights``, ``sigma`` are None, a number, one value for every
    instance (``(k,)``, or the output shape for weights) or one row per instance."""

    targets: Any
    known: Any = None
    x0: Any = None
    lower: Any = None
    upper: Any = None
    weights: Any = None
    sigma: Any = None


@dataclass(frozen=True)
class SolveStoreResult:
    path: str
    format: str
    instances: int
    blocks: int
    block_size: int
    computed_blocks: int
    resumed_blocks: int
    succeeded: int
    status_counts: dict[str, int]
    seconds: float

    def open(self, name: str = "x") -> Any:
        """One array of the finished output, read lazily (memory-mapped ``.npy``, a Zarr array
        or an h5py dataset): ``x``, ``residual``, ``success``, ``status``, ...; ``covariance``
        and ``jacobian`` when they were asked for."""
        return open_result(self.path, name)

    def summary(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["instances_per_second"] = self.instances / self.seconds if self.seconds > 0 else None
        return data


def output_format(out: str | os.PathLike[str]) -> str:
    """"zarr" or "hdf5" by suffix; anything else is a directory of .npy files."""
    suffix = Path(out).suffix.lower()
    if suffix == ".zarr":
        return "zarr"
    if suffix in (".h5", ".hdf5", ".hdf", ".he5"):
        return "hdf5"
    if suffix == ".npy":
        raise InputError(f"--out {os.fspath(out)!r}: solve writes several arrays; give a "
                         f"directory (no suffix), a .zarr or an .h5 path.")
    return "npy-dir"


def open_result(path: str | os.PathLike[str], name: str = "x") -> Any:
    """Array ``name`` of a finished solve output, read-only and lazy."""
    fmt = _solve_formats()[output_format(path)]
    if fmt.read_manifest(Path(path)) is None:
        raise InputError(f"{os.fspath(path)!r} is not a finished batchjac solve output.")
    return fmt.open(Path(path), name)


def solve_to_store(
    model: Any,
    inputs: SolveInputs,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    model_id: str | None = None,
    method: str = "lm",
    max_iter: int = 100,
    xtol: float | None = None,
    ftol: float | None = None,
    gtol: float | None = None,
    n_starts: int = 1,
    seed: int | None = None,
    n_unknowns: int | None = None,
    dtype: Any = None,
    backend: str | None = None,
    backend_options: dict[str, Any] | None = None,
    return_covariance: bool = False,
    return_jacobian: bool = False,
    max_memory: int | str | None = None,
    block_size: int | None = None,
    progress: bool | Callable[[int], None] = False,
    explain: bool = False,
) -> SolveStoreResult:
    """Solve every instance of ``inputs`` (see :func:`batchjac.solve` for the options) into a
    resumable output at ``out`` (see the module docstring)."""
    from . import _backends
    from ._bind import prepare
    from ._config import default_max_memory, parse_bytes
    from ._plan import make_plan
    from ._solve import Status, _n_unknowns, solve
    from ._validate import normalize, resolve_dtype

    start = time.perf_counter()
    out_path = Path(out)
    fmt = _solve_formats()[output_format(out_path)]
    work = WorkDir(out_path)
    work.sweep()

    t = inputs.targets
    if len(getattr(t, "shape", np.shape(t))) == 0:
        raise InputError("`targets` must have one row per instance, shape (N, *output_shape).")
    n = int(t.shape[0])
    h = inputs.known
    if h is not None:
        if len(h.shape) != 2:
            raise InputError(f"`known` must be (N, h), one row of known inputs per instance; got "
                             f"shape {tuple(h.shape)}.")
        if h.shape[0] != n:
            raise InputError(f"`known` has {h.shape[0]} rows but `targets` has {n}; they must have "
                             f"one row per instance.")
    per_row = {name: _is_per_row(getattr(inputs, name), n, ndim)
               for name, ndim in (("x0", 2), ("lower", 2), ("upper", 2))}
    head = _head(inputs, per_row, 0, min(n, 1))
    k = _n_unknowns(head["x0"], (head["lower"], head["upper"]), n_unknowns, min(n, 1))
    if n_starts < 1 or isinstance(n_starts, bool):
        raise InputError(f"`n_starts` must be an integer >= 1; got {n_starts!r}.")
    dt = resolve_dtype(dtype, [np.empty(0, a.dtype) for a in (t, h, inputs.x0)
                               if a is not None and hasattr(a, "dtype") and a.dtype.kind == "f"
                               and getattr(a, "carries_dtype", True)])

    # bind the model on a probe batch: its output shape, and the probe that recognises it
    rng = np.random.default_rng(20240611)
    x_probe = rng.standard_normal((4, k)).astype(dt)
    probe_inputs = (x_probe,) if h is None else (x_probe, rng.standard_normal((4, h.shape[1])))
    spec = normalize(probe_inputs, wrt=None, dtype=dt, nan_policy="propagate")
    name = backend or _backends.detect(model)
    options = backend_options or {}
    bound = prepare(model, spec, name, options)
    assert bound.output_shape is not None
    out_shape = tuple(bound.output_shape)
    if tuple(t.shape[1:]) != out_shape:
        raise InputError(f"`targets` has shape {tuple(t.shape)}, but the model's output for one "
                         f"instance has shape {out_shape}; targets must be (N, *output_shape) = "
                         f"{(n, *out_shape)}.")
    m = math.prod(out_shape)
    out_ndim = 1 + len(out_shape)
    per_row["weights"] = _is_per_row(inputs.weights, n, out_ndim)
    per_row["sigma"] = _is_per_row(inputs.sigma, n, out_ndim)

    budget = default_max_memory() if max_memory is None else parse_bytes(max_memory)
    in_elems = k + (0 if h is None else int(h.shape[1]))
    plan = make_plan(n=max(n * n_starts, 1), k=k, m=m, in_elems=in_elems, dtype=dt, mode="auto",
                     chunk_size=None, max_memory=budget)
    if block_size is None:
        by_memory = max(1, plan.chunk_size // n_starts)
        block_size = max(1, min(by_memory, max(MIN_BLOCK, -(-n // TARGET_BLOCKS))))
    elif isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size < 1:
        raise InputError(f"`block_size` must be a positive integer; got {block_size!r}.")
    block_size = int(min(block_size, max(n, 1)))
    n_blocks = -(-n // block_size) if n else 0

    job = jsonable({
        "kind": "solve",
        "batchjac": __version__,
        "framework": framework_version(name),
        "model": model_id or _fingerprint(model),
        "inputs": {key: _describe(getattr(inputs, key), key in ("targets", "known") or per_row[key])
                   for key in ("targets", "known", "x0", "lower", "upper", "weights", "sigma")},
        "options": {
            "method": method, "max_iter": max_iter, "xtol": xtol, "ftol": ftol, "gtol": gtol,
            "n_starts": n_starts, "seed": seed, "n_unknowns": k, "dtype": dt.name,
            "backend": name, "backend_options": options, "covariance": return_covariance,
            "jacobian": return_jacobian, "block_size": block_size, "format": fmt.name,
        },
    })
    probe = probe_model(bound, spec)
    arrays = _arrays(n, k, out_shape, dt, block_size, return_covariance, return_jacobian)

    existing = check_target(out_path, fmt, work, overwrite, "batchjac solve output")

    def hashes_of(index: int) -> tuple[str, dict[str, Any]]:
        lo, hi = unit_rows(index, block_size, n)
        rows = _head(inputs, per_row, lo, hi)
        parts = [rows[key] for key in sorted(rows) if rows[key] is not None and
                 (key in ("targets", "known") or per_row.get(key))]
        return hash_arrays([np.asarray(p) for p in parts]), rows

    if existing is not None:
        problem = job_problem(existing, job, probe)
        if problem is None and digest([hashes_of(i)[0] for i in range(n_blocks)]) \
                != existing.get("digests", {}).get("inputs"):
            problem = "the input rows differ from those the output was solved from"
        if problem is None:
            if work.path.exists() and (work.path / MARKER).exists():
                work.remove()
            return _result(out_path, fmt, existing, computed=0, seconds=time.perf_counter() - start)
        if not overwrite:
            raise StoreMismatchError(
                f"The output {os.fspath(out_path)!r} exists and was made by a different job "
                f"({problem}). Choose another --out, or pass --overwrite to replace it.")

    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        work.claim()
    except OSError as e:
        raise write_error(e, out_path, "the work directory") from e
    try:
        work.vet(overwrite)
        stored = work.manifest()
        if stored is not None:
            problem = job_problem(stored, job, probe)
            if problem is not None:
                if not overwrite:
                    raise StoreMismatchError(
                        f"{os.fspath(out_path)!r} has an unfinished output in "
                        f"{os.fspath(work.path)!r} made by a different job ({problem}). Pass "
                        f"--overwrite to discard it and start again, or choose another --out.")
                stored = None
        if stored is not None:
            manifest = dict(stored)
            fmt.clean(work.data)
        else:
            work.reset()
            layout = {"rows": n, "chunk_size": block_size, "chunks": n_blocks,
                      "mode": plan.mode, "mode_reason": plan.reason.split(";")[0]}
            manifest = jsonable({
                "store_version": STORE_VERSION, "complete": False, "job": job, "probe": probe,
                "plan": layout,
                "arrays": {a.name: {"shape": list(a.shape), "dtype": a.dtype} for a in arrays},
                "status_codes": {s.name.lower(): int(s.value) for s in Status},
                # the seed of the random starts: drawn once when none was given, kept for resumes
                "seed": seed if seed is not None or n_starts == 1 else
                int(np.random.SeedSequence().generate_state(1, np.uint32)[0]),
            })
            try:
                work.data.mkdir()
                work.done.mkdir()
                fmt.create(work.data, arrays)
                write_json_atomic(work.manifest_path, manifest)
            except OSError as e:
                raise write_error(e, out_path, "the new output") from e
        if explain:
            import sys

            mode_reason = manifest["plan"]["mode_reason"]
            sys.stderr.write(f"batchjac solve: {n} instances in {n_blocks} blocks of "
                             f"{block_size} (the unit of progress and resume; at most 1/"
                             f"{TARGET_BLOCKS} of the instances, at least {MIN_BLOCK}, within "
                             f"the memory budget); {mode_reason}\n")

        seed_used = manifest.get("seed")
        mode = manifest["plan"]["mode"]
        done = work.done_records(n_blocks, block_size, n)
        for index in sorted(done):
            if hashes_of(index)[0] != done[index]["input"]:
                lo, hi = unit_rows(index, block_size, n)
                if not overwrite:
                    raise StoreMismatchError(
                        f"{os.fspath(out_path)!r} has an unfinished output in "
                        f"{os.fspath(work.path)!r} solved from other inputs (rows {lo}:{hi} "
                        f"differ). Pass --overwrite to discard it, or choose another --out.")
                work.release()
                work.remove()
                return solve_to_store(
                    model, inputs, out, overwrite=overwrite, model_id=model_id, method=method,
                    max_iter=max_iter, xtol=xtol, ftol=ftol, gtol=gtol, n_starts=n_starts,
                    seed=seed, n_unknowns=n_unknowns, dtype=dtype, backend=backend,
                    backend_options=backend_options, return_covariance=return_covariance,
                    return_jacobian=return_jacobian, max_memory=max_memory,
                    block_size=block_size, progress=progress, explain=explain)

        verify_kept(fmt, work, arrays, done, block_size, n, unit="block")
        todo = [i for i in range(n_blocks) if i not in done]
        bar = progress_bar(progress, n, sum(r["hi"] - r["lo"] for r in done.values()))
        try:
            writer = fmt.writer(work.data, arrays) if todo else None
            try:
                for index in todo:
                    lo, hi = unit_rows(index, block_size, n)
                    in_hash, rows = hashes_of(index)
                    block_seed = None if seed_used is None else int(
                        np.random.SeedSequence([seed_used, lo]).generate_state(1, np.uint32)[0])
                    try:
                        res = solve(
                            model, rows["targets"], rows["known"], x0=rows["x0"],
                            bounds=None if rows["lower"] is None and rows["upper"] is None
                            else (rows["lower"], rows["upper"]),
                            method=method, max_iter=max_iter, xtol=xtol, ftol=ftol,  # type: ignore[arg-type]
                            gtol=gtol, weights=rows["weights"], sigma=rows["sigma"],
                            n_starts=n_starts, seed=block_seed, n_unknowns=k, dtype=dt,
                            mode=mode, chunk_size=(hi - lo) * n_starts if n_blocks == 1
                            else block_size * n_starts, backend=name,  # type: ignore[arg-type]
                            backend_options=options, return_covariance=return_covariance,
                            return_jacobian=return_jacobian, reproducible=True)
                    except BatchJacError as e:
                        from ._errors import add_context

                        raise add_context(e, f"block {index}, instances {lo}:{hi}") from e
                    # as stored (each array's dtype): the digest is checked against the stored
                    # bytes when the output is resumed
                    values = {a.name: np.ascontiguousarray(getattr(res, a.name), dtype=a.dtype)
                              for a in arrays}
                    result_hash = hash_arrays(list(values.values()))
                    try:
                        assert writer is not None
                        writer.write(index, lo, hi, values)
                        counts = res.summary()
                        work.record(index, lo, hi, in_hash, result_hash, {"counts": counts})
                    except OSError as e:
                        raise write_error(e, out_path, f"block {index} (instances {lo}:{hi})") from e
                    done[index] = {"lo": lo, "hi": hi, "input": in_hash, "result": result_hash,
                                   "counts": counts}
                    if bar is not None:
                        bar.update(hi - lo)
            finally:
                if writer is not None:
                    writer.close()
            totals: dict[str, int] = {}
            for index in range(n_blocks):
                for key, value in done[index].get("counts", {}).items():
                    totals[key] = totals.get(key, 0) + int(value)
            succeeded = sum(v for key, v in totals.items()
                            if Status[key.upper()].value > 0)
            final = jsonable(dict(
                manifest, complete=True,
                digests={"inputs": digest([done[i]["input"] for i in range(n_blocks)]),
                         "results": digest([done[i]["result"] for i in range(n_blocks)])},
                summary={"instances": n, "succeeded": succeeded,
                         "status_counts": dict(sorted(totals.items()))}))
            try:
                fmt.commit(work.data, out_path, final, arrays, n_blocks)
            except OSError as e:
                raise write_error(e, out_path, "the finished output") from e
        except BaseException:
            if bar is not None:
                bar.leave = False
            raise
        finally:
            if bar is not None:
                bar.close()
    finally:
        work.release()
    work.remove()
    return _result(out_path, fmt, final, computed=len(todo), seconds=time.perf_counter() - start)


# -- helpers ----------------------------------------------------------------------------------

def _is_per_row(value: Any, n: int, row_ndim: int) -> bool:
    """One row per instance (sliced by block) rather than one value for all instances."""
    if value is None or (not hasattr(value, "shape") and np.ndim(value) == 0):
        return False
    shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
    return len(shape) == row_ndim and shape[0] == n


def _head(inputs: SolveInputs, per_row: dict[str, bool], lo: int, hi: int) -> dict[str, Any]:
    """Every input for instances ``lo:hi``: per-instance inputs sliced, the others as given."""
    rows: dict[str, Any] = {}
    for key in ("targets", "known", "x0", "lower", "upper", "weights", "sigma"):
        value = getattr(inputs, key)
        if value is None:
            rows[key] = None
        elif key in ("targets", "known") or per_row.get(key):
            rows[key] = np.asarray(value[lo:hi])
        else:
            rows[key] = value if np.ndim(value) == 0 and not hasattr(value, "read") \
                else np.asarray(value)
    return rows


def _describe(value: Any, per_row: bool) -> Any:
    """Shape and dtype; the values too for inputs shared by all instances (their rows are
    not hashed per block)."""
    if value is None:
        return None
    if np.ndim(value) == 0 and not hasattr(value, "shape"):
        return float(value)
    info: dict[str, Any] = {"shape": list(value.shape), "dtype": np.dtype(value.dtype).name}
    if not per_row:
        info["sha256"] = hash_arrays([np.asarray(value)])
    return info


def _fingerprint(model: Any) -> str:
    from ._fingerprint import model_fingerprint

    return model_fingerprint(model)


def _arrays(n: int, k: int, out_shape: tuple[int, ...], dt: np.dtype, block: int,
            covariance: bool, jacobian: bool) -> list[ArrayInfo]:
    spec = [("x", (n, k), dt.name, ("instance", "unknown")),
            ("residual", (n,), "float64", ("instance",)),
            ("cost", (n,), "float64", ("instance",)),
            ("success", (n,), "bool", ("instance",)),
            ("status", (n,), "int8", ("instance",)),
            ("iterations", (n,), "int64", ("instance",)),
            ("rank", (n,), "int64", ("instance",)),
            ("rank_deficient", (n,), "bool", ("instance",)),
            ("start", (n,), "int64", ("instance",))]
    if covariance:
        spec.append(("covariance", (n, k, k), "float64", ("instance", "unknown", "unknown_2")))
    if jacobian:
        spec.append(("jacobian", (n, *out_shape, k), dt.name,
                     ("instance", *axis_names("output", out_shape), "unknown")))
    infos = []
    for name, shape, dtype, dims in spec:
        row_bytes = math.prod(shape[1:]) * np.dtype(dtype).itemsize
        infos.append(ArrayInfo(name, shape, dtype, storage_rows(block, row_bytes, n), dims, {}))
    return infos


def _result(out: Path, fmt: Format, manifest: dict[str, Any], *, computed: int,
            seconds: float) -> SolveStoreResult:
    plan, summary = manifest["plan"], manifest["summary"]
    return SolveStoreResult(
        path=os.fspath(out), format=fmt.name, instances=plan["rows"], blocks=plan["chunks"],
        block_size=plan["chunk_size"], computed_blocks=computed,
        resumed_blocks=plan["chunks"] - computed, succeeded=summary["succeeded"],
        status_counts=summary["status_counts"], seconds=seconds)


# -- formats -----------------------------------------------------------------------------------

def _summary_file(manifest: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` of a finished directory of .npy files: the status counts, the status
    codes and the options."""
    return dict(manifest["summary"], status_codes=manifest["status_codes"],
                options=manifest["job"]["options"])


_FORMATS: dict[str, Format] = {"npy-dir": NpyDirFormat(_summary_file), "zarr": FORMATS["zarr"],
                               "hdf5": FORMATS["hdf5"]}


def _solve_formats() -> dict[str, Format]:
    return _FORMATS


def read_summary(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The summary in a finished output's manifest (status counts), or None."""
    manifest = _solve_formats()[output_format(out)].read_manifest(Path(out))
    return None if manifest is None else json.loads(json.dumps(manifest["summary"]))
