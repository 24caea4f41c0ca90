"""The conformance suite every kind of resumable store runs, in every format it writes.

A kind of store (Jacobians, solutions, a Hessian-shaped test kind...) plugs in with a
:class:`StoreKind`: one job of that kind, how to run it into an output, how to make a
different job, how to change one input row, and what its messages say. A test module
subclasses :class:`ResumableStoreConformance` once per kind (supplying the ``kind`` fixture)
and once per format (``suffix``: the output's suffix; ``writer``: the name of the chunk
writer class in :mod:`batchjac._stores.formats` that format uses, where interruptions are
simulated: it raises ENOSPC at a chosen unit, as a full disk would).

What is checked: a finished output is kept as it is; another job's is refused unless
overwriting; files and directories batchjac did not make are never replaced or deleted; an
interrupted store leaves nothing under the output's name and resumes exactly the units done,
ending byte-identical to an uninterrupted run; changed input rows behind a kept unit are
refused; a store being written is locked; links planted in the work directory are refused
(never followed); a kept unit changed on disk is computed again.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import batchjac
from batchjac._stores import (
    Format,
    StoreBusyError,
    StoreError,
    StoreExistsError,
    StoreMismatchError,
    StoreRecomputeWarning,
    StoreWriteError,
    formats,
    workdir,
)


def tree(fmt: Format, out: Path) -> dict[str, bytes]:
    """Every file of the finished output ``out`` (by name relative to its folder) and its bytes."""
    found: dict[str, bytes] = {}
    for p in fmt.final_paths(out):
        if p.is_dir():
            for root, _, names in os.walk(p):
                for name in names:
                    full = Path(root, name)
                    found[str(full.relative_to(out.parent))] = full.read_bytes()
        elif p.exists():
            found[p.name] = p.read_bytes()
    return found


class StoreKind:
    """One job of a kind of store, as the suite drives it (subclass and fill in)."""

    #: how the kind's messages name a finished output ("batchjac output")
    what: ClassVar[str]
    #: its unit of work ("chunk"), the file stem of its outputs ("jac")
    unit: ClassVar[str]
    stem: ClassVar[str]
    #: the job: rows, rows per unit, units
    n: ClassVar[int]
    unit_rows: ClassVar[int]
    units: ClassVar[int]
    #: the main array (where links are planted and bytes tampered with) and its shape per row
    main: ClassVar[str]
    main_shape: ClassVar[tuple[int, ...]]
    #: a row of unit 1, and a row of a unit after the first three
    edited_rows: ClassVar[tuple[int, int]]

    def run(self, out: Path, *, overwrite: bool = False, **variant: Any) -> tuple[int, int]:
        """Write the job (or the variant of it that ``variant`` names, from :meth:`others`)
        into ``out``; (units computed, units resumed)."""
        raise NotImplementedError

    def others(self) -> list[tuple[dict[str, Any], str]]:
        """Other jobs (``run`` variants) and the pattern of the refusal of each one."""
        raise NotImplementedError

    def edit(self, row: int | None) -> None:
        """Change input row ``row`` from now on (None: the inputs as they were)."""
        raise NotImplementedError

    def inputs_changed(self, lo: int, hi: int, index: int) -> str:
        """The pattern of the refusal of a store whose unit ``index`` was computed from other rows."""
        raise NotImplementedError

    def format(self, out: Path) -> Format:
        raise NotImplementedError

    def read_manifest(self, out: Path) -> dict[str, Any] | None:
        return self.format(out).read_manifest(out)

    def open(self, out: Path) -> Any:
        """Open the main array of a finished output the way the kind's users do."""
        raise NotImplementedError

    def check_values(self, out: Path) -> None:
        """Check the finished output's values against an independent reference (optional)."""


class ResumableStoreConformance:
    suffix: ClassVar[str]
    writer: ClassVar[str]  # the class in batchjac._stores.formats that writes chunks

    @pytest.fixture
    def kind(self) -> StoreKind:
        raise NotImplementedError

    @pytest.fixture
    def out(self, tmp_path: Path, kind: StoreKind) -> Path:
        return tmp_path / f"{kind.stem}{self.suffix}"

    def fail_at_chunk(self, monkeypatch: pytest.MonkeyPatch, index: int) -> None:
        """Make the chunk writer raise ENOSPC ("No space left on device") at unit ``index``."""
        cls = getattr(formats, self.writer)
        original = cls.write

        def write(self_: Any, i: int, lo: int, hi: int, values: dict[str, np.ndarray]) -> None:
            if i == index:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            original(self_, i, lo, hi, values)

        monkeypatch.setattr(cls, "write", write)

    def interrupted(self, kind: StoreKind, out: Path, monkeypatch: pytest.MonkeyPatch,
                    at: int = 3) -> Path:
        """A store whose units 0..at-1 are done, as a full disk at unit ``at`` leaves it; its
        work directory."""
        with monkeypatch.context() as m:
            self.fail_at_chunk(m, at)
            with pytest.raises(StoreWriteError, match=r"disk is full.*run the same command again") as info:
                kind.run(out)
            assert info.value.errno == errno.ENOSPC
        work = Path(f"{out}.partial")
        assert sorted(os.listdir(work / "done")) == [f"{i:08d}.json" for i in range(at)]
        return work

    def clean(self, kind: StoreKind, out: Path, tmp_path: Path) -> dict[str, bytes]:
        """The files of an uninterrupted run of the job (under the same name)."""
        clean = tmp_path / "clean" / out.name
        kind.run(clean)
        return tree(kind.format(clean), clean)

    # -- tests -----------------------------------------------------------------------------
    def test_second_run_computes_nothing(self, kind: StoreKind, out: Path) -> None:
        kind.run(out)
        before = tree(kind.format(out), out)
        assert kind.run(out) == (0, kind.units)
        assert tree(kind.format(out), out) == before

    def test_other_job_refused_unless_overwrite(self, kind: StoreKind, out: Path) -> None:
        kind.run(out)
        others = kind.others()
        for variant, message in others:
            with pytest.raises(StoreMismatchError, match=message):
                kind.run(out, **variant)
        variant = others[-1][0]
        assert kind.run(out, overwrite=True, **variant)[0] == kind.units
        assert kind.run(out, **variant)[0] == 0

    def test_foreign_output_refused(self, kind: StoreKind, out: Path) -> None:
        out.write_text("somebody's file\n")
        with pytest.raises(StoreExistsError, match=f"exists and is not a finished {kind.what}"):
            kind.run(out)
        assert out.read_text() == "somebody's file\n"
        kind.run(out, overwrite=True)
        assert kind.read_manifest(out) is not None

    def test_unknown_directory_never_deleted(self, kind: StoreKind, out: Path) -> None:
        out.mkdir()
        (out / "notes.txt").write_text("keep me\n")
        with pytest.raises(StoreExistsError, match=r"is a directory batchjac did not make; it will not "
                                                   r"delete it, even with overwrite"):
            kind.run(out, overwrite=True)
        assert (out / "notes.txt").read_text() == "keep me\n"

    def test_full_disk_leaves_resumable_store(self, kind: StoreKind, out: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
        clean = self.clean(kind, out, tmp_path)
        self.interrupted(kind, out, monkeypatch)
        # incomplete: nothing under the output's names, nothing that reads as finished
        assert not out.exists()
        assert kind.read_manifest(out) is None
        with pytest.raises(batchjac.InputError, match=f"not a finished {kind.what}"):
            kind.open(out)
        assert kind.run(out) == (kind.units - 3, 3)
        assert tree(kind.format(out), out) == clean

    def test_changed_inputs_detected_on_resume(self, kind: StoreKind, out: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
        self.interrupted(kind, out, monkeypatch)
        done_row, later_row = kind.edited_rows
        kind.edit(done_row)  # in unit 1, already done
        lo, hi = kind.unit_rows, 2 * kind.unit_rows
        with pytest.raises(StoreMismatchError, match=kind.inputs_changed(lo, hi, 1)):
            kind.run(out)
        kind.edit(later_row)  # in a unit not computed yet: its rows are read now anyway
        assert kind.run(out)[0] == kind.units - 3
        kind.check_values(out)
        assert tree(kind.format(out), out) == self.clean(kind, out, tmp_path)

    def test_busy_store_refused(self, kind: StoreKind, out: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
        self.interrupted(kind, out, monkeypatch, at=1)
        other = workdir.WorkDir(out)
        other.claim()  # another writer holds the lock
        try:
            with pytest.raises(StoreBusyError, match="being written by another process"):
                kind.run(out)
        finally:
            other.release()
        assert kind.run(out)[1] == 1

    def test_planted_link_is_refused_and_victim_untouched(
            self, kind: StoreKind, out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        clean = self.clean(kind, out, tmp_path)
        work = self.interrupted(kind, out, monkeypatch)
        link = self.unit_file(kind, work, 1)
        victim = tmp_path / "victim.npy"
        if self.suffix == ".zarr":
            victim.write_bytes(b"somebody's bytes\n" * 64)
        else:  # a valid .npy of the data file's (or the staged unit's) shape
            rows = kind.unit_rows if self.suffix == ".h5" else kind.n
            np.save(victim, np.full((rows, *kind.main_shape), 7.0))
        before = victim.read_bytes()
        link.unlink()
        link.symlink_to(victim)

        with pytest.raises(StoreError, match=re.escape(repr(os.fspath(link)))) as info:
            kind.run(out)
        assert "link" in str(info.value)
        assert victim.read_bytes() == before
        assert not os.path.lexists(out)
        # overwrite discards the unfinished store (the link, never what it points to)
        assert kind.run(out, overwrite=True)[0] == kind.units
        assert victim.read_bytes() == before
        for root, dirs, files in os.walk(out if out.is_dir() else out.parent):
            assert not any(os.path.islink(os.path.join(root, name)) for name in dirs + files)
        assert tree(kind.format(out), out) == clean

    def test_tampered_unit_is_computed_again(self, kind: StoreKind, out: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        clean = self.clean(kind, out, tmp_path)
        work = self.interrupted(kind, out, monkeypatch)
        self.tamper(kind, work, 1)
        lo, hi = kind.unit_rows, 2 * kind.unit_rows
        with pytest.warns(StoreRecomputeWarning, match=rf"{kind.unit} 1 \(rows {lo}:{hi}\).*computed again"):
            assert kind.run(out) == (kind.units - 2, 2)
        assert tree(kind.format(out), out) == clean

    # -- the work files of a unit, by format ----------------------------------------------------
    def unit_file(self, kind: StoreKind, work: Path, index: int) -> Path:
        """A work file holding the main array's result of unit ``index`` (the whole data file
        for the .npy formats)."""
        if self.suffix == ".h5":
            return work / "data" / "chunks" / f"{index:08d}.{kind.main}.npy"
        if self.suffix == ".zarr":
            chunk = work / "data" / "store.zarr" / kind.main / "c" / str(index)
            return next(p for p in sorted(chunk.rglob("*")) if p.is_file())
        return work / "data" / f"{kind.main}.npy"

    def tamper(self, kind: StoreKind, work: Path, index: int) -> None:
        """Change the stored main array of done unit ``index`` in place, as a disk error or
        another program might."""
        lo, hi = index * kind.unit_rows, (index + 1) * kind.unit_rows
        if self.suffix == ".h5":
            path = self.unit_file(kind, work, index)
            np.save(path, np.full_like(np.load(path), 99))
        elif self.suffix == ".zarr":
            import zarr

            zarr.open_group(str(work / "data" / "store.zarr"), mode="r+")[kind.main][lo:hi] = 99
        else:
            mm = np.load(work / "data" / f"{kind.main}.npy", mmap_mode="r+")
            mm[lo:hi] = 99
            mm.flush()
            del mm
