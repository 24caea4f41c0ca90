"""The resume protocol (:func:`batchjac._stores.run`) is generic over what a unit computes: a
kind of store it has never seen plugs in by describing its arrays.

The kind here stores per-instance Hessian-shaped arrays, ``hessians`` of shape
``(N, 2, 3, 3)`` (two outputs, three unknowns), from a fake per-unit function (no model, no
framework): ``H[i, j] = (j + 1) * scale * outer(x_i, x_i)``. It is written into every format
through the protocol, interrupted and resumed, and runs the conformance suite of every kind of
store (tests/store_conformance.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchjac._errors import InputError
from batchjac._stores import (
    ArraySpec,
    Format,
    HDF5Format,
    Job,
    NpyDirFormat,
    NpyFormat,
    Target,
    Unit,
    UnitFunction,
    ZarrFormat,
    hash_arrays,
    run,
)

from .store_conformance import ResumableStoreConformance, StoreKind, tree

N, ROWS = 50, 8  # 7 units, the last one short
FORMATS: dict[str, Any] = {".npy": lambda: NpyFormat("hessians"), "": NpyDirFormat,
                           ".zarr": ZarrFormat, ".h5": HDF5Format}


class Stop(Exception):
    """The interruption of a run (as a kill or Ctrl-C would)."""


def _need(suffix: str) -> None:
    if suffix == ".zarr":
        pytest.importorskip("zarr")
    if suffix == ".h5":
        pytest.importorskip("h5py")


def hessians(x: np.ndarray, scale: float) -> np.ndarray:
    """The fake per-instance result, shape (rows, 2, 3, 3)."""
    outer = np.einsum("ri,rj->rij", x, x) * scale
    return np.stack([outer, 2 * outer], axis=1)


class HessianKind(StoreKind):
    """A Hessian store: what a kind of store gives the protocol, and nothing else."""

    what, unit, stem = "batchjac output", "chunk", "hess"  # the protocol's default wording
    n, unit_rows, units = N, ROWS, 7
    main, main_shape = "hessians", (2, 3, 3)
    edited_rows = (10, 45)  # in unit 1 (rows 8:16), and in unit 5

    def __init__(self, fail_after: int | None = None) -> None:
        self.original = np.random.default_rng(3).normal(size=(N, 3))
        self.fail_after = fail_after
        self.calls = 0
        self.edit(None)

    def job(self, scale: float) -> Job:
        def rows(lo: int, hi: int) -> np.ndarray:
            return self.x[lo:hi]

        def compute(manifest: dict[str, Any]) -> UnitFunction:
            scale_ = manifest["job"]["scale"]

            def unit(index: int, lo: int, hi: int) -> Unit:
                self.calls += 1
                if self.fail_after is not None and self.calls > self.fail_after:
                    raise Stop()
                return Unit({"hessians": hessians(rows(lo, hi), scale_)}, hash_arrays([rows(lo, hi)]))

            return unit

        return Job(
            description={"kind": "hessian-test", "scale": scale}, probe=None,
            arrays=[ArraySpec("hessians", (2, 3, 3), "float64",
                              ("row", "output", "unknown", "unknown_2"), {"note": "a test kind"})],
            input_hash=lambda lo, hi: hash_arrays([rows(lo, hi)]),
            plan=lambda: {"rows": N, "chunk_size": ROWS, "chunks": -(-N // ROWS)},
            compute=compute)

    def run(self, out: Path, *, overwrite: bool = False, **variant: Any) -> tuple[int, int]:
        job = self.job(variant.get("scale", 1.0))
        outcome = run(Target(out, self.format(out), overwrite), lambda: job)
        return outcome.computed, outcome.resumed

    def others(self) -> list[tuple[dict[str, Any], str]]:
        return [({"scale": 2.0}, r"different job \(scale: the store has 1\.0, this call 2\.0\)")]

    def edit(self, row: int | None) -> None:
        self.x = self.original.copy()
        if row is not None:
            self.x[row, 1] += 1.0

    def inputs_changed(self, lo: int, hi: int, index: int) -> str:
        return rf"rows {lo}:{hi} of the inputs differ from those chunk {index} was computed from"

    def format(self, out: Path) -> Format:
        return FORMATS[out.suffix]()

    def open(self, out: Path) -> Any:
        fmt = self.format(out)
        if fmt.read_manifest(out) is None:
            raise InputError(f"{os.fspath(out)!r} is not a finished batchjac output.")
        return fmt.open(out, "hessians")

    def check_values(self, out: Path) -> None:
        np.testing.assert_array_equal(np.asarray(self.open(out)[:]), hessians(self.x, 1.0))


@pytest.mark.parametrize("suffix", list(FORMATS))
def test_a_hessian_store_plugs_in_interrupted_and_resumed(tmp_path: Path, suffix: str) -> None:
    _need(suffix)
    clean = tmp_path / "clean" / f"hess{suffix}"
    assert HessianKind().run(clean) == (7, 0)

    out = tmp_path / f"hess{suffix}"
    kind = HessianKind(fail_after=2)  # the third unit raises
    with pytest.raises(Stop):
        kind.run(out)
    assert not os.path.lexists(out)
    assert sorted(os.listdir(f"{out}.partial/done")) == ["00000000.json", "00000001.json"]

    resumed = HessianKind()
    assert resumed.run(out) == (5, 2)
    assert resumed.calls == 5  # the two units done were kept, not computed again
    assert tree(resumed.format(out), out) == tree(resumed.format(clean), clean)
    assert not os.path.lexists(f"{out}.partial")

    stored = resumed.open(out)
    assert stored.shape == (N, 2, 3, 3)
    np.testing.assert_array_equal(np.asarray(stored[:]), hessians(resumed.x, 1.0))
    manifest = resumed.format(out).read_manifest(out)
    assert manifest is not None
    assert manifest["arrays"] == {"hessians": {"shape": [N, 2, 3, 3], "dtype": "float64"}}
    if suffix == ".zarr":  # the caller's axis names and attributes are the metadata
        assert stored.metadata.dimension_names == ("row", "output", "unknown", "unknown_2")
        assert stored.attrs["note"] == "a test kind"


class HessianConformance(ResumableStoreConformance):
    @pytest.fixture
    def kind(self) -> HessianKind:
        _need(self.suffix)
        return HessianKind()


class TestHessianNpy(HessianConformance):
    suffix = ".npy"
    writer = "NpyWriter"


class TestHessianNpyDir(HessianConformance):
    suffix = ""
    writer = "NpyWriter"


class TestHessianZarr(HessianConformance):
    suffix = ".zarr"
    writer = "ZarrWriter"


class TestHessianHDF5(HessianConformance):
    suffix = ".h5"
    writer = "StagedWriter"


def test_refusals_name_the_output_its_work_directory_and_the_problem(tmp_path: Path) -> None:
    """Each refusal of the protocol by its whole message (the promise: what exists where, why
    it is not this job's, and the fix); overwriting then replaces what was refused."""
    import json

    from batchjac._errors import StoreMismatchError
    from batchjac._stores.workdir import WorkDir

    out = tmp_path / "hess.npy"
    work = os.fspath(out) + ".partial"
    with pytest.raises(Stop):
        HessianKind(fail_after=2).run(out)
    unfinished = json.loads(WorkDir(out).manifest_path.read_text())
    assert unfinished["complete"] is False
    assert "digests" not in unfinished
    with pytest.raises(StoreMismatchError) as got:
        HessianKind().run(out, scale=2.0)
    assert str(got.value) == (
        f"{os.fspath(out)!r} has an unfinished store in {work!r} made by a different job "
        f"(scale: the store has 1.0, this call 2.0). Pass overwrite=True "
        f"(--overwrite) to discard it and start again, or choose another output path.")
    edited = HessianKind()
    edited.edit(10)  # unit 1's rows
    with pytest.raises(StoreMismatchError) as got:
        edited.run(out)
    assert str(got.value) == (
        f"{os.fspath(out)!r} has an unfinished store in {work!r} made from other inputs (rows "
        f"8:16 of the inputs differ from those chunk 1 was computed from). Pass overwrite=True "
        f"(--overwrite) to discard it and start again, or choose another output path.")
    # overwriting discards the other job's units: all 7 computed, with its scale
    doubled = HessianKind()
    assert doubled.run(out, overwrite=True, scale=2.0) == (7, 0)
    np.testing.assert_array_equal(np.asarray(doubled.open(out)[:]), hessians(doubled.x, 2.0))
    manifest = doubled.format(out).read_manifest(out)
    assert manifest is not None
    assert manifest["complete"] is True
    assert sorted(manifest["digests"]) == ["inputs", "results"]
    with pytest.raises(StoreMismatchError) as got:
        HessianKind().run(out)  # the finished output is of scale 2.0
    assert str(got.value) == (
        f"The output {os.fspath(out)!r} exists and was made by a different job "
        f"(scale: the store has 2.0, this call 1.0). Choose another output path, or pass "
        f"overwrite=True (--overwrite) to replace it.")
    edited = HessianKind()
    edited.edit(45)
    with pytest.raises(StoreMismatchError, match=r"\(the input rows differ from those the output "
                                                 r"was computed from\)"):
        edited.run(out, scale=2.0)
    assert HessianKind().run(out, scale=2.0) == (0, 7)  # unchanged: found finished


# -- the protocol's parts, each by what it promises (found by `make mutate`: docs/mutation.md) --

def _run(out: Path, job: Job, **kw: Any) -> tuple[int, int]:
    outcome = run(Target(out, NpyDirFormat(), kw.pop("overwrite", False)), lambda: job, **kw)
    return outcome.computed, outcome.resumed


def test_shared_storage_chunks_follow_the_first_array_and_are_recorded() -> None:
    """``shared_chunks``: every array in storage chunks of the first one's rows (a row of
    ``big`` is just over 2 MiB, so 4 of its rows fill a 16 MiB storage chunk and 8 do not);
    ``chunk_rows``: the manifest's entries record them."""
    import dataclasses

    big, small = ArraySpec("big", (2**18 + 1,), "float64"), ArraySpec("small", (3,), "float32")
    job = dataclasses.replace(HessianKind().job(1.0), arrays=[big, small])
    plan = {"rows": 40, "chunk_size": 8}
    assert [a.chunk_rows for a in job.layout(plan)] == [4, 8]
    shared = dataclasses.replace(job, shared_chunks=True, chunk_rows=True)
    assert [a.chunk_rows for a in shared.layout(plan)] == [4, 4]
    assert shared.entries(shared.layout(plan)) == {
        "big": {"shape": [40, 2**18 + 1], "dtype": "float64", "chunk_rows": 4},
        "small": {"shape": [40, 3], "dtype": "float32", "chunk_rows": 4}}
    assert job.entries(job.layout(plan)) == {"big": {"shape": [40, 2**18 + 1], "dtype": "float64"},
                                             "small": {"shape": [40, 3], "dtype": "float32"}}


def test_a_finished_store_records_its_storage_chunk_rows(tmp_path: Path) -> None:
    import dataclasses

    job = dataclasses.replace(HessianKind().job(1.0), chunk_rows=True)
    assert _run(tmp_path / "hess", job) == (7, 0)
    manifest = NpyDirFormat().read_manifest(tmp_path / "hess")
    assert manifest is not None
    assert manifest["arrays"] == {"hessians": {"shape": [N, 2, 3, 3], "dtype": "float64",
                                               "chunk_rows": ROWS}}


def test_another_models_probe_is_refused_finished_or_unfinished(tmp_path: Path) -> None:
    """A job with a probe (the model's outputs on fixed inputs) is recognised by it too: the
    same description with other probe outputs is another model's job."""
    import dataclasses

    from batchjac._errors import StoreMismatchError

    rng = np.random.default_rng(11)
    values = rng.normal(size=4)
    probe = {"values": [float(v) for v in values], "abs_sum": float(np.abs(values).sum()), "size": 4}
    moved = dict(probe, values=[float(v) for v in values + 0.5])
    kind = HessianKind()
    job = dataclasses.replace(kind.job(1.0), probe=probe)
    other = dataclasses.replace(job, probe=moved)
    message = r"\(the model's outputs on fixed probe inputs differ from those recorded"
    out = tmp_path / "hess"
    assert _run(out, job) == (7, 0)
    with pytest.raises(StoreMismatchError, match=r"exists and was made by a different job " + message):
        _run(out, other)
    assert _run(out, job) == (0, 7)  # its own probe: found finished

    partial = tmp_path / "partial"
    with pytest.raises(Stop):
        _run(partial, dataclasses.replace(HessianKind(fail_after=2).job(1.0), probe=probe))
    with pytest.raises(StoreMismatchError, match=r"has an unfinished store in .* made by a different "
                                                 r"job " + message):
        _run(partial, other)
    assert _run(partial, job) == (5, 2)


def test_another_layout_of_the_arrays_is_refused(tmp_path: Path) -> None:
    """The same description and plan but other arrays (a dtype) is not the stored job: the
    refusal names the array's field, both values."""
    import dataclasses

    from batchjac._errors import StoreMismatchError

    job = HessianKind().job(1.0)
    single = dataclasses.replace(job, arrays=[dataclasses.replace(job.arrays[0], dtype="float32")])
    out = tmp_path / "hess"
    assert _run(out, job) == (7, 0)
    with pytest.raises(StoreMismatchError) as got:
        _run(out, single)
    assert str(got.value) == (
        f"The output {os.fspath(out)!r} exists and was made by a different job "
        f"(arrays.hessians.dtype: the store has 'float64', this call 'float32'). Choose another "
        f"output path, or pass overwrite=True (--overwrite) to replace it.")
    assert _run(out, single, overwrite=True) == (7, 0)
    manifest = NpyDirFormat().read_manifest(out)
    assert manifest is not None
    assert manifest["arrays"]["hessians"]["dtype"] == "float32"


def test_a_unit_loop_given_computes_the_units_left(tmp_path: Path) -> None:
    """``loop=`` (the Dask path's) replaces the local loop: it is handed the units left (all,
    then those after an interruption), saves each with save_chunk, in any order."""
    from batchjac._stores.units import Pending, save_chunk

    handed: list[list[int]] = []

    def loop_for(kind: HessianKind) -> Any:
        def loop(pending: Pending) -> None:
            handed.append(list(pending.todo))
            compute = kind.job(1.0).compute({"job": {"scale": 1.0}})
            writer = pending.writer()
            try:
                for index in reversed(pending.todo):
                    lo, hi = pending.bounds(index)
                    record = save_chunk(writer, pending.work, pending.arrays, index, lo, hi,
                                        compute(index, lo, hi))
                    pending.finished(index, record)
            finally:
                writer.close()
        return loop

    kind = HessianKind()
    out = tmp_path / "hess"
    assert _run(out, kind.job(1.0), loop=loop_for(kind)) == (7, 0)
    assert handed == [list(range(7))]
    assert kind.calls == 7
    np.testing.assert_array_equal(np.load(out / "hessians.npy"), hessians(kind.x, 1.0))

    partial = tmp_path / "partial"
    with pytest.raises(Stop):
        HessianKind(fail_after=2).run(partial)
    resumed = HessianKind()
    assert _run(partial, resumed.job(1.0), loop=loop_for(resumed)) == (5, 2)
    assert handed[1] == [2, 3, 4, 5, 6]
    assert resumed.calls == 5
    np.testing.assert_array_equal(np.load(partial / "hessians.npy"), hessians(resumed.x, 1.0))


def test_a_failure_before_any_unit_is_done_leaves_no_work_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first unit raising (the model's error): nothing is worth keeping, so the corrected
    command is not refused as another job; when the done records cannot be listed, the work
    directory is kept (a unit may be done)."""
    out = tmp_path / "hess"
    with pytest.raises(Stop):
        HessianKind(fail_after=0).run(out)
    assert not os.path.lexists(f"{out}.partial")
    assert not os.path.lexists(out)
    assert HessianKind().run(out, scale=2.0) == (7, 0)  # another job: not refused

    import pathlib

    listed = pathlib.Path.iterdir

    def iterdir(self: Path) -> Any:
        if self.name == "done":
            raise PermissionError(13, "Permission denied", os.fspath(self))
        return listed(self)

    blind = tmp_path / "blind"
    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "iterdir", iterdir)
        with pytest.raises(Stop):
            HessianKind(fail_after=0).run(blind)
    assert os.path.isdir(f"{blind}.partial/done")
    assert HessianKind().run(blind) == (7, 0)


def test_a_failed_commit_names_the_finished_output_and_keeps_every_unit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from batchjac._errors import StoreWriteError

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / "hess"
    with monkeypatch.context() as m:
        m.setattr(NpyDirFormat, "commit", full)
        with pytest.raises(StoreWriteError, match=rf"^Writing the finished output of "
                                                  rf"{re.escape(repr(os.fspath(out)))} failed: "
                                                  rf"the disk is full"):
            HessianKind().run(out)
    assert len(os.listdir(f"{out}.partial/done")) == 7
    kind = HessianKind()
    assert kind.run(out) == (0, 7)
    assert kind.calls == 0
    kind.check_values(out)


def test_the_recompute_warning_points_at_the_first_frame_outside_batchjac(tmp_path: Path) -> None:
    """StoreRecomputeWarning's stacklevel is found by walking out of batchjac's frames: the
    warning names the caller of the protocol (here HessianKind.run), whatever the depth."""
    import inspect

    from batchjac._errors import StoreRecomputeWarning

    out = tmp_path / "hess"
    with pytest.raises(Stop):
        HessianKind(fail_after=3).run(out)
    mm = np.load(f"{out}.partial/data/hessians.npy", mmap_mode="r+")
    mm[ROWS:2 * ROWS] = 99.0
    mm.flush()
    del mm
    lines, first = inspect.getsourcelines(HessianKind.run)
    call = first + next(i for i, line in enumerate(lines) if "outcome = run(" in line)
    with pytest.warns(StoreRecomputeWarning, match=r"chunk 1 \(rows 8:16\)") as got:
        assert HessianKind().run(out) == (5, 2)
    assert len(got) == 1
    assert (got[0].filename, got[0].lineno) == (__file__, call)


def test_a_done_unit_that_cannot_be_read_is_computed_again(tmp_path: Path) -> None:
    """A kept unit whose stored rows are gone (the data file cut short after unit 1's first
    rows) cannot be read back: it is dropped with a warning and computed again, and the
    output is still the one an uninterrupted run writes."""
    from batchjac._errors import StoreRecomputeWarning

    out = tmp_path / "hess"
    with pytest.raises(Stop):
        HessianKind(fail_after=3).run(out)
    data = Path(f"{out}.partial/data/hessians.npy")
    row = 2 * 3 * 3 * 8
    header = data.stat().st_size - N * row
    os.truncate(data, header + (ROWS + 4) * row)  # unit 0 whole, units 1 and 2 cut
    kind = HessianKind()
    with pytest.warns(StoreRecomputeWarning) as got:
        assert kind.run(out) == (6, 1)
    assert [str(w.message).split("(rows ")[1][:5] for w in got] == ["8:16)", "16:24"]
    assert kind.calls == 6
    kind.check_values(out)
    clean = tmp_path / "clean" / "hess"
    HessianKind().run(clean)
    assert tree(kind.format(out), out) == tree(kind.format(clean), clean)


def test_the_kinds_wording_names_what_is_refused(tmp_path: Path) -> None:
    """The target's wording (``what``) is the name of the output in the protocol's refusals."""
    from batchjac._errors import StoreExistsError
    from batchjac._stores.units import Wording

    out = tmp_path / "hess"
    out.write_text("somebody's file\n")
    job = HessianKind().job(1.0)
    target = Target(out, NpyDirFormat(), wording=Wording(what="Hessian store"))
    with pytest.raises(StoreExistsError) as got:
        run(target, lambda: job)
    assert str(got.value) == (
        f"The output {os.fspath(out)!r} exists and is not a finished Hessian store. Choose another "
        f"output path, or pass overwrite=True (--overwrite) to replace it.")


def test_the_outputs_directories_are_made_or_their_failure_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output in directories that do not exist yet gets them; one whose directory cannot
    be made (a file is in its way), or whose work directory cannot be claimed, is a write
    error naming which and the output."""
    import errno

    from batchjac._errors import StoreWriteError
    from batchjac._stores.workdir import WorkDir

    kind = HessianKind()
    nested = tmp_path / "a" / "b" / "hess"
    assert kind.run(nested) == (7, 0)
    kind.check_values(nested)

    (tmp_path / "afile").write_text("in the way\n")
    blocked = tmp_path / "afile" / "hess"
    with pytest.raises(StoreWriteError, match=rf"^Writing the output's directory of "
                                              rf"{re.escape(repr(os.fspath(blocked)))} failed: "):
        HessianKind().run(blocked)

    def read_only(self: WorkDir) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    out = tmp_path / "hess"
    monkeypatch.setattr(WorkDir, "claim", read_only)
    with pytest.raises(StoreWriteError, match=rf"^Writing the work directory of "
                                              rf"{re.escape(repr(os.fspath(out)))} failed: "
                                              rf"{os.strerror(errno.EROFS)}"):
        HessianKind().run(out)


def test_progress_is_off_by_default_counts_kept_rows_and_is_erased_on_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No bar unless asked; a resumed run's bar starts at the rows kept (16 of 50) and ends at
    50; a run that fails erases its bar (the error is what matters)."""
    out = tmp_path / "hess"
    assert HessianKind().run(tmp_path / "quiet") == (7, 0)
    assert capsys.readouterr().err == ""

    kind = HessianKind(fail_after=2)
    with pytest.raises(Stop):
        run(Target(out, NpyDirFormat()), lambda: kind.job(1.0), progress=True)
    failed = capsys.readouterr().err
    assert "batchjac:" in failed
    assert failed.endswith("\r")  # erased, not left

    outcome = run(Target(out, NpyDirFormat()), lambda: HessianKind().job(1.0), progress=True)
    assert (outcome.computed, outcome.resumed) == (5, 2)
    resumed = capsys.readouterr().err
    frames = [f for f in resumed.split("\r") if f.strip()]
    assert "| 16.0/50.0 [" in frames[0]
    assert "| 50.0/50.0 [" in frames[-1]
    assert resumed.endswith("\n")  # a finished bar is left
