"""``batchjac hessian`` in-process (click's CliRunner): results against the Python API, the
resume of a finished store, and its errors (one line on stderr, the documented exit code)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

pytest.importorskip("tensorflow")
pytest.importorskip("zarr")
keras = pytest.importorskip("keras")

import batchjac  # noqa: E402
from batchjac.cli import cli  # noqa: E402
from batchjac.examples import seed_model, workload_inputs  # noqa: E402

N = 90


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli-hessian")
    seed_model("tensorflow").save(path / "seed.keras")
    u, k = workload_inputs("W1", N, seed=7)
    assert k is not None
    np.save(path / "u.npy", u)
    np.save(path / "k.npy", k)
    return path


def invoke(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=True)


@pytest.mark.parametrize(("flag", "name", "shape"), [
    (None, "hessians", (N, 4, 5, 5)), ("--diagonal", "diagonals", (N, 4, 5)),
    ("--laplacian", "laplacians", (N, 4))])
def test_hessian_command_matches_the_api(folder: Path, tmp_path: Path, flag: str | None,
                                         name: str, shape: tuple[int, ...]) -> None:
    import zarr

    out = tmp_path / "h.zarr"
    args = ["hessian", folder / "seed.keras", "-i", folder / "u.npy", "-k", folder / "k.npy",
            "-o", out, "--chunk-size", 32, "--with-jacobian", "--json", *([flag] if flag else [])]
    result = invoke(*args)
    assert result.exit_code == 0, (result.stderr, result.exception)
    summary = json.loads(result.stdout)
    assert summary["rows"] == N
    assert summary["computed_chunks"] == 3
    assert tuple(summary["shape"]) == shape
    group = zarr.open_group(str(out), mode="r")
    u, k = np.load(folder / "u.npy"), np.load(folder / "k.npy")
    model = seed_model("tensorflow")
    kw = {"diagonal": flag == "--diagonal", "laplacian": flag == "--laplacian"}
    jac, want = batchjac.hessian(model, u, k, chunk_size=32, return_jacobian=True, **kw)
    np.testing.assert_allclose(group[name][:], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(group["jacobians"][:], jac, rtol=1e-5, atol=1e-6)
    again = invoke(*args)  # finished: nothing computed
    assert again.exit_code == 0
    assert json.loads(again.stdout)["resumed_chunks"] == 3


def test_hessian_command_errors(folder: Path, tmp_path: Path) -> None:
    result = invoke("hessian", folder / "seed.keras", "-i", folder / "u.npy", "-k",
                    folder / "k.npy", "-o", tmp_path / "h.zarr", "--diagonal", "--laplacian")
    assert result.exit_code != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("batchjac hessian: error: ")
    assert "--diagonal and --laplacian" in lines[0]
    assert "Traceback" not in result.stderr
    bad = invoke("hessian", folder / "seed.keras", "-i", folder / "u.npy", "-o",
                 tmp_path / "h.txt")
    assert bad.exit_code != 0
    assert "Unknown output format" in bad.stderr


def test_help_lists_the_command() -> None:
    result = invoke("--help")
    assert "hessian" in result.output
    result = invoke("hessian", "-h")
    for option in ("--diagonal", "--laplacian", "--with-jacobian", "--mode", "--out"):
        assert option in result.output


@pytest.mark.parametrize(("flag", "estimator", "name", "shape"), [
    ("--laplacian", "hutch++", "laplacians", (N, 4, 2)),
    ("--diagonal", "hutchinson", "diagonals", (N, 4, 5, 2))])
def test_hessian_command_estimates(folder: Path, tmp_path: Path, flag: str, estimator: str,
                                   name: str, shape: tuple[int, ...]) -> None:
    """--estimator: the store holds each estimate and its standard error, as the API's."""
    import zarr

    out = tmp_path / "e.zarr"
    result = invoke("hessian", folder / "seed.keras", "-i", folder / "u.npy", "-k",
                    folder / "k.npy", "-o", out, flag, "--estimator", estimator, "--samples", 6,
                    "--seed", 2, "--json")
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert tuple(json.loads(result.stdout)["shape"]) == shape
    stored = zarr.open_group(str(out), mode="r")[name][:]
    u, k = np.load(folder / "u.npy"), np.load(folder / "k.npy")
    want = batchjac.hessian(seed_model("tensorflow"), u, k, estimator=estimator, samples=6,
                            seed=2, diagonal=flag == "--diagonal", laplacian=flag == "--laplacian")
    np.testing.assert_allclose(stored[..., 0], want.value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stored[..., 1], want.stderr, rtol=1e-5, atol=1e-6)
    bad = invoke("hessian", folder / "seed.keras", "-i", folder / "u.npy", "-k",
                 folder / "k.npy", "-o", tmp_path / "f.zarr", "--estimator", "hutchinson")
    assert bad.exit_code == 4, (bad.stderr, bad.exception)
    assert "pass laplacian=True" in bad.stderr
