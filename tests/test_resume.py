"""Crash-safe resume with real processes killed by SIGKILL.

Each run is a separate process running ``batchjac compute`` (forked from a zygote that has
imported TensorFlow once, see tests/resume_zygote.py). After every kill, whatever exists under
the output's name must be complete; the same command run again must finish without
recomputing recorded chunks, and the output must be bitwise identical to that of an
uninterrupted run. scripts/resume_trials.py runs the longer experiment (many random kills).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("zarr")
pytest.importorskip("h5py")

from batchjac._stores import read_manifest
from batchjac.examples import seed_model, workload_inputs

from .resume_zygote import Zygote, count_done, kill_when, tree

N, CHUNK = 1000, 64  # 16 chunks


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("resume")
    seed_model("tensorflow").save(folder / "seed.keras")
    u, k = workload_inputs("W1", N, seed=11)
    np.save(folder / "u.npy", u)
    np.save(folder / "k.npy", k)
    args = [str(folder / "seed.keras"), "-i", str(folder / "u.npy"), "-k", str(folder / "k.npy"),
            "--chunk-size", str(CHUNK), "--with-outputs", "-q", "--json"]
    return {"folder": folder, "args": args, "refs": {}}


def command(job: dict[str, Any], out: Path) -> list[str]:
    return [*job["args"], "-o", str(out)]


def reference(zygote: Zygote, job: dict[str, Any], suffix: str) -> dict[str, bytes]:
    """The output of one uninterrupted run, by file name."""
    if suffix not in job["refs"]:
        out = job["folder"] / f"ref{suffix}"
        run = zygote.start(command(job, out), job["folder"] / f"ref{suffix}.log")
        assert run.wait() == 0, run.output()
        job["refs"][suffix] = rename(tree(out), "ref", "jac")
    return job["refs"][suffix]


def rename(files: dict[str, bytes], old: str, new: str) -> dict[str, bytes]:
    return {name.replace(old, new, 1): data for name, data in files.items()}


def assert_never_half_done(out: Path, ref: dict[str, bytes]) -> None:
    """Whatever exists under the output's name is the complete, final output."""
    if out.exists():
        assert read_manifest(out) is not None
        assert tree(out) == ref


def finish(zygote: Zygote, job: dict[str, Any], out: Path, ref: dict[str, bytes], log: Path) -> None:
    recorded = count_done(out)
    run = zygote.start(command(job, out), log)
    assert run.wait() == 0, run.output()
    summary = json.loads(run.output().strip().splitlines()[-1])
    if recorded:  # the recorded chunks were taken as they were, not computed again
        assert summary["resumed_chunks"] == recorded
        assert summary["computed_chunks"] == summary["chunks"] - recorded
    assert tree(out) == ref
    assert not list(out.parent.glob(out.name + ".partial*"))  # no work directory, no remains


def test_sigkill_at_random_moments(zygote: Zygote, job: dict[str, Any], tmp_path: Path) -> None:
    ref = reference(zygote, job, ".zarr")
    out = tmp_path / "jac.zarr"
    rng = random.Random(20261201)  # seeded: a failure reproduces; scripts/resume_trials.py varies it
    targets = sorted(rng.sample(range(1, N // CHUNK - 4), 3))
    for i, target in enumerate(targets):
        run = zygote.start(command(job, out), tmp_path / f"run{i}.log")
        recorded = kill_when(run, out, target, rng.uniform(0.0, 0.005))
        status = run.wait()
        # the kill landed mid-run: a run that finished first would test nothing
        assert status == -9, f"run {i} ended by itself (exit {status}) before the kill:\n{run.output()}"
        assert target <= recorded < N // CHUNK + (N % CHUNK > 0), (target, recorded)
        assert not out.exists(), "a run killed mid-run left an output under the final name"
        assert_never_half_done(out, ref)
    finish(zygote, job, out, ref, tmp_path / "final.log")


COMMIT = {".zarr": "ZarrFormat.commit", ".h5": "HDF5Format.commit", ".npy": "NpyFormat.commit"}
KILLS: dict[str, list[dict[str, Any]]] = {
    ".zarr": [
        {"target": "os:replace", "nth": 1},  # creating the store, before its manifest exists
        {"target": "os:replace", "nth": 9},  # between a chunk's data and its record
        {"target": "batchjac._stores.workdir:WorkDir.record", "nth": 3, "after": True},
        {"target": "os:rename", "nth": 1},  # committing: before the store is moved into place
        {"target": "os:rename", "nth": 1, "after": True},  # moved; the work dir still there
    ],
    ".h5": [
        {"target": "os:replace", "nth": 4},
        # the HDF5 file assembled, not renamed; then renamed in the work dir, not moved out
        {"target": "os:replace", "nth": 1, "within": "batchjac._stores.formats:HDF5Format.commit"},
        {"target": "os:replace", "nth": 2, "within": "batchjac._stores.formats:HDF5Format.commit"},
        # committed; then in the middle of deleting the work directory (renamed away first)
        {"target": "os:unlink", "nth": 2, "within": "shutil:rmtree"},
    ],
    ".npy": [
        {"target": "os:replace", "nth": 5},
        # the outputs file moved into place, the Jacobians not yet (the commit point)
        {"target": "batchjac._stores.formats:move", "nth": 1, "after": True,
         "within": "batchjac._stores.formats:NpyFormat.commit"},
    ],
}


@pytest.mark.parametrize("suffix", list(KILLS))
def test_sigkill_at_chosen_points(zygote: Zygote, job: dict[str, Any], tmp_path: Path, suffix: str) -> None:
    ref = reference(zygote, job, suffix)
    out = tmp_path / f"jac{suffix}"
    for i, kill in enumerate(KILLS[suffix]):
        run = zygote.start(command(job, out), tmp_path / f"run{i}.log", kill_at=kill)
        assert run.wait() == -9, f"{kill} was never reached:\n{run.output()}"
        assert_never_half_done(out, ref)
    finish(zygote, job, out, ref, tmp_path / "final.log")
