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
