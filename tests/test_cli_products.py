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


def test_divergence_command_exact_and_estimated(tmp_path: Path) -> None:
    import keras
    import zarr

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(6)])
    model.save(tmp_path / "flow.keras")
    x = np.random.default_rng(11).normal(size=(N, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    exact = batchjac.divergence(model, x)
    out = tmp_path / "div.zarr"
    args = ["divergence", tmp_path / "flow.keras", "-i", tmp_path / "x.npy", "-o", out,
            "--chunk-size", 32, "--json"]
    result = invoke(*args)
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert json.loads(result.stdout)["computed_chunks"] == 3
    stored = np.asarray(zarr.open(str(out), mode="r")["divergences"])
    np.testing.assert_allclose(stored, exact, rtol=1e-5, atol=1e-6)
    again = invoke(*args)
    assert again.exit_code == 0
    assert json.loads(again.stdout)["computed_chunks"] == 0
    est_out = tmp_path / "est.zarr"
    result = invoke("divergence", tmp_path / "flow.keras", "-i", tmp_path / "x.npy", "-o", est_out,
                    "--estimator", "hutch++", "--samples", 9, "--seed", 3, "--json")
    assert result.exit_code == 0, (result.stderr, result.exception)
    stored = np.asarray(zarr.open(str(est_out), mode="r")["divergences"])
    want = batchjac.divergence(model, x, estimator="hutch++", samples=9, seed=3)
    assert stored.shape == (N, 2)
    np.testing.assert_allclose(stored[:, 0], want.value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stored[:, 1], want.stderr, rtol=1e-5, atol=1e-6)
    bad = invoke("divergence", tmp_path / "flow.keras", "-i", tmp_path / "x.npy", "-o",
                 tmp_path / "bad.zarr", "--estimator", "hutch++", "--samples", 3)
    assert bad.exit_code != 0
    assert "`samples` must be an int >= 4" in bad.stderr
