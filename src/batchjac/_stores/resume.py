"""The resume protocol: the one way every kind of store is written, resumed and committed.

A kind of store (Jacobians, solutions...) describes its job (:class:`Job`: what identifies it,
the arrays it holds per instance, how to hash a unit's input rows, how to compute a unit) and
calls :func:`run` with its output (:class:`Target`). The protocol then:

1. sweeps the remains of interrupted deletions and checks the target (:func:`check_target`):
   a finished output of the same job (its inputs unchanged) is returned as it is; one of a
   different job is refused unless overwriting, and so is anything batchjac may not replace;
2. claims the work directory's lock and vets it (no links, nothing but files and folders);
3. reads the unfinished store's manifest (a different job's is refused unless overwriting,
   then discarded) or creates a new store (its plan, its arrays, its manifest);
4. loads the done records, re-hashes the input rows of every done unit (changed rows are
   refused unless overwriting, which starts again) and reads every kept result back against
   its digest (:func:`verify_kept`: a changed one is computed again);
5. computes the other units (:func:`~.units.compute_locally`, or the caller's unit loop, e.g.
   on Dask), each saved by :func:`~.units.save_chunk`;
6. commits the output with the digests of every unit's inputs and results, and removes the
   work directory.

Nothing here knows what the arrays are: their names, shapes and metadata come from the caller.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import StoreError, StoreExistsError, StoreMismatchError, StoreRecomputeWarning
from .arrays import ArrayInfo, ArraySpec, layout
from .durable import write_error, write_json_atomic
from .formats import Format
from .manifest import STORE_VERSION, difference, digest, hash_arrays, job_problem, jsonable
from .progress import progress_bar
from .units import Pending, UnitFunction, Wording, compute_locally, unit_rows
from .workdir import WorkDir


def _nothing(*_: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Job:
    """A store's job, as its kind describes it to the protocol.

    - ``description``: what identifies the job (JSON; compared exactly on resume), and
      ``probe``: the model's outputs on fixed inputs (:func:`~.manifest.probe`; compared with a
      tolerance), or None for a job its description identifies;
    - ``arrays``: the arrays of the store, per instance;
    - ``input_hash(lo, hi)``: the sha256 of input rows ``lo:hi`` (checked for kept units);
    - ``plan()``: a new store's plan: ``rows``, ``chunk_size`` (rows per unit), ``chunks``
      (units), and whatever else fixes the result (recorded, and read back on resume);
    - ``compute(manifest)``: the function computing a unit of the store of that manifest
      (called once, when there are units to compute);
    - ``extras(plan)``: more fields of a new store's manifest; ``summary(done)``: more fields
      of the finished manifest, made from the done records (by index);
    - ``announce(manifest)``: told the store's manifest before any unit is computed;
    - ``shared_chunks``: every array stored in chunks of the first one's rows (else each its
      own); ``chunk_rows``: record each array's storage chunk rows in the manifest.
    """

    description: dict[str, Any]
    probe: dict[str, Any] | None
    arrays: Sequence[ArraySpec]
    input_hash: Callable[[int, int], str]
    plan: Callable[[], dict[str, Any]]
    compute: Callable[[dict[str, Any]], UnitFunction]
    extras: Callable[[dict[str, Any]], dict[str, Any]] = _nothing
    summary: Callable[[dict[int, dict[str, Any]]], dict[str, Any]] = _nothing
    announce: Callable[[dict[str, Any]], None] | None = None
    shared_chunks: bool = False
    chunk_rows: bool = False

    def layout(self, plan: Mapping[str, Any]) -> list[ArrayInfo]:
        """The store's arrays for ``plan``."""
        return layout(self.arrays, plan["rows"], plan["chunk_size"], self.shared_chunks)

    def entries(self, arrays: list[ArrayInfo]) -> dict[str, Any]:
        """The manifest's ``arrays``: shape and dtype of each (and its storage chunk rows)."""
        return {a.name: {"shape": list(a.shape), "dtype": a.dtype,
                         **({"chunk_rows": a.chunk_rows} if self.chunk_rows else {})}
                for a in arrays}


@dataclass(frozen=True)
class Target:
    """Where a store goes: its path and format, whether a different job's output (or
    unfinished store) there may be replaced, and its kind's wording."""

    path: Path
    format: Format
    overwrite: bool = False
    wording: Wording = field(default_factory=Wording)


@dataclass(frozen=True)
class Outcome:
    """A finished store: its manifest, and how many units this run computed and kept."""

    manifest: dict[str, Any]
    computed: int
    resumed: int


#: a unit loop in place of :func:`compute_locally` (the Dask path's)
UnitLoop = Callable[[Pending], None]


def run(target: Target, describe: Callable[[], Job], *,
        progress: bool | Callable[[int], None] = False, loop: UnitLoop | None = None) -> Outcome:
    """Write (or resume, or find finished) the store of the job ``describe()`` gives at
    ``target`` (see the module docstring). ``describe`` is called once the target has been
    checked; ``loop`` computes the units left in place of the local loop."""
    out, work = target.path, WorkDir(target.path)
    work.sweep()
    existing = check_target(out, target.format, work, target.overwrite, target.wording.what)
    job = describe()
    if existing is not None and _finished(target, work, job, existing):
        return Outcome(existing, computed=0, resumed=existing["plan"]["chunks"])
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(e, out, "the output's directory") from e
    try:
        work.claim()
    except OSError as e:
        raise write_error(e, out, "the work directory") from e
    try:
        work.vet(target.overwrite)
        return _write(target, work, job, progress, loop)
    finally:
        work.release()


def check_target(out: Path, fmt: Format, work: WorkDir, overwrite: bool,
                 what: str = "batchjac output") -> dict[str, Any] | None:
    """The manifest of the finished output at ``out`` (None if there is none), after refusing
    what batchjac may not replace: a file or directory that is not a finished output (unless
    ``overwrite``, and never a directory batchjac did not make) and a work directory that is
    not batchjac's."""
    existing = fmt.read_manifest(out) if os.path.lexists(out) else None
    if os.path.lexists(out) and existing is None:
        if not overwrite:
            raise StoreExistsError(
                f"The output {os.fspath(out)!r} exists and is not a finished {what}. Choose "
                f"another output path, or pass overwrite=True (--overwrite) to replace it.")
        if not fmt.removable(out):
            raise StoreExistsError(
                f"The output {os.fspath(out)!r} is a directory batchjac did not make; it will not "
                f"delete it, even with overwrite. Remove it yourself or choose another path.")
    if not work.ours():
        raise StoreExistsError(
            f"{os.fspath(work.path)!r} exists but was not made by batchjac (batchjac keeps "
            f"unfinished outputs there). Move it away, or choose another output path.")
    if existing is None and not overwrite:
        for sibling in fmt.foreign_siblings(out, work):
            raise StoreExistsError(
                f"{os.fspath(sibling)!r} exists beside the output {os.fspath(out)!r}, where "
                f"batchjac keeps the output's other files, and is not part of a finished {what}. "
                f"Choose another output path, or pass overwrite=True (--overwrite) to write the "
                f"output anyway (a file batchjac does not write is left as it is).")
    return existing


def _problem(stored: dict[str, Any], job: Job) -> str | None:
    """Why the manifest ``stored`` is not of ``job`` (None when it is): the job, the probe,
    or the arrays this job would write into a store of that plan."""
    problem = job_problem(stored, job.description, job.probe)
    if problem is None and isinstance(stored.get("plan"), dict):
        problem = difference(stored.get("arrays"), job.entries(job.layout(stored["plan"])), "arrays")
    return problem


def _finished(target: Target, work: WorkDir, job: Job, existing: dict[str, Any]) -> bool:
    """Whether the finished output (manifest ``existing``) is this job's, computed from these
    inputs; a different one is refused unless overwriting."""
    problem = _problem(existing, job)
    if problem is None:
        plan = existing["plan"]
        hashes = [job.input_hash(*unit_rows(i, plan["chunk_size"], plan["rows"]))
                  for i in range(plan["chunks"])]
        if digest(hashes) != existing.get("digests", {}).get("inputs"):
            problem = f"the input rows differ from those the output was {target.wording.verb} from"
    if problem is None:
        if work.marked():
            work.remove()  # left over from a kill after the commit
        return True
    if not target.overwrite:
        raise StoreMismatchError(target.wording.finished_job.format(
            out=os.fspath(target.path), problem=problem))
    return False


def _write(target: Target, work: WorkDir, job: Job, progress: bool | Callable[[int], None],
           loop: UnitLoop | None) -> Outcome:
    """Steps 3 to 6 of the protocol, the lock held. A failure before any unit is done (the
    model's or the inputs', while planning or on the first unit) leaves no work directory:
    nothing in it is worth keeping, and the corrected command (another mode, a fixed model)
    must not be refused as "a different job". Errors about the store itself leave it as it is."""
    try:
        return _write_units(target, work, job, progress, loop)
    except BaseException as e:
        if not isinstance(e, StoreError) and not _any_done(work):
            work.remove()
        raise


def _write_units(target: Target, work: WorkDir, job: Job,
                 progress: bool | Callable[[int], None], loop: UnitLoop | None) -> Outcome:
    while True:
        manifest, arrays = _open(target, work, job)
        if job.announce is not None:
            job.announce(manifest)
        done = _kept(target, work, job, manifest, arrays)
        if done is not None:
            break
        work.reset()  # overwriting a store of other inputs: start again
    plan = manifest["plan"]
    todo = [i for i in range(plan["chunks"]) if i not in done]
    bar = progress_bar(progress, plan["rows"], sum(r["hi"] - r["lo"] for r in done.values()))
    try:
        if todo:
            pending = Pending(target.format, work, arrays, plan, todo, done, target.wording, bar)
            if loop is None:
                compute_locally(pending, job.compute(manifest))
            else:
                loop(pending)
        final = _commit(target, work, job, manifest, arrays, done)
    except BaseException:
        if bar is not None:  # erase the bar: the error message is what matters now
            bar.leave = False
        raise
    finally:
        if bar is not None:
            bar.close()
    work.remove()
    return Outcome(final, computed=len(todo), resumed=plan["chunks"] - len(todo))


def _any_done(work: WorkDir) -> bool:
    """Whether a done record exists on disk (one may have been written after ``done``)."""
    try:
        return work.done.is_dir() and any(work.done.iterdir())
    except OSError:
        return True  # cannot tell: keep the work directory


def _open(target: Target, work: WorkDir, job: Job) -> tuple[dict[str, Any], list[ArrayInfo]]:
    """The manifest and arrays of the unfinished store of ``job`` (a new one if there is
    none; a different job's is refused unless overwriting, then discarded)."""
    stored = work.manifest()
    if stored is not None:
        problem = _problem(stored, job)
        if problem is not None:
            if not target.overwrite:
                raise StoreMismatchError(target.wording.unfinished_job.format(
                    out=os.fspath(target.path), work=os.fspath(work.path), problem=problem))
            stored = None
    if stored is None:
        return _create(target, work, job)
    manifest = dict(stored)
    try:
        target.format.reclaim(work.data, target.path, manifest)
    except OSError as e:
        raise write_error(e, target.path, f"the {target.wording.store}") from e
    target.format.clean(work.data)
    return manifest, job.layout(manifest["plan"])


def _create(target: Target, work: WorkDir, job: Job) -> tuple[dict[str, Any], list[ArrayInfo]]:
    """A new store of ``job`` in the (emptied) work directory; its manifest, written last,
    makes it exist."""
    work.reset()
    plan = job.plan()
    arrays = job.layout(plan)
    manifest = jsonable({
        "store_version": STORE_VERSION, "complete": False, "job": job.description, "plan": plan,
        "probe": job.probe, "arrays": job.entries(arrays), **job.extras(plan),
    })
    try:
        work.data.mkdir()
        work.done.mkdir()
        target.format.create(work.data, arrays)
        write_json_atomic(work.manifest_path, manifest)  # the store now exists
    except OSError as e:
        raise write_error(e, target.path, f"the new {target.wording.store}") from e
    return manifest, arrays


def _kept(target: Target, work: WorkDir, job: Job, manifest: dict[str, Any],
          arrays: list[ArrayInfo]) -> dict[int, dict[str, Any]] | None:
    """The done records that may be kept, by index: every one's input rows unchanged (else
    refused, or None to start again when overwriting), every one's result intact (else
    dropped, to be computed again)."""
    plan = manifest["plan"]
    cs, n = plan["chunk_size"], plan["rows"]
    done = work.done_records(plan["chunks"], cs, n)
    for index in sorted(done):  # the rows behind every kept result must be the same rows
        lo, hi = unit_rows(index, cs, n)
        if job.input_hash(lo, hi) != done[index]["input"]:
            if not target.overwrite:
                raise StoreMismatchError(target.wording.unfinished_inputs.format(
                    out=os.fspath(target.path), work=os.fspath(work.path), lo=lo, hi=hi,
                    index=index))
            return None
    verify_kept(target.format, work, arrays, done, cs, n, unit=target.wording.unit)
    return done


def _commit(target: Target, work: WorkDir, job: Job, manifest: dict[str, Any],
            arrays: list[ArrayInfo], done: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Commit the finished store (every unit done); its final manifest."""
    units = range(manifest["plan"]["chunks"])
    final = jsonable(dict(
        manifest, complete=True,
        digests={"inputs": digest([done[i]["input"] for i in units]),
                 "results": digest([done[i]["result"] for i in units])},
        **job.summary(done)))
    try:
        target.format.commit(work.data, target.path, final, arrays, len(units))
    except OSError as e:
        raise write_error(e, target.path, "the finished output") from e
    return final


def verify_kept(fmt: Format, work: WorkDir, arrays: list[ArrayInfo],
                done: dict[int, dict[str, Any]], chunk_size: int, n: int,
                unit: str = "chunk") -> None:
    """Read every done unit back and compare it with the digest of the result recorded when
    it was written; a unit that differs (or cannot be read) is dropped from ``done`` and its
    record deleted, so it is computed again: the finished output is then still the one an
    uninterrupted run writes, and nothing is returned that the model did not compute."""
    for index in sorted(done):
        lo, hi = unit_rows(index, chunk_size, n)
        try:
            intact = hash_arrays(fmt.read_chunk(work.data, arrays, index, lo, hi)) \
                == done[index].get("result")
        except (OSError, ValueError, KeyError):
            intact = False
        if intact:
            continue
        warnings.warn(
            f"{os.fspath(work.out)!r}: the stored result of {unit} {index} (rows {lo}:{hi}) in "
            f"{os.fspath(work.path)!r} differs from the digest recorded when it was written (it "
            f"was changed on disk since); it is computed again.", StoreRecomputeWarning,
            stacklevel=_outside())  # batchjac's caller
        work.forget(index)
        del done[index]


def _outside() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller point at the
    first frame outside batchjac (the caller of ``jacobian()``, ``solve()``...)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "batchjac":
        frame, level = frame.f_back, level + 1
    return level
