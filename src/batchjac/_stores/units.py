"""The units of a store: computing them and saving each one, the same way everywhere.

A unit is a run of consecutive rows (a chunk of a Jacobian store, a block of a solve store).
Whatever computes it, locally (:func:`compute_locally`) or on a Dask worker
(:func:`save_chunk_at`), hands its named arrays to :func:`save_chunk`, the one way a unit is
saved: its data written and fsynced by the format's writer, then its done record made durable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import StoreWriteError
from .._runner import chunk_bounds
from .arrays import ArrayInfo
from .durable import write_error
from .formats import ChunkWriter, Format
from .manifest import hash_arrays
from .workdir import WorkDir


@dataclass(frozen=True)
class Unit:
    """What computing one unit gives: its arrays by name (any dtype: they are stored as the
    store's arrays are), the sha256 of the input rows it was computed from, and small JSON
    values kept in its done record (e.g. counts a summary is made of)."""

    values: Mapping[str, Any]
    input_hash: str
    record: Mapping[str, Any] = field(default_factory=dict)


#: computes unit ``index``, rows ``lo:hi``
UnitFunction = Callable[[int, int, int], Unit]


@dataclass(frozen=True)
class Wording:
    """How a kind of store names things in its messages (the defaults: Jacobian stores').
    The three templates take ``out``, ``work`` (paths, as strings) and ``problem``, or ``lo``,
    ``hi`` and ``index`` (the first unit whose input rows changed)."""

    what: str = "batchjac output"
    unit: str = "chunk"
    rows: str = "rows"
    store: str = "store"
    verb: str = "computed"
    finished_job: str = (
        "The output {out!r} exists and was made by a different job ({problem}). Choose another "
        "output path, or pass overwrite=True (--overwrite) to replace it.")
    unfinished_job: str = (
        "{out!r} has an unfinished store in {work!r} made by a different job ({problem}). Pass "
        "overwrite=True (--overwrite) to discard it and start again, or choose another output path.")
    unfinished_inputs: str = (
        "{out!r} has an unfinished store in {work!r} made from other inputs (rows {lo}:{hi} of the "
        "inputs differ from those chunk {index} was computed from). Pass overwrite=True "
        "(--overwrite) to discard it and start again, or choose another output path.")


def unit_rows(index: int, chunk_size: int, n: int) -> tuple[int, int]:
    """Rows ``lo, hi`` of unit ``index`` of ``chunk_size`` rows of ``n``."""
    chunk = chunk_bounds(index, chunk_size, n)
    return chunk.lo, chunk.hi


def as_stored(arrays: list[ArrayInfo], unit: Unit) -> Unit:
    """``unit`` with its arrays as the store holds them (each array's dtype, contiguous, in
    the order of ``arrays``): the digest of a unit's result is of these bytes."""
    values = {a.name: np.ascontiguousarray(unit.values[a.name], dtype=a.dtype) for a in arrays}
    return dataclasses.replace(unit, values=values)


def save_chunk(writer: ChunkWriter, work: WorkDir, arrays: list[ArrayInfo], index: int, lo: int,
               hi: int, unit: Unit) -> dict[str, Any]:
    """Write one computed unit (data, fsync), then record it as done: the one way a unit is
    saved, by this process or by a Dask worker. Its arrays are stored as ``arrays`` say (the
    digest is of those bytes, checked when a resumed run keeps the unit). Returns its record."""
    values = dict(as_stored(arrays, unit).values)
    result_hash = hash_arrays(list(values.values()))
    writer.write(index, lo, hi, values)
    extra = dict(unit.record)
    work.record(index, lo, hi, unit.input_hash, result_hash, extra)
    return {**extra, "lo": lo, "hi": hi, "input": unit.input_hash, "result": result_hash}


def save_chunk_at(fmt: Format, out: str | Path, arrays: list[ArrayInfo], index: int, lo: int,
                  hi: int, unit: Unit) -> dict[str, Any]:
    """:func:`save_chunk` into the store being written at ``out`` from another process (a
    Dask worker: it opens the format's writer for the unit and closes it)."""
    work = WorkDir(Path(out))
    writer = fmt.writer(work.data, arrays)
    try:
        return save_chunk(writer, work, arrays, index, lo, hi, unit)
    finally:
        writer.close()


@dataclass
class Pending:
    """The units of a store still to compute (``todo``, in order) and where their results
    go: what a unit loop (:func:`compute_locally`, or the Dask path's) is given. It reports
    each saved unit with :meth:`finished`."""

    format: Format
    work: WorkDir
    arrays: list[ArrayInfo]
    plan: dict[str, Any]
    todo: list[int]
    done: dict[int, dict[str, Any]]
    wording: Wording
    bar: Any = None

    @property
    def out(self) -> Path:
        return self.work.out

    def bounds(self, index: int) -> tuple[int, int]:
        return unit_rows(index, self.plan["chunk_size"], self.plan["rows"])

    def writer(self) -> ChunkWriter:
        try:
            return self.format.writer(self.work.data, self.arrays)
        except OSError as e:
            raise write_error(e, self.out, f"the {self.wording.store}") from e

    def write_error(self, e: OSError, index: int) -> StoreWriteError:
        lo, hi = self.bounds(index)
        return write_error(e, self.out, f"{self.wording.unit} {index} ({self.wording.rows} {lo}:{hi})")

    def finished(self, index: int, record: dict[str, Any]) -> None:
        """Unit ``index`` is saved (its record durable): count it done, show the progress."""
        self.done[index] = record
        if self.bar is not None:
            self.bar.update(record["hi"] - record["lo"])


def compute_locally(pending: Pending, compute: UnitFunction) -> None:
    """Compute the units of ``pending`` in order with ``compute``. Saving a unit (data,
    fsync, then its done record) runs in one background thread while the next unit is
    computed: fsync waits on the disk, not the CPU. At most one unit is being saved at a
    time, and records are made in unit order."""
    from concurrent.futures import Future, ThreadPoolExecutor

    writer = pending.writer()
    in_flight: tuple[Future[dict[str, Any]], int] | None = None

    def save(index: int, lo: int, hi: int, unit: Unit) -> dict[str, Any]:
        return save_chunk(writer, pending.work, pending.arrays, index, lo, hi, unit)

    def finish() -> None:
        nonlocal in_flight
        if in_flight is None:
            return
        future, index = in_flight
        in_flight = None
        try:
            record = future.result()
        except OSError as e:
            raise pending.write_error(e, index) from e
        pending.finished(index, record)

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchjac-writer")
    try:
        for index in pending.todo:
            lo, hi = pending.bounds(index)
            # converted here, not in the thread: the next unit may reuse the buffers computed
            unit = as_stored(pending.arrays, compute(index, lo, hi))
            finish()
            in_flight = (pool.submit(save, index, lo, hi, unit), index)
        finish()
    finally:
        try:  # a unit being saved when something else failed is still finished and recorded
            if in_flight is not None:
                with contextlib.suppress(Exception):
                    in_flight[0].result()
        finally:
            pool.shutdown(wait=True)
            writer.close()
