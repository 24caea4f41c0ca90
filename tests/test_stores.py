"""Jacobian stores: the conformance suite of every kind of store (tests/store_conformance.py),
run for every format (Zarr, HDF5, .npy), and what is particular to Jacobians; each format
supplies only its suffix, how to read its column-name metadata and its chunk writer.

The model is the seed Keras model in this process; results are compared bitwise with the
in-memory ``batchjac.jacobian`` using the same chunk size and mode (the same compiled kernel).
Crashes are simulated in-process here (a write raising ENOSPC); tests/test_resume.py kills
real processes with SIGKILL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tensorflow")
zarr = pytest.importorskip("zarr")
h5py = pytest.importorskip("h5py")

import batchjac  # noqa: E402
from batchjac import _stores  # noqa: E402
from batchjac._stores import (  # noqa: E402
    Store,
    StoreResult,
    open_store,
    read_manifest,
)
from batchjac.examples import seed_model, workload_inputs  # noqa: E402

from .store_conformance import ResumableStoreConformance, StoreKind  # noqa: E402

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


class JacobianKind(StoreKind):
    """The Jacobian store's job for the conformance suite: the seed model on W1 (unknowns
    from a CSV with a header, known inputs from a .npy this kind may edit), 10 chunks."""

    what, unit, stem = "batchjac output", "chunk", "jac"
    n, unit_rows, units = N, CS, 10
    main, main_shape = "jacobians", (4, 5)
    edited_rows = (70, 500)  # in chunk 1 (rows 64:128), and in chunk 7

    def __init__(self, model: Any, files: tuple[str, str], arrays: tuple[np.ndarray, np.ndarray],
                 folder: Path) -> None:
        self.model, self.unknowns = model, files[0]
        self.u, self.k = arrays
        self.known = folder / "k.npy"
        self.edit(None)

    def run(self, out: Path, *, overwrite: bool = False, **variant: Any) -> tuple[int, int]:
        model = variant.pop("model", self.model)
        options = {"chunk_size": CS, "mode": "reverse", "return_outputs": True, **variant}
        result = batchjac.jacobian(model, self.unknowns, str(self.known),
                                   out=Store(out, overwrite=overwrite, output_names=Y_NAMES), **options)
        return result.computed_chunks, result.resumed_chunks

    def others(self) -> list[tuple[dict[str, Any], str]]:
        changed = seed_model("tensorflow")
        changed.set_weights([w + 1e-3 for w in changed.get_weights()])
        return [({"chunk_size": 32}, r"options\.chunk_size: the store has 64, this call 32"),
                ({"model": changed}, "different job \\(model: the store has 'sha256:")]

    def edit(self, row: int | None) -> None:
        self.edited = self.k.copy()
        if row is not None:
            self.edited[row, 1] += 1.0
        np.save(self.known, self.edited)

    def inputs_changed(self, lo: int, hi: int, index: int) -> str:
        return f"rows {lo}:{hi} of the inputs differ"

    def format(self, out: Path) -> Any:
        return _stores.store_format(out)

    def open(self, out: Path) -> Any:
        return open_store(out)

    def check_values(self, out: Path) -> None:
        expect = in_memory(self.model, self.u, self.edited)
        np.testing.assert_array_equal(np.asarray(open_store(out)[:]), expect)


class StoreConformance(ResumableStoreConformance):
    """The Jacobian stores: the suite every kind of store runs (tests/store_conformance.py),
    and what is particular to Jacobians (values, names, zero rows)."""

    def names(self, out: Path) -> tuple[list[str], list[str]]:
        """(unknown names, output names) as this format stores them."""
        raise NotImplementedError

    @pytest.fixture
    def kind(self, model: Any, files: tuple[str, str], arrays: tuple[np.ndarray, np.ndarray],
             tmp_path: Path) -> JacobianKind:
        return JacobianKind(model, files, arrays, tmp_path)

    # -- helpers ---------------------------------------------------------------------------
    def run(self, model: Any, files: tuple[str, str], out: Path | Store, **kw: Any) -> StoreResult:
        options = {"chunk_size": CS, "mode": "reverse", "return_outputs": True}
        options.update(kw)
        target = out if isinstance(out, Store) else Store(out, output_names=Y_NAMES)
        return batchjac.jacobian(model, files[0], files[1], out=target, **options)

    # -- tests -----------------------------------------------------------------------------
    def test_matches_in_memory_and_records_names(self, model: Any, files: tuple[str, str], out: Path,
                                                 reference: tuple[np.ndarray, np.ndarray],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
        import batchjac._tune.races

        from .helpers import race_now

        # "stores never time and never read the cache" (README): even where every race would
        # pay, a store reads no clock of the timings and leaves the tuning cache empty
        race_now(monkeypatch)
        timed: list[float] = []
        monkeypatch.setattr(batchjac._tune.races, "clock", lambda: timed.append(0.0) or 0.0)
        result = self.run(model, files, out)
        assert timed == [], "a store timed something"
        cache = Path(os.environ["BATCHJAC_CACHE_DIR"])
        assert not cache.exists() or not any(cache.rglob("*")), list(cache.rglob("*"))
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
        # the kernel implementation is the backend's first (XLA), never a timed choice, and
        # recorded: resumed chunks use it too
        assert manifest["plan"]["variant"] == "xla"
        assert not Path(str(out) + ".partial").exists()

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
