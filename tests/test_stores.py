"""Resumable stores: one conformance suite, run for every format (Zarr, HDF5, .npy); each
format supplies only its suffix, how to read its column-name metadata and its chunk writer.

The model is the seed Keras model in this process; results are compared bitwise with the
in-memory ``batchjac.jacobian`` using the same chunk size and mode (the same compiled kernel).
Crashes are simulated in-process here (a write raising ENOSPC); tests/test_resume.py kills
real processes with SIGKILL.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

pytest.importorskip("tensorflow")
zarr = pytest.importorskip("zarr")
h5py = pytest.importorskip("h5py")

import batchjac  # noqa: E402
from batchjac import _stores  # noqa: E402
from batchjac._stores import (  # noqa: E402
    Store,
    StoreBusyError,
    StoreExistsError,
    StoreMismatchError,
    StoreResult,
    StoreWriteError,
    formats,
    open_store,
    read_manifest,
    workdir,
)
from batchjac.examples import seed_model, workload_inputs  # noqa: E402

from .resume_zygote import tree  # noqa: E402

N, CS = 600, 64  # 10 chunks, the last one partial
U_NAMES = ["p", "q", "r", "s", "t"]
Y_NAMES = ["y_a", "y_b", "y_c", "y_d"]


@pytest.fixture(scope="module")
def model() -> Any:
    return seed_model("tensorflow")


@pytest.fixture(scope="module")
def arrays() -> tuple[np.ndarray, np.ndarray]:
    u, k = workload_inputs("W1", N, seed=7)
    assert k is not None
    return u, k


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, arrays: tuple[np.ndarray, np.ndarray]) -> tuple[str, str]:
    """The unknowns as CSV with a header (names for the metadata), the known inputs as .npy."""
    folder = tmp_path_factory.mktemp("inputs")
    u, k = arrays
    np.savetxt(folder / "u.csv", u, delimiter=",", fmt="%.9g", header=",".join(U_NAMES), comments="")
    np.save(folder / "k.npy", k)
    return str(folder / "u.csv"), str(folder / "k.npy")


def in_memory(model: Any, u: np.ndarray, k: np.ndarray, **options: Any) -> Any:
    """The in-memory result with TensorFlow's first kernel variant (XLA), which stores always
    use: with timing on, the first call may pick the plain graph, whose last bits differ."""
    before = os.environ.get("BATCHJAC_AUTOTUNE")
    os.environ["BATCHJAC_AUTOTUNE"] = "off"
    try:
        return batchjac.jacobian(model, u, k, chunk_size=CS, mode="reverse", **options)
    finally:
        if before is None:
            del os.environ["BATCHJAC_AUTOTUNE"]
        else:
            os.environ["BATCHJAC_AUTOTUNE"] = before


@pytest.fixture(scope="module")
def reference(model: Any, arrays: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    u, k = arrays
    y, jac = in_memory(model, u, k, return_outputs=True)
    return y, jac


snapshot = tree  # every file of a finished output (relative names -> bytes)


def renamed(snap: dict[str, bytes], old: str, new: str) -> dict[str, bytes]:
    return {k.replace(old, new): v for k, v in snap.items()}


class StoreConformance:
    suffix: ClassVar[str]
    writer: ClassVar[str]  # the class in batchjac._stores.formats that writes chunks

    def names(self, out: Path) -> tuple[list[str], list[str]]:
        """(unknown names, output names) as this format stores them."""
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------
    @pytest.fixture
    def out(self, tmp_path: Path) -> Path:
        return tmp_path / f"jac{self.suffix}"

    def run(self, model: Any, files: tuple[str, str], out: Path | Store, **kw: Any) -> StoreResult:
        options = {"chunk_size": CS, "mode": "reverse", "return_outputs": True}
        options.update(kw)
        target = out if isinstance(out, Store) else Store(out, output_names=Y_NAMES)
        return batchjac.jacobian(model, files[0], files[1], out=target, **options)

    def fail_at_chunk(self, monkeypatch: pytest.MonkeyPatch, index: int) -> None:
        """Make the chunk writer raise ENOSPC ("No space left on device") at chunk ``index``."""
        cls = getattr(formats, self.writer)
        original = cls.write

        def write(self_: Any, i: int, lo: int, hi: int, values: dict[str, np.ndarray]) -> None:
            if i == index:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            original(self_, i, lo, hi, values)

        monkeypatch.setattr(cls, "write", write)

    # -- tests -----------------------------------------------------------------------------
    def test_matches_in_memory_and_records_names(self, model: Any, files: tuple[str, str], out: Path,
                                                 reference: tuple[np.ndarray, np.ndarray]) -> None:
        result = self.run(model, files, out)
        assert (result.rows, result.chunks, result.computed_chunks, result.resumed_chunks) == (N, 10, 10, 0)
        assert result.shape == (N, 4, 5)
        assert result.outputs_shape == (N, 4)
        np.testing.assert_array_equal(np.asarray(result.open()[:]), reference[1])
        np.testing.assert_array_equal(np.asarray(open_store(out, "outputs")[:]), reference[0])
        assert self.names(out) == (U_NAMES, Y_NAMES)
        manifest = read_manifest(out)
        assert manifest is not None
        assert manifest["complete"] is True
        assert manifest["plan"]["mode"] == "reverse"
        # the kernel implementation is chosen once (timed) and recorded: resumes use it too
        assert manifest["plan"]["variant"] in ("xla", "graph")
        assert not Path(str(out) + ".partial").exists()

    def test_second_run_computes_nothing(self, model: Any, files: tuple[str, str], out: Path) -> None:
        self.run(model, files, out)
        before = snapshot(out)
        again = self.run(model, files, out)
        assert (again.computed_chunks, again.resumed_chunks) == (0, 10)
        assert snapshot(out) == before

    def test_other_job_refused_unless_overwrite(self, model: Any, files: tuple[str, str], out: Path) -> None:
        self.run(model, files, out)
        with pytest.raises(StoreMismatchError, match=r"options\.chunk_size: the store has 64, this call 32"):
            self.run(model, files, out, chunk_size=32)
        changed = seed_model("tensorflow")
        changed.set_weights([w + 1e-3 for w in changed.get_weights()])
        with pytest.raises(StoreMismatchError, match="different job \\(model: the store has 'sha256:"):
            self.run(changed, files, out)
        result = self.run(changed, files, Store(out, overwrite=True, output_names=Y_NAMES))
        assert result.computed_chunks == 10
        assert self.run(changed, files, out).computed_chunks == 0

    def test_foreign_output_refused(self, model: Any, files: tuple[str, str], out: Path) -> None:
        out.write_text("somebody's file\n")
        with pytest.raises(StoreExistsError, match="exists and is not a finished batchjac output"):
            self.run(model, files, out)
        assert out.read_text() == "somebody's file\n"
        self.run(model, files, Store(out, overwrite=True))
        assert read_manifest(out) is not None

    def test_unknown_directory_never_deleted(self, model: Any, files: tuple[str, str], out: Path) -> None:
        out.mkdir()
        (out / "notes.txt").write_text("keep me\n")
        with pytest.raises(StoreExistsError):
            self.run(model, files, Store(out, overwrite=True))
        assert (out / "notes.txt").read_text() == "keep me\n"

    def test_full_disk_leaves_resumable_store(self, model: Any, files: tuple[str, str], out: Path,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        clean = tmp_path / "clean" / out.name
        self.run(model, files, clean)
        with monkeypatch.context() as m:
            self.fail_at_chunk(m, 3)
            with pytest.raises(StoreWriteError, match=r"disk is full.*run the same command again") as info:
                self.run(model, files, out)
            assert info.value.errno == errno.ENOSPC
        # incomplete: nothing under the output's names, nothing that reads as finished
        assert not out.exists()
        assert read_manifest(out) is None
        with pytest.raises(batchjac.InputError, match="not a finished batchjac output"):
            open_store(out)
        assert sorted(os.listdir(Path(str(out) + ".partial") / "done")) == [f"{i:08d}.json" for i in range(3)]
        result = self.run(model, files, out)
        assert (result.resumed_chunks, result.computed_chunks) == (3, 7)
        assert snapshot(out) == renamed(snapshot(clean), "clean/", "")

    def test_changed_inputs_detected_on_resume(self, model: Any, files: tuple[str, str], out: Path,
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               arrays: tuple[np.ndarray, np.ndarray]) -> None:
        u, k = arrays
        known = tmp_path / "k.npy"
        np.save(known, k)
        mine = (files[0], str(known))
        with monkeypatch.context() as m:
            self.fail_at_chunk(m, 3)
            with pytest.raises(StoreWriteError):
                self.run(model, mine, out)
        edited = k.copy()
        edited[70, 1] += 1.0  # in chunk 1, already done
        np.save(known, edited)
        with pytest.raises(StoreMismatchError, match="rows 64:128 of the inputs differ"):
            self.run(model, mine, out)
        edited = k.copy()
        edited[500, 1] += 1.0  # in chunk 7, not computed yet: its rows are read now anyway
        np.save(known, edited)
        result = self.run(model, mine, out)
        assert result.computed_chunks == 7
        expect = in_memory(model, u, edited)
        np.testing.assert_array_equal(np.asarray(result.open()[:]), expect)

    def test_busy_store_refused(self, model: Any, files: tuple[str, str], out: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
        with monkeypatch.context() as m:
            self.fail_at_chunk(m, 1)
            with pytest.raises(StoreWriteError):
                self.run(model, files, out)
        other = workdir.WorkDir(out)
        other.claim()  # another writer holds the lock
        try:
            with pytest.raises(StoreBusyError, match="being written by another process"):
                self.run(model, files, out)
        finally:
            other.release()
        assert self.run(model, files, out).resumed_chunks == 1

    def test_zero_rows(self, model: Any, out: Path, tmp_path: Path) -> None:
        result = batchjac.jacobian(model, np.zeros((0, 5), np.float32), np.zeros((0, 3), np.float32),
                                   out=out)
        assert result.shape == (0, 4, 5)
        assert np.asarray(result.open()[:]).shape == (0, 4, 5)

    def test_bad_names_rejected(self, model: Any, files: tuple[str, str], out: Path) -> None:
        with pytest.raises(batchjac.InputError, match="2 output names were given"):
            self.run(model, files, Store(out, output_names=["a", "b"]))


class TestZarrStore(StoreConformance):
    suffix = ".zarr"
    writer = "ZarrWriter"

    def names(self, out: Path) -> tuple[list[str], list[str]]:
        group = zarr.open_group(str(out), mode="r")
        jac = group["jacobians"]
        assert jac.metadata.dimension_names == ("row", "output", "unknown")
        assert group["outputs"].attrs["output_names"] == Y_NAMES
        return jac.attrs["unknown_names"], jac.attrs["output_names"]


class TestHDF5Store(StoreConformance):
    suffix = ".h5"
    writer = "StagedWriter"

    def names(self, out: Path) -> tuple[list[str], list[str]]:
        with h5py.File(out, "r") as f:
            assert f["jacobians"].compression == "gzip"
            return ([s.decode() for s in f["unknown_names"][:]],
                    [s.decode() for s in f["output_names"][:]])


class TestNpyStore(StoreConformance):
    suffix = ".npy"
    writer = "NpyWriter"

    def names(self, out: Path) -> tuple[list[str], list[str]]:
        meta = json.loads(out.with_name("jac.manifest.json").read_text())["metadata"]
        assert np.load(out.with_name("jac.outputs.npy")).shape == (N, 4)
        return meta["unknown_names"], meta["output_names"]


def test_unknown_output_format(tmp_path: Path) -> None:
    with pytest.raises(batchjac.InputError, match=r"Unknown output format '.txt'"):
        batchjac.jacobian(seed_model("tensorflow"), np.ones((3, 5), np.float32),
                          np.ones((3, 3), np.float32), out=tmp_path / "jac.txt")


def test_storage_chunks_divide_compute_chunks() -> None:
    assert _stores.storage_rows(32768, 80, 10**7) == 32768
    rows = _stores.storage_rows(25088, 31360, 10**5)  # W2: 31 kB a row
    assert 25088 % rows == 0
    assert rows * 31360 <= _stores.STORAGE_CHUNK_BYTES
    assert _stores.storage_rows(64, 80, 10) == 10
