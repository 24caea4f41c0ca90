"""The command line's errors that say what to do (issue 19): one line ``batchjac CMD: error:
...`` with the documented exit code (docs/cli.md), and nothing left behind. The model is one
Keras Dense layer over 8 columns, so the Jacobians that do come out are its kernel."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("zarr")

from .test_cli_common import assert_error, invoke  # noqa: E402

N = 24


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Any]:
    rng = np.random.default_rng()
    w = rng.normal(size=(8, 4)).astype("f4")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.layers[-1].kernel.assign(w)
    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "u.npy", rng.normal(size=(N, 5)).astype("f4"))
    np.save(tmp_path / "h.npy", rng.normal(size=(N, 3)).astype("f4"))
    np.save(tmp_path / "h_int.npy", rng.integers(-3, 4, size=(N, 3)))
    np.save(tmp_path / "x.npy", rng.normal(size=(N, 8)).astype("f4"))
    return {"dir": tmp_path, "w": w, "model": tmp_path / "m.keras"}


def _left(folder: Path, *names: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(names))


def test_forgotten_known_names_the_model_width(files: dict[str, Any]) -> None:
    d = files["dir"]
    for command in (["compute", "-o", d / "j.zarr", "-q"], ["check"]):
        res = invoke(command[0], files["model"], "-i", d / "u.npy", *command[1:])
        assert_error(res, command[0], 4, r"The model takes 8 input columns, --inputs \(.*u\.npy\) has "
                                         r"5; forgot --known\? Give the other columns with --known FILE")
    assert _left(d, "j.") == []


def test_integer_known_file_is_cast(files: dict[str, Any]) -> None:
    d = files["dir"]
    res = invoke("compute", files["model"], "-i", d / "u.npy", "-k", d / "h_int.npy",
                 "-o", d / "j.npy", "-q")
    assert res.exit_code == 0, res.output
    np.testing.assert_allclose(np.load(d / "j.npy"), np.broadcast_to(files["w"][:5].T, (N, 4, 5)),
                               rtol=1e-6)


@pytest.mark.parametrize(("name", "kind"), [("bytes.keras", "a zip archive"), ("bytes.h5", "an HDF5 file")])
def test_random_bytes_are_not_a_keras_file(files: dict[str, Any], name: str, kind: str) -> None:
    d = files["dir"]
    (d / name).write_bytes(os.urandom(2048))
    res = invoke("compute", d / name, "-i", d / "x.npy", "-o", d / "j.zarr", "-q")
    assert_error(res, "compute", 5, rf"Cannot load the model '.*{name}': it is not a Keras file\. "
                                    rf"A \.\w+ model is {kind}")
    assert "File not found" not in res.output


def test_non_numeric_csv_column_is_invalid_data_exit_4(files: dict[str, Any]) -> None:
    d = files["dir"]
    (d / "t.csv").write_text("a,b,c\n1,x,2\n3,y,4\n")
    res = invoke("compute", files["model"], "-i", d / "t.csv", "-o", d / "j.zarr", "-q")
    assert_error(res, "compute", 4, r"Column 'b' of '.*t\.csv' is not numeric")
    # a text value past the first block, where the column's type was inferred as a number
    rows = 700_000  # more than the 4 MiB first block
    with open(d / "late.csv", "w") as f:
        f.write("a,b\n" + "1.5,2.5\n" * rows + "3.5,oops\n")
    res = invoke("compute", files["model"], "-i", d / "late.csv", "-o", d / "j.zarr", "-q")
    assert_error(res, "compute", 4, r"'.*late\.csv' has a value that is not a number after row \d+ "
                                    r"\(.*oops.*\); batchjac reads numeric columns only")


def test_zarr_key_that_is_not_there_exits_3(files: dict[str, Any]) -> None:
    zarr = pytest.importorskip("zarr")
    d = files["dir"]
    zarr.save_array(str(d / "a.zarr"), np.load(d / "x.npy"))  # one array at the root
    res = invoke("compute", files["model"], "-i", f"{d / 'a.zarr'}:nope", "-o", d / "j.zarr", "-q")
    assert_error(res, "compute", 3, r"The Zarr store '.*a\.zarr' is one array, not a group: it has no "
                                    r"array 'nope'")
    group = zarr.open_group(str(d / "g.zarr"), mode="w")
    group.create_array("x", data=np.load(d / "x.npy"))
    res = invoke("compute", files["model"], "-i", f"{d / 'g.zarr'}:nope", "-o", d / "j.zarr", "-q")
    assert_error(res, "compute", 3, r"The Zarr store '.*g\.zarr' has no array 'nope'; it holds \['x'\]")


def _npy_with_shape(path: Path, shape: str) -> None:
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}".encode()
    header += b" " * (118 - len(header)) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(64))


@pytest.mark.parametrize(("shape", "message"), [
    ("(-5, 8)", r"not a valid \.npy file: its header gives the shape \(-5, 8\), with a negative size"),
    ("(100000000000000, 8)", r"shorter than its header says: shape \(100000000000000, 8\) of float32 "
                             r"needs 3,200,000,000,000,000 bytes, and the file holds 64"),
    ("(0, 10000000000000000000000000000)", r"shorter than its header says"),
])
def test_corrupt_npy_headers_exit_3(files: dict[str, Any], shape: str, message: str) -> None:
    d = files["dir"]
    _npy_with_shape(d / "bad.npy", shape)
    res = invoke("compute", files["model"], "-i", d / "bad.npy", "-o", d / "j.zarr", "-q")
    assert_error(res, "compute", 3, message)


def test_chunk_size_beyond_the_rows_is_capped(files: dict[str, Any]) -> None:
    d = files["dir"]
    res = invoke("compute", files["model"], "-i", d / "x.npy", "-o", d / "j.zarr", "-q", "--json",
                 "--chunk-size", 10**12)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["chunk_size"] == N


def test_bad_max_memory_leaves_nothing_behind(files: dict[str, Any]) -> None:
    d = files["dir"]
    args = ["compute", files["model"], "-i", d / "x.npy", "-o", d / "j.zarr", "-q"]
    for size in ("abc", "-5GB", "0"):
        res = invoke(*args, "--max-memory", size)
        assert res.exit_code == 2, res.output
        assert "Invalid value for '--max-memory'" in res.stderr
        assert "Traceback" not in res.output
        assert _left(d, "j.") == []
    res = invoke(*args, "--max-memory", "64MB")  # the right command then is a new job
    assert res.exit_code == 0, res.output


def test_torchscript_error_is_its_meaningful_line(files: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    d = files["dir"]
    with warnings.catch_warnings():  # torch 2.9+: "torch.jit.script is deprecated"
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh())),
                       str(d / "m.pt"))
    res = invoke("compute", d / "m.pt", "-i", d / "u.npy", "-o", d / "j.zarr", "-q")
    assert_error(res, "compute", 5, r"error: Calling the model failed: RuntimeError: mat1 and mat2 "
                                    r"shapes cannot be multiplied \(\d+x5 and 8x4\)\.?$")
    assert "<--- HERE" not in res.output
    assert "Traceback of TorchScript" not in res.output
