"""Resumable output for ``batchjac solve``: solutions written block by block, crash-safe.

The same resume protocol and guarantees as the Jacobian stores (:mod:`batchjac._stores`,
:func:`batchjac._stores.run`), applied to :func:`batchjac.solve`; this module only describes the
job (its inputs, options and arrays) and how one block is solved:

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

``success`` means converged *and* fitted (the fit test of :mod:`batchjac._fit`); the summary
counts both ``succeeded`` and ``local_minima`` (converged, not fitted). ``residual`` holds the
weighted residual *norm* per instance (the name is kept: outputs and resumes stay readable).

Formats: a directory of ``.npy`` files (``x.npy``, ``residual.npy``, ... with ``manifest.json``
and ``summary.json``: the default for an ``OUT`` without a suffix), or every array in one Zarr
group (``.zarr``) or HDF5 file (``.h5``/``.hdf5``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import BatchJacError, InputError
from ._stores import (
    ArraySpec,
    Format,
    HDF5Format,
    Job,
    NpyDirFormat,
    Outcome,
    Target,
    Unit,
    UnitFunction,
    Wording,
    ZarrFormat,
    dims,
    framework_version,
    hash_arrays,
    jsonable,
    probe,
    run,
)
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
    succeeded: int  #: converged and fitted (``success``)
    local_minima: int  #: converged without fitting the targets (``Status.LOCAL_MINIMUM``)
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
    fmt = result_format(path)
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
    fit_tol: float | None = None,
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
    start = time.perf_counter()
    out_path = Path(out)
    fmt = result_format(out_path)
    options = _Options(method=method, max_iter=max_iter, xtol=xtol, ftol=ftol, gtol=gtol,
                       n_starts=n_starts, seed=seed, fit_tol=fit_tol, covariance=return_covariance,
                       jacobian=return_jacobian)
    problem = _problem(model, inputs, n_unknowns=n_unknowns, n_starts=n_starts, dtype=dtype,
                       backend=backend, backend_options=backend_options, max_memory=max_memory,
                       block_size=block_size)
    job = _job(model, problem, options, model_id=model_id, fmt=fmt, explain=explain)
    outcome = run(Target(out_path, fmt, overwrite, WORDING), lambda: job, progress=progress)
    return _result(out_path, fmt, outcome, seconds=time.perf_counter() - start)


#: how solve outputs name things in their messages (the command line's options)
WORDING = Wording(
    what="batchjac solve output", unit="block", rows="instances", store="output", verb="solved",
    finished_job=("The output {out!r} exists and was made by a different job ({problem}). Choose "
                  "another --out, or pass --overwrite to replace it."),
    unfinished_job=("{out!r} has an unfinished output in {work!r} made by a different job "
                    "({problem}). Pass --overwrite to discard it and start again, or choose "
                    "another --out."),
    unfinished_inputs=("{out!r} has an unfinished output in {work!r} solved from other inputs "
                       "(rows {lo}:{hi} differ). Pass --overwrite to discard it, or choose another "
                       "--out."))


@dataclass(frozen=True)
class _Options:
    """The options of the solver that change the results (each block is solved with them)."""

    method: str
    max_iter: int
    xtol: float | None
    ftol: float | None
    gtol: float | None
    n_starts: int
    seed: int | None
    fit_tol: float | None
    covariance: bool
    jacobian: bool


@dataclass(frozen=True)
class _Problem:
    """What is solved: the inputs (``n`` instances, ``k`` unknowns, which inputs have one row
    per instance), the model bound on a probe batch (its output shape), and the blocks."""

    inputs: SolveInputs
    n: int
    k: int
    per_row: dict[str, bool]
    dtype: np.dtype
    backend: str
    backend_options: dict[str, Any]
    bound: Any
    spec: Any
    out_shape: tuple[int, ...]
    mode: str
    mode_reason: str
    block_size: int
    n_blocks: int

    def rows(self, lo: int, hi: int) -> dict[str, Any]:
        """Every input for instances ``lo:hi``."""
        return _head(self.inputs, self.per_row, lo, hi)

    def input_hash(self, rows: dict[str, Any]) -> str:
        """The sha256 of the per-instance inputs among ``rows`` (the others are in the job)."""
        parts = [rows[key] for key in sorted(rows) if rows[key] is not None and
                 (key in ("targets", "known") or self.per_row.get(key))]
        return hash_arrays([np.asarray(p) for p in parts])


def _problem(model: Any, inputs: SolveInputs, *, n_unknowns: int | None, n_starts: int,
             dtype: Any, backend: str | None, backend_options: dict[str, Any] | None,
             max_memory: int | str | None, block_size: int | None) -> _Problem:
    """The inputs checked, the model bound, the blocks chosen."""
    from ._solve.problem import _n_unknowns
    from ._validate import resolve_dtype

    n, per_row = _instances(inputs)
    head = _head(inputs, per_row, 0, min(n, 1))
    k = _n_unknowns(head["x0"], (head["lower"], head["upper"]), n_unknowns, min(n, 1))
    if n_starts < 1 or isinstance(n_starts, bool):
        raise InputError(f"`n_starts` must be an integer >= 1; got {n_starts!r}.")
    dt = resolve_dtype(dtype, [np.empty(0, a.dtype) for a in (inputs.targets, inputs.known, inputs.x0)
                               if a is not None and hasattr(a, "dtype") and a.dtype.kind == "f"
                               and getattr(a, "carries_dtype", True)])
    spec, name, options, bound = _bind(model, inputs.known, k, dt, backend, backend_options)
    out_shape = tuple(bound.output_shape)
    t = inputs.targets
    if tuple(t.shape[1:]) != out_shape:
        raise InputError(f"`targets` has shape {tuple(t.shape)}, but the model's output for one "
                         f"instance has shape {out_shape}; targets must be (N, *output_shape) = "
                         f"{(n, *out_shape)}.")
    out_ndim = 1 + len(out_shape)
    per_row["weights"] = _is_per_row(inputs.weights, n, out_ndim)
    per_row["sigma"] = _is_per_row(inputs.sigma, n, out_ndim)
    h = 0 if inputs.known is None else int(inputs.known.shape[1])
    mode, reason, block_size = _blocks(n, k, math.prod(out_shape), h, dt, n_starts, max_memory,
                                       block_size)
    return _Problem(inputs=inputs, n=n, k=k, per_row=per_row, dtype=dt, backend=name,
                    backend_options=options, bound=bound, spec=spec, out_shape=out_shape,
                    mode=mode, mode_reason=reason.split(";")[0], block_size=block_size,
                    n_blocks=-(-n // block_size) if n else 0)


def _instances(inputs: SolveInputs) -> tuple[int, dict[str, bool]]:
    """The number of instances, and which of ``x0``, ``lower``, ``upper`` have one row per
    instance; the known inputs checked to have one row per instance."""
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
    return n, {name: _is_per_row(getattr(inputs, name), n, ndim)
               for name, ndim in (("x0", 2), ("lower", 2), ("upper", 2))}


def _bind(model: Any, known: Any, k: int, dt: np.dtype, backend: str | None,
          backend_options: dict[str, Any] | None) -> tuple[Any, str, dict[str, Any], Any]:
    """The model bound on a probe batch (its output shape, and the probe that recognises it):
    (spec, backend, backend options, bound)."""
    from . import _backends
    from ._bind import prepare
    from ._validate import normalize

    rng = np.random.default_rng(20240611)
    x_probe = rng.standard_normal((4, k)).astype(dt)
    probe_inputs = (x_probe,) if known is None else (x_probe, rng.standard_normal((4, known.shape[1])))
    spec = normalize(probe_inputs, wrt=None, dtype=dt, nan_policy="propagate")
    name = backend or _backends.detect(model)
    options = backend_options or {}
    bound = prepare(model, spec, name, options)
    assert bound.output_shape is not None
    return spec, name, options, bound


def _blocks(n: int, k: int, m: int, h: int, dt: np.dtype, n_starts: int,
            max_memory: int | str | None, block_size: int | None) -> tuple[str, str, int]:
    """The mode the cost model picks (and why), and the rows of a block: at most 1/TARGET_BLOCKS
    of the instances, at least MIN_BLOCK, within the memory budget (unless given)."""
    from ._config import default_max_memory, parse_bytes
    from ._plan import make_plan

    budget = default_max_memory() if max_memory is None else parse_bytes(max_memory)
    plan = make_plan(n=max(n * n_starts, 1), k=k, m=m, in_elems=k + h, dtype=dt, mode="auto",
                     chunk_size=None, max_memory=budget)
    if block_size is None:
        by_memory = max(1, plan.chunk_size // n_starts)
        block_size = max(1, min(by_memory, max(MIN_BLOCK, -(-n // TARGET_BLOCKS))))
    elif isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size < 1:
        raise InputError(f"`block_size` must be a positive integer; got {block_size!r}.")
    return plan.mode, plan.reason, int(min(block_size, max(n, 1)))


def _job(model: Any, p: _Problem, o: _Options, *, model_id: str | None, fmt: Format,
         explain: bool) -> Job:
    """The solve output's job, for the resume protocol."""
    from ._solve import Status

    description = {
        "kind": "solve",
        "batchjac": __version__,
        "framework": framework_version(p.backend),
        "model": model_id or _fingerprint(model),
        "inputs": {key: _describe(getattr(p.inputs, key), key in ("targets", "known") or p.per_row[key])
                   for key in ("targets", "known", "x0", "lower", "upper", "weights", "sigma")},
        "options": {
            "method": o.method, "max_iter": o.max_iter, "xtol": o.xtol, "ftol": o.ftol,
            "gtol": o.gtol, "n_starts": o.n_starts, "seed": o.seed, "n_unknowns": p.k,
            # what success means (the fit test): recorded, so that an output begun before the
            # fit test existed, or with another fit_tol, is another job, not resumed into
            "fit_tol": o.fit_tol, "fit_test": "v1",
            "dtype": p.dtype.name, "backend": p.backend, "backend_options": p.backend_options,
            "covariance": o.covariance, "jacobian": o.jacobian, "block_size": p.block_size,
            "format": fmt.name,
        },
    }
    plan = {"rows": p.n, "chunk_size": p.block_size, "chunks": p.n_blocks, "mode": p.mode,
            "mode_reason": p.mode_reason}

    def extras(_: dict[str, Any]) -> dict[str, Any]:
        return {"status_codes": {s.name.lower(): int(s.value) for s in Status},
                # the seed of the random starts: drawn once when none was given, kept for resumes
                "seed": o.seed if o.seed is not None or o.n_starts == 1 else
                int(np.random.SeedSequence().generate_state(1, np.uint32)[0])}

    def announce(manifest: dict[str, Any]) -> None:
        if explain:
            sys.stderr.write(f"batchjac solve: {p.n} instances in {p.n_blocks} blocks of "
                             f"{p.block_size} (the unit of progress and resume; at most 1/"
                             f"{TARGET_BLOCKS} of the instances, at least {MIN_BLOCK}, within "
                             f"the memory budget); {manifest['plan']['mode_reason']}\n")

    return Job(description=jsonable(description), probe=probe(p.bound, p.spec),
               arrays=_arrays(p, o), input_hash=lambda lo, hi: p.input_hash(p.rows(lo, hi)),
               plan=lambda: dict(plan), compute=lambda manifest: _solver(model, p, o, manifest),
               extras=extras, summary=lambda done: _summary(p.n, done), announce=announce)


def _solver(model: Any, p: _Problem, o: _Options, manifest: dict[str, Any]) -> UnitFunction:
    """The function solving one block, in the mode and with the seed the output recorded."""
    from . import _solve
    from ._errors import add_context

    seed, mode = manifest.get("seed"), manifest["plan"]["mode"]
    names = [a.name for a in _arrays(p, o)]

    def block(index: int, lo: int, hi: int) -> Unit:
        rows = p.rows(lo, hi)
        block_seed = None if seed is None else int(
            np.random.SeedSequence([seed, lo]).generate_state(1, np.uint32)[0])
        try:
            res = _solve.solve(
                model, rows["targets"], rows["known"], x0=rows["x0"],
                bounds=None if rows["lower"] is None and rows["upper"] is None
                else (rows["lower"], rows["upper"]),
                method=o.method, max_iter=o.max_iter, xtol=o.xtol, ftol=o.ftol,  # type: ignore[arg-type]
                gtol=o.gtol, weights=rows["weights"], sigma=rows["sigma"],
                n_starts=o.n_starts, seed=block_seed, fit_tol=o.fit_tol, n_unknowns=p.k,
                dtype=p.dtype,
                mode=mode, chunk_size=(hi - lo) * o.n_starts if p.n_blocks == 1
                else p.block_size * o.n_starts, backend=p.backend,  # type: ignore[arg-type]
                backend_options=p.backend_options, return_covariance=o.covariance,
                return_jacobian=o.jacobian, reproducible=True)
        except BatchJacError as e:
            raise add_context(e, f"block {index}, instances {lo}:{hi}") from e
        return Unit({name: getattr(res, name) for name in names}, p.input_hash(rows),
                    {"counts": res.summary()})

    return block


def _summary(n: int, done: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The finished output's summary: status counts over every block's record."""
    from ._solve import Status

    totals: dict[str, int] = {}
    for index in sorted(done):
        for key, value in done[index].get("counts", {}).items():
            totals[key] = totals.get(key, 0) + int(value)
    succeeded = sum(v for key, v in totals.items() if Status[key.upper()].value > 0)
    return {"summary": {"instances": n, "succeeded": succeeded,
                        "local_minima": totals.get(Status.LOCAL_MINIMUM.name.lower(), 0),
                        "status_counts": dict(sorted(totals.items()))}}


def _arrays(p: _Problem, o: _Options) -> list[ArraySpec]:
    """The results per instance: the solution and its diagnostics, the covariance and the
    Jacobian at the solution when asked for."""
    specs = [ArraySpec("x", (p.k,), p.dtype.name, ("instance", "unknown")),
             ArraySpec("residual", (), "float64", ("instance",)),
             ArraySpec("cost", (), "float64", ("instance",)),
             ArraySpec("success", (), "bool", ("instance",)),
             ArraySpec("status", (), "int8", ("instance",)),
             ArraySpec("iterations", (), "int64", ("instance",)),
             ArraySpec("rank", (), "int64", ("instance",)),
             ArraySpec("rank_deficient", (), "bool", ("instance",)),
             ArraySpec("start", (), "int64", ("instance",))]
    if o.covariance:
        specs.append(ArraySpec("covariance", (p.k, p.k), "float64", ("instance", "unknown", "unknown_2")))
    if o.jacobian:
        specs.append(ArraySpec("jacobian", (*p.out_shape, p.k), p.dtype.name,
                               ("instance", *dims("output", p.out_shape), "unknown")))
    return specs


def _result(out: Path, fmt: Format, outcome: Outcome, *, seconds: float) -> SolveStoreResult:
    plan, summary = outcome.manifest["plan"], outcome.manifest["summary"]
    return SolveStoreResult(
        path=os.fspath(out), format=fmt.name, instances=plan["rows"], blocks=plan["chunks"],
        block_size=plan["chunk_size"], computed_blocks=outcome.computed,
        resumed_blocks=outcome.resumed, succeeded=summary["succeeded"],
        local_minima=summary.get("local_minima", 0), status_counts=summary["status_counts"],
        seconds=seconds)


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


# -- formats -----------------------------------------------------------------------------------

def _summary_file(manifest: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` of a finished directory of .npy files: the status counts, the status
    codes and the options."""
    return dict(manifest["summary"], status_codes=manifest["status_codes"],
                options=manifest["job"]["options"])


_FORMATS: dict[str, Format] = {"npy-dir": NpyDirFormat(_summary_file), "zarr": ZarrFormat(),
                               "hdf5": HDF5Format()}


def result_format(out: str | os.PathLike[str]) -> Format:
    """The format of the solve output at ``out`` (by its suffix)."""
    return _FORMATS[output_format(out)]


def read_summary(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The summary in a finished output's manifest (status counts), or None."""
    manifest = result_format(out).read_manifest(Path(out))
    return None if manifest is None else json.loads(json.dumps(manifest["summary"]))
