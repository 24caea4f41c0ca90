"""``batchjac compute`` in-process (click's CliRunner): results against the Python API, the
metadata, and every documented error: one line on stderr, no traceback, its exit code."""

from __future__ import annotations

import errno
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

pytest.importorskip("tensorflow")
zarr = pytest.importorskip("zarr")
h5py = pytest.importorskip("h5py")
keras = pytest.importorskip("keras")

import batchjac  # noqa: E402
from batchjac._stores import formats  # noqa: E402
from batchjac.cli import cli  # noqa: E402
from batchjac.cli.options import parse_wrt  # noqa: E402
from batchjac.examples import seed_model, workload_inputs  # noqa: E402

N = 300
NAMES = ["x1", "x2", "h1", "x3", "h2", "x4", "h3", "x5"]  # unknowns x*, spread among the known h*


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli")
    model = seed_model("tensorflow")
    model.save(path / "seed.keras")
    u, k = workload_inputs("W1", N, seed=5)
    assert k is not None
    np.save(path / "u.npy", u)
    np.save(path / "k.npy", k)
    np.save(path / "k_short.npy", k[:-1])
    # one table with the unknowns and known inputs interleaved, and a header
    order = [0, 1, 5, 2, 6, 3, 7, 4]
    table = np.concatenate([u, k], axis=1)[:, order]
    np.savetxt(path / "table.csv", table, delimiter=",", fmt="%.9g", header=",".join(NAMES), comments="")
    bad = u.copy()
    bad[123, 2] = np.nan
    np.save(path / "u_nan.npy", bad)
    (path / "model.py").write_text(
        "import tensorflow as tf\n"
        "from batchjac.examples import seed_model\n"
        "net = seed_model('tensorflow')\n"
        "def model(x):\n"
        "    return tf.tanh(net(x))\n"
    )
    return path


@pytest.fixture(scope="module")
def api(folder: Path) -> dict[str, np.ndarray]:
    """Reference results of the Python API, chunk size and mode as in the CLI calls, and its
    kernels as the stores': the first variant, not timed (TensorFlow's graph, when timed the
    faster, differs from XLA in the last bits)."""
    u, k = np.load(folder / "u.npy"), np.load(folder / "k.npy")
    model = seed_model("tensorflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHJAC_AUTOTUNE", "off")
        y, jac = batchjac.jacobian(model, u, k, chunk_size=128, mode="reverse",
                                   return_outputs=True)
    return {"y": y, "jac": jac, "u": u, "k": k}


def invoke(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=True)


def assert_error(result: Result, code: int, pattern: str) -> None:
    """A user error: the exit code, and one line on stderr with no traceback. (A progress bar
    that was on screen is erased with carriage returns: what a terminal shows is what is left
    after the last one on each line.)"""
    assert result.exit_code == code, (result.exit_code, result.output, result.stderr, result.exception)
    shown = [line.rsplit("\r", 1)[-1].strip() for line in result.stderr.split("\n")]
    lines = [line for line in shown if line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("batchjac compute: error: ")
    assert "Traceback" not in result.output + result.stderr
    assert re.search(pattern, lines[0]), lines[0]


def test_help_and_version() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    assert "compute" in result.output
    result = invoke("--version")
    assert result.exit_code == 0
    assert batchjac.__version__ in result.output
    result = invoke("compute", "-h")
    assert result.exit_code == 0
    for option in ("--inputs", "--known", "--wrt", "--out", "--with-outputs", "--json", "--quiet",
                   "--overwrite", "--trust-model", "--mode", "--chunk-size", "--max-memory", "--dtype",
                   "--backend", "--nan-policy"):
        assert option in result.output


def test_parse_wrt() -> None:
    assert parse_wrt("0,1,4") == [0, 1, 4]
    assert parse_wrt("0:3") == [0, 1, 2]
    assert parse_wrt("2-4") == [2, 3, 4]
    assert parse_wrt("x1, x2,h3") == ["x1", "x2", "h3"]
    assert parse_wrt("-1") == [-1]


def test_compute_to_zarr_matches_api(folder: Path, tmp_path: Path, api: dict[str, np.ndarray]) -> None:
    out = tmp_path / "jac.zarr"
    args = ["compute", folder / "seed.keras", "-i", folder / "u.npy", "-k", folder / "k.npy",
            "-o", out, "--with-outputs", "--chunk-size", 128, "--mode", "reverse", "--json",
            "--output-names", "a,b,c,d"]
    result = invoke(*args)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["rows"] == N
    assert summary["mode"] == "reverse"
    assert summary["chunk_size"] == 128
    assert summary["output"] == str(out)
    assert summary["computed_chunks"] == 3
    assert "rows ->" in result.stderr  # the summary line; the progress bar goes there too
    group = zarr.open_group(str(out), mode="r")
    np.testing.assert_allclose(group["jacobians"][:], api["jac"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(group["outputs"][:], api["y"], rtol=1e-6, atol=1e-7)
    assert group["jacobians"].attrs["output_names"] == ["a", "b", "c", "d"]
    # the same command again: nothing to do
    again = invoke(*args)
    assert again.exit_code == 0
    assert json.loads(again.stdout)["resumed_chunks"] == 3


def test_csv_columns_by_name_to_hdf5(folder: Path, tmp_path: Path, api: dict[str, np.ndarray]) -> None:
    out = tmp_path / "jac.h5"
    result = invoke("compute", folder / "seed.keras", "-i", folder / "table.csv",
                    "--wrt", "x1,x2,x3,x4,x5", "-o", out, "-q", "--chunk-size", 128)
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""  # --quiet
    # the model takes the table's rows as they are; the unknowns are columns 0, 1, 3, 5, 7
    table = np.loadtxt(folder / "table.csv", delimiter=",", skiprows=1, dtype=np.float32)
    ref = batchjac.jacobian(seed_model("tensorflow"), table, wrt=[0, 1, 3, 5, 7])
    with h5py.File(out, "r") as f:
        np.testing.assert_allclose(f["jacobians"][:], ref, rtol=1e-5, atol=1e-6)
        assert [s.decode() for s in f["unknown_names"][:]] == ["x1", "x2", "x3", "x4", "x5"]
    # ranges and indices select the same columns
    same = invoke("compute", folder / "seed.keras", "-i", folder / "table.csv", "--wrt", "0-1,3,5:8:2",
                  "-o", tmp_path / "b.h5", "-q", "--chunk-size", 128)
    assert_error(same, 4, "names column '5:8:2'")  # neither a range nor a column name
    same = invoke("compute", folder / "seed.keras", "-i", folder / "table.csv", "--wrt", "0-1,3,5,7",
                  "-o", tmp_path / "b.h5", "-q", "--chunk-size", 128)
    assert same.exit_code == 0, same.stderr
    with h5py.File(tmp_path / "b.h5", "r") as f, h5py.File(out, "r") as g:
        np.testing.assert_array_equal(f["jacobians"][:], g["jacobians"][:])


def test_python_file_model_to_npy(folder: Path, tmp_path: Path, api: dict[str, np.ndarray]) -> None:
    out = tmp_path / "jac.npy"
    result = invoke("compute", f"{folder / 'model.py'}:model", "-i", folder / "u.npy", "-k",
                    folder / "k.npy", "-o", out, "-q", "--json")
    assert result.exit_code == 0, result.stderr
    jac = np.load(out)
    y = np.tanh(api["y"].astype(np.float64))
    expect = (1 - y**2)[:, :, None] * api["jac"]  # d tanh(f) = (1 - tanh^2) df
    np.testing.assert_allclose(jac, expect, rtol=1e-4, atol=1e-6)
    assert json.loads((tmp_path / "jac.manifest.json").read_text())["complete"] is True


def test_torchscript_model(folder: Path, tmp_path: Path, api: dict[str, np.ndarray]) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "seed.pt"
    with warnings.catch_warnings():  # torch 2.9+: "torch.jit.script is deprecated"
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(seed_model("torch")), str(path))
    out = tmp_path / "jac.zarr"
    result = invoke("compute", path, "-i", folder / "u.npy", "-k", folder / "k.npy", "-o", out, "-q")
    assert result.exit_code == 0, result.stderr
    np.testing.assert_allclose(zarr.open_group(str(out), mode="r")["jacobians"][:], api["jac"],
                               rtol=1e-4, atol=1e-6)


def test_file_errors(folder: Path, tmp_path: Path) -> None:
    m, u, k = folder / "seed.keras", folder / "u.npy", folder / "k.npy"
    out = tmp_path / "jac.zarr"
    assert_error(invoke("compute", tmp_path / "nope.keras", "-i", u, "-o", out), 3,
                 "model '.*nope.keras' does not exist")
    assert_error(invoke("compute", m, "-i", tmp_path / "nope.npy", "-o", out), 3,
                 "--inputs file '.*nope.npy' does not exist")
    (tmp_path / "x.dat").write_bytes(b"123")
    assert_error(invoke("compute", m, "-i", tmp_path / "x.dat", "-o", out), 3,
                 "Unknown --inputs format '.dat'")
    assert_error(invoke("compute", m, "-i", u, "-o", tmp_path / "jac.txt"), 3,
                 "Unknown output format '.txt'")
    assert_error(invoke("compute", folder / "u.npy", "-i", u, "-o", out), 3,
                 "Unknown model format '.npy'")
    (tmp_path / "broken.keras").write_bytes(b"not a zip")
    assert_error(invoke("compute", tmp_path / "broken.keras", "-i", u, "-k", k, "-o", out), 5,
                 "Cannot load the model")


def test_input_errors(folder: Path, tmp_path: Path) -> None:
    m, u, k = folder / "seed.keras", folder / "u.npy", folder / "k.npy"
    out = tmp_path / "jac.zarr"
    assert_error(invoke("compute", m, "-i", u, "-k", folder / "k_short.npy", "-o", out), 4,
                 "has 299 rows but --inputs .* has 300")
    assert_error(invoke("compute", m, "-i", folder / "table.csv", "--wrt", "x1,zz", "-o", out), 4,
                 "names column 'zz', which .* does not have; its columns are")
    assert_error(invoke("compute", m, "-i", folder / "u_nan.npy", "-k", k, "-o", out), 4,
                 r"non-finite value \(nan\) in row 123")
    result = invoke("compute", m, "-i", u, "-k", k, "--wrt", "0", "-o", out)
    assert result.exit_code == 2
    assert "--wrt" in result.stderr


def test_output_exists_and_other_jobs(folder: Path, tmp_path: Path) -> None:
    m, u, k = folder / "seed.keras", folder / "u.npy", folder / "k.npy"
    out = tmp_path / "jac.npy"
    out.write_text("not ours")
    refused = invoke("compute", m, "-i", u, "-k", k, "-o", out)
    assert_error(refused, 6, "exists and is not a finished batchjac output.*--overwrite")
    # (the API's "overwrite=True (--overwrite)" reads as the flag once, not "--overwrite (--overwrite)")
    assert "pass --overwrite to replace it" in refused.stderr
    assert "(--overwrite)" not in refused.stderr
    assert invoke("compute", m, "-i", u, "-k", k, "-o", out, "-q", "--overwrite").exit_code == 0
    assert_error(invoke("compute", m, "-i", u, "-k", k, "-o", out, "--dtype", "float64"), 6,
                 r"different job \(options\.dtype: the store has 'float32', this call 'float64'\)")
    assert invoke("compute", m, "-i", u, "-k", k, "-o", out, "-q", "--dtype", "float64",
                  "--overwrite").exit_code == 0
    assert np.load(out).dtype == np.float64


def test_unsafe_keras_model_needs_trust(folder: Path, tmp_path: Path) -> None:
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Lambda(lambda t: t * 2.0)(keras.layers.Dense(4)(inp)))
    model.save(tmp_path / "lambda.keras")
    args = ["compute", tmp_path / "lambda.keras", "-i", folder / "u.npy", "-k", folder / "k.npy",
            "-o", tmp_path / "jac.zarr", "-q"]
    assert_error(invoke(*args), 5, "safe mode.*--trust-model")
    result = invoke(*args, "--trust-model")
    assert result.exit_code == 0, result.stderr


def test_full_disk_then_resume(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, u, k = folder / "seed.keras", folder / "u.npy", folder / "k.npy"
    out = tmp_path / "jac.zarr"
    args = ["compute", m, "-i", u, "-k", k, "-o", out, "--chunk-size", 64, "--json", "-q"]
    original = formats.ZarrWriter.write

    def write(self: Any, index: int, lo: int, hi: int, values: dict[str, np.ndarray]) -> None:
        if index == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self, index, lo, hi, values)

    with monkeypatch.context() as mp:
        mp.setattr(formats.ZarrWriter, "write", write)
        assert_error(invoke(*args), 7, "disk is full.*run the same command again")
    assert not out.exists()
    result = invoke(*args)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["resumed_chunks"], summary["computed_chunks"]) == (2, 3)


def test_savedmodel_and_torch_export(folder: Path, tmp_path: Path, api: dict[str, np.ndarray]) -> None:
    seed_model("tensorflow").export(str(tmp_path / "saved"), verbose=False)
    out = tmp_path / "sm.zarr"
    result = invoke("compute", tmp_path / "saved", "-i", folder / "u.npy", "-k", folder / "k.npy",
                    "-o", out, "-q", "--mode", "forward")
    assert result.exit_code == 0, result.stderr
    np.testing.assert_allclose(zarr.open_group(str(out), mode="r")["jacobians"][:], api["jac"],
                               rtol=1e-4, atol=1e-6)
    torch = pytest.importorskip("torch")
    program = torch.export.export(seed_model("torch"), (torch.zeros(2, 8),),
                                  dynamic_shapes=({0: torch.export.Dim("rows")},))
    torch.export.save(program, str(tmp_path / "seed.pt2"))
    out = tmp_path / "ex.zarr"
    result = invoke("compute", tmp_path / "seed.pt2", "-i", folder / "u.npy", "-k", folder / "k.npy",
                    "-o", out, "-q")
    assert result.exit_code == 0, result.stderr
    np.testing.assert_allclose(zarr.open_group(str(out), mode="r")["jacobians"][:], api["jac"],
                               rtol=1e-4, atol=1e-6)
