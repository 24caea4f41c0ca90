"""``batchjac jvp`` and ``batchjac vjp`` in-process (click's CliRunner): the stored products
against the Python API and the closed-form Jacobians of the seed model's Keras file, one and
several directions, the resume of a finished store, and a wrong directions file named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

pytest.importorskip("tensorflow")
pytest.importorskip("zarr")
pytest.importorskip("keras")

import batchjac
from batchjac.cli import cli
from batchjac.examples import seed_model, workload_inputs

N = 70


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli-products")
    seed_model("tensorflow").save(path / "seed.keras")
    u, k = workload_inputs("W1", N, seed=9)
    assert k is not None
    g = np.random.default_rng(10)
    np.save(path / "u.npy", u)
    np.save(path / "k.npy", k)
    np.save(path / "v.npy", g.normal(size=(N, 5)).astype(np.float32))
    np.save(path / "v3.npy", g.normal(size=(N, 3, 5)).astype(np.float32))
    np.save(path / "c.npy", g.normal(size=(N, 4)).astype(np.float32))
    return path


def invoke(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=True)


@pytest.mark.parametrize(("verb", "option", "file", "shape"), [
    ("jvp", "--tangents", "v.npy", (N, 4)), ("jvp", "--tangents", "v3.npy", (N, 3, 4)),
    ("vjp", "--cotangents", "c.npy", (N, 5))])
def test_product_commands_match_the_api(folder: Path, tmp_path: Path, verb: str, option: str,
                                        file: str, shape: tuple[int, ...]) -> None:
    import zarr

    out = tmp_path / "p.zarr"
    args = [verb, folder / "seed.keras", "-i", folder / "u.npy", "-k", folder / "k.npy",
            option, folder / file, "-o", out, "--chunk-size", 32, "--with-outputs", "--json"]
    result = invoke(*args)
    assert result.exit_code == 0, (result.stderr, result.exception)
    summary = json.loads(result.stdout)
    assert summary["rows"] == N
    assert summary["computed_chunks"] == 3
    assert tuple(summary["shape"]) == shape
    u, k, vec = (np.load(folder / name) for name in ("u.npy", "k.npy", file))
    jac = np.asarray(batchjac.jacobian(seed_model("tensorflow"), u, k), np.float64)  # (N, 4, 5)
    want = np.einsum("nmk,n...k->n...m", jac, vec) if verb == "jvp" else \
        np.einsum("nm,nmk->nk", vec, jac)
    group = zarr.open_group(str(out), mode="r")
    got = np.asarray(group[f"{verb}s"][:], np.float64)
    assert got.shape == shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert group["outputs"].shape == (N, 4)
    again = invoke(*args)  # finished: nothing computed
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["computed_chunks"] == 0


def test_a_directions_file_of_the_wrong_shape_is_named(folder: Path, tmp_path: Path) -> None:
    result = invoke("vjp", folder / "seed.keras", "-i", folder / "u.npy", "-k", folder / "k.npy",
                    "--cotangents", folder / "v.npy", "-o", tmp_path / "p.zarr")
    assert result.exit_code != 0
    assert "`cotangents` has shape (70, 5)" in result.stderr
