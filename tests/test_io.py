"""Input files read by rows: every format against the array it was written from, column names,
streaming (chunks read as rows, not whole files) and the errors for bad files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac._io import InputFileError, Reader, open_input, split_key
from batchjac._spec import BatchSpec
from batchjac._validate import normalize

from .helpers import without_dac_capabilities

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

COLUMNS = ("a", "b", "c", "d", "e")


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(257, 5)).astype(np.float32)


def _write(kind: str, folder: Path, x: np.ndarray) -> str:
    """Write ``x`` in format ``kind`` and return the reference to open it by."""
    if kind == "npy":
        np.save(folder / "x.npy", x)
        return str(folder / "x.npy")
    if kind == "npy-fortran":
        np.save(folder / "xf.npy", np.asfortranarray(x))
        return str(folder / "xf.npy")
    if kind == "npz":
        np.savez(folder / "x.npz", other=x[:3], x=x)
        return f"{folder / 'x.npz'}:x"
    if kind == "npz-compressed":
        np.savez_compressed(folder / "xc.npz", x=x)
        return str(folder / "xc.npz")
    if kind == "csv":
        np.savetxt(folder / "x.csv", x, delimiter=",", header=",".join(COLUMNS), comments="")
        return str(folder / "x.csv")
    if kind == "tsv":
        np.savetxt(folder / "x.tsv", x, delimiter="\t", header="\t".join(COLUMNS), comments="")
        return str(folder / "x.tsv")
    if kind == "parquet":
        table = pa.table({c: x[:, i] for i, c in enumerate(COLUMNS)})
        pq.write_table(table, folder / "x.parquet", row_group_size=50)
        return str(folder / "x.parquet")
    if kind == "hdf5":
        with h5py.File(folder / "x.h5", "w") as f:
            f.create_dataset("group/x", data=x, chunks=(32, 5))
            f["group/x"].attrs["columns"] = list(COLUMNS)
        return f"{folder / 'x.h5'}:/group/x"
    if kind == "zarr":
        group = zarr.open_group(str(folder / "x.zarr"), mode="w")
        arr = group.create_array("x", shape=x.shape, dtype=x.dtype, chunks=(40, 5))
        arr[:] = x
        arr.attrs["columns"] = list(COLUMNS)
        return f"{folder / 'x.zarr'}:x"
    raise AssertionError(kind)


KINDS = ["npy", "npy-fortran", "npz", "npz-compressed", "csv", "tsv", "parquet", "hdf5", "zarr"]
NAMED = {"csv", "tsv", "parquet", "hdf5", "zarr"}


@pytest.mark.parametrize("kind", KINDS)
def test_reader_matches_array(kind: str, tmp_path: Path, data: np.ndarray) -> None:
    ref = _write(kind, tmp_path, data)
    with open_input(ref) as r:
        assert isinstance(r, Reader)
        assert r.shape == data.shape
        assert (len(r), r.ndim) == (257, 2)
        assert r.columns == (COLUMNS if kind in NAMED else None)
        assert r.dtype == (np.float64 if kind in ("csv", "tsv") else np.float32)
        assert r.carries_dtype is (kind not in ("csv", "tsv"))
        got = r.read(0, 257)
        np.testing.assert_array_equal(got.astype(np.float32), data)  # CSV holds exact decimals
        assert got.flags.writeable
        # row slices across chunk / row-group boundaries, steps, indices, negative rows
        np.testing.assert_array_equal(r[45:163].astype(np.float32), data[45:163])
        np.testing.assert_array_equal(r[250:999].astype(np.float32), data[250:])
        np.testing.assert_array_equal(r[::50].astype(np.float32), data[::50])
        np.testing.assert_array_equal(r[[3, 200, 7]].astype(np.float32), data[[3, 200, 7]])
        np.testing.assert_array_equal(r[-1].astype(np.float32), data[-1])
        np.testing.assert_array_equal(r[10:12, 1:3].astype(np.float32), data[10:12, 1:3])
        assert r[5:5].shape == (0, 5)
        assert np.asarray(r).shape == data.shape


def test_split_key(tmp_path: Path) -> None:
    assert split_key("data.npz:x") == ("data.npz", "x")
    assert split_key("plain.npy") == ("plain.npy", None)
    odd = tmp_path / "a:b.npy"  # a path that exists as given keeps its colon
    np.save(odd, np.zeros((2, 2)))
    assert split_key(str(odd)) == (str(odd), None)


@pytest.mark.parametrize(
    ("make", "ref", "message"),
    [
        (None, "missing.npy", "does not exist"),
        (lambda p: (p / "x.txt").write_text("1,2\n"), "x.txt", "Unknown input format '.txt'"),
        (lambda p: (p / "bad.npy").write_bytes(b"not numpy"), "bad.npy", "not a valid .npy file"),
        (lambda p: np.savez(p / "two.npz", a=np.ones(3), b=np.ones(3)), "two.npz",
         r"holds 2 arrays \['a', 'b'\]; name one as"),
        (lambda p: np.savez(p / "one.npz", a=np.ones(3)), "one.npz:zz", "has no array 'zz'"),
        (lambda p: np.save(p / "k.npy", np.ones(3)), "k.npy:key", "a ':key' suffix selects"),
        (lambda p: os.mkdir(p / "folder"), "folder", "is a directory, not a Zarr store"),
        (lambda p: h5py.File(p / "g.h5", "w").create_group("g").file.close(), "g.h5:/g",
         "a group, not a dataset"),
        (lambda p: (p / "t.npy").write_bytes(_truncated_npy()), "t.npy", "shorter than its header"),
        (lambda p: zarr.save_array(str(p / "a.zarr"), np.ones((3, 2))), "a.zarr:nope",
         "is one array, not a group: it has no array 'nope'"),
    ],
)
def test_bad_files(tmp_path: Path, make: Any, ref: str, message: str) -> None:
    if make is not None:
        make(tmp_path)
    with pytest.raises(InputFileError, match=message):
        _open_and_read(str(tmp_path / ref))


@pytest.mark.parametrize(
    ("make", "ref", "message"),
    [
        (lambda p: (p / "s.csv").write_text("a,name\n1,x\n"), "s.csv", "Column 'name' .* is not numeric"),
        (lambda p: pq.write_table(pa.table({"a": [1.0], "s": ["x"]}), p / "s.parquet"), "s.parquet",
         "Column 's' .* is not numeric"),
        (lambda p: np.save(p / "o.npy", np.array([{}, 1], dtype=object)), "o.npy", "holds Python objects"),
        (lambda p: h5py.File(p / "s.h5", "w").create_dataset("s", data=np.array([b"a"])).file.close(),
         "s.h5:/s", "batchjac reads real numbers only"),
    ],
)
def test_non_numeric_data_is_invalid_input_not_a_bad_file(tmp_path: Path, make: Any, ref: str,
                                                          message: str) -> None:
    """Text columns, objects and strings are invalid data (CLI exit 4), not unreadable files (3)."""
    make(tmp_path)
    with pytest.raises(batchjac.InputTypeError, match=message) as caught:
        _open_and_read(str(tmp_path / ref))
    assert not isinstance(caught.value, InputFileError)


def _open_and_read(ref: str) -> None:
    """Open, and read every row: a truncated file is found when its rows are read."""
    with open_input(ref) as r:
        r.read(0, len(r))


def _truncated_npy() -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.ones((100, 4), np.float32))
    return buf.getvalue()[:-64]


def test_unreadable_file(tmp_path: Path) -> None:
    """A file the OS refuses to open is named as not readable. Root reads any file through its
    DAC capabilities, so as root (CI) the same check runs in a child process that has dropped
    them: the kernel then refuses it as it refuses any user."""
    import subprocess
    import sys

    path = tmp_path / "x.npy"
    np.save(path, np.ones((3, 2)))
    path.chmod(0)
    if os.geteuid() != 0:
        with pytest.raises(InputFileError, match=r"x\.npy' is not readable \(permission denied\)"):
            open_input(str(path))
        return
    code = ("import sys\nfrom batchjac._errors import InputFileError\nfrom batchjac._io import open_input\n"
            "try:\n    open_input(sys.argv[1])\nexcept InputFileError as e:\n    print('refused:', e)\n")
    child = subprocess.run(without_dac_capabilities([sys.executable, "-c", code, str(path)]),
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr
    assert "x.npy' is not readable (permission denied)" in child.stdout, child.stdout + child.stderr


def test_readers_are_lazy_batch_inputs(tmp_path: Path, data: np.ndarray) -> None:
    """A reader in a BatchSpec is read chunk by chunk: each chunk reads only its rows."""
    ref = _write("csv", tmp_path, data)
    reads: list[tuple[int, int]] = []
    with open_input(ref) as r:
        original = r._read

        def counting(lo: int, hi: int) -> np.ndarray:
            reads.append((lo, hi))
            return original(lo, hi)

        r._read = counting  # type: ignore[method-assign]
        spec = normalize((r,), wrt=["c", "a"], dtype=None, nan_policy="raise")
        assert isinstance(spec, BatchSpec)
        assert spec.arrays[0] is r
        assert spec.dtype == np.float32  # CSV text carries no float64 intent
        assert spec.layout.columns == (2, 0)
        assert reads == []  # nothing read up front, not even for the NaN check
        u, ctx = spec.chunk(100, 164)
        assert reads == [(100, 164)]
        np.testing.assert_array_equal(u, data[100:164][:, [2, 0]])
        np.testing.assert_array_equal(ctx[0], data[100:164][:, [1, 3, 4]])


def test_nan_found_in_the_chunk_that_holds_it(tmp_path: Path, data: np.ndarray) -> None:
    x = data.copy()
    x[200, 3] = np.nan
    np.save(tmp_path / "x.npy", x)
    spec = normalize((str(tmp_path / "x.npy"),), wrt=None, dtype=None, nan_policy="raise")
    spec.chunk(0, 100)  # clean rows pass
    with pytest.raises(batchjac.InputError, match=r"non-finite value \(nan\) in row 200 at \(3,\)"):
        spec.chunk(150, 250)
    spec = normalize((str(tmp_path / "x.npy"),), wrt=None, dtype=None, nan_policy="propagate")
    assert np.isnan(spec.chunk(150, 250)[0]).any()


def test_unknown_column_name(tmp_path: Path, data: np.ndarray) -> None:
    ref = _write("parquet", tmp_path, data)
    with pytest.raises(batchjac.InputError, match=r"names column 'zz', which .* its columns are \['a'"):
        normalize((ref,), wrt=["a", "zz"], dtype=None, nan_policy="raise")
    np.save(tmp_path / "plain.npy", data)
    with pytest.raises(batchjac.InputError, match="has no column names; give column indices"):
        normalize((str(tmp_path / "plain.npy"),), wrt=["a", "b"], dtype=None, nan_policy="raise")


def test_memmap_and_h5_inputs_stream(tmp_path: Path, data: np.ndarray) -> None:
    np.save(tmp_path / "x.npy", data)
    mm = np.load(tmp_path / "x.npy", mmap_mode="r")
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["x"] = data
    with h5py.File(tmp_path / "x.h5", "r") as f:
        for source in (mm, f["x"]):
            spec = normalize((source,), wrt=slice(0, 2), dtype=None, nan_policy="raise")
            assert spec.finite_check == (True,)
            u, _ = spec.chunk(10, 20)
            np.testing.assert_array_equal(u, data[10:20, :2])


@pytest.mark.parametrize("delimiter", [",", "\t"])
def test_text_without_header_keeps_its_first_row(tmp_path: Path, delimiter: str) -> None:
    """A first row of numbers is data, not column names: none of the 200 rows is lost."""
    x = np.random.default_rng(19).normal(size=(200, 4))
    x[0, 2] = 1.5  # a first row with repeated-looking values too
    path = tmp_path / ("x.csv" if delimiter == "," else "x.tsv")
    np.savetxt(path, x, delimiter=delimiter, fmt="%.17g")
    with open_input(str(path)) as r:
        assert r.shape == (200, 4)
        assert r.columns is None
        np.testing.assert_array_equal(r.read(0, 200), x)
    with pytest.raises(batchjac.InputError, match="has no column names; give column indices"):
        normalize((str(path),), wrt=["a"], dtype=None, nan_policy="raise")

    np.savetxt(path, x, delimiter=delimiter, fmt="%.17g", header=delimiter.join("abcd"),
               comments="")
    with open_input(str(path)) as r:
        assert r.shape == (200, 4)
        assert r.columns == ("a", "b", "c", "d")
        np.testing.assert_array_equal(r.read(0, 200), x)


def test_text_with_numbered_header_reads_it_as_names(tmp_path: Path) -> None:
    """pandas writes a frame made from an array with the header 0,1,2,...: those are names."""
    x = np.random.default_rng(20).normal(size=(30, 3))
    path = tmp_path / "x.csv"
    np.savetxt(path, x, delimiter=",", fmt="%.17g", header="0,1,2", comments="")
    with open_input(str(path)) as r:
        assert r.shape == (30, 3)
        assert r.columns == ("0", "1", "2")
        np.testing.assert_array_equal(r.read(0, 30), x)


@pytest.mark.parametrize("version", [(3, 10, 14), (3, 12, 1)])
def test_zarr_missing_says_what_to_do_on_each_python(tmp_path: Path, version: tuple[int, ...],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without zarr, reading a Zarr input and writing a Zarr store name the fix: the io extra,
    or, on Python 3.10 (zarr 3 needs 3.11, and the extra leaves it out there), the formats that
    work there. pyproject's markers say the same."""
    import builtins
    import sys
    tomllib = pytest.importorskip("tomllib")

    zarr_dir = tmp_path / "in.zarr"
    zarr_dir.mkdir()
    (zarr_dir / "zarr.json").write_text("{}")
    real_import = builtins.__import__

    def no_zarr(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "zarr" or name.startswith("zarr."):
            raise ImportError("No module named 'zarr'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_zarr)
    monkeypatch.delitem(sys.modules, "zarr", raising=False)
    monkeypatch.setattr(sys, "version_info", version)
    old = version < (3, 11)
    want = "zarr 3 needs Python 3.11 or later and this is Python 3.10" if old else \
        r"pip install batchjac\[io\]"
    with pytest.raises(InputFileError, match=want):
        open_input(str(zarr_dir))
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(batchjac.InputError, match=want):
        batchjac.jacobian(jnp.sin, np.ones((4, 2), np.float32), out=str(tmp_path / "j.zarr"))
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    for extra in ("io", "dask"):
        zarr_req = [r for r in extras[extra] if r.startswith("zarr")]
        assert zarr_req == ["zarr>=3; python_version >= '3.11'"], (extra, zarr_req)
