"""Resumable stores and links or edits planted in their work directory (``OUT.partial/``).

A resumed store must never write into, read from or commit a file reached through a symbolic
link in its work directory (the remaining chunks would go into the file the link points to,
and the finished output would be that link), and a chunk recorded as done is verified against
the digest of its result before it is kept: bytes changed since it was written are computed
again, never returned as they are. Interruptions are simulated in-process, as in
tests/test_stores.py: the chunk writer raises ENOSPC at a chosen chunk.

The model is a PyTorch linear map x -> x @ W.T in float64: its Jacobian is W for every row.
"""

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

torch = pytest.importorskip("torch")

import batchjac  # noqa: E402
from batchjac import _solve, _stores  # noqa: E402
from batchjac._solve_store import SolveInputs, solve_to_store  # noqa: E402
from batchjac._stores import (  # noqa: E402
    Store,
    StoreError,
    StoreExistsError,
    StoreWriteError,
    formats,
)

N, CS, M, D = 95, 10, 4, 5  # 10 chunks, the last one short
WRITERS = {".npy": "NpyWriter", ".h5": "StagedWriter", ".zarr": "ZarrWriter"}


def _linear(w: np.ndarray) -> Any:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    return lin.eval()


@pytest.fixture(scope="module")
def problem() -> tuple[Any, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1906)
    w = rng.normal(size=(M, D))
    u = rng.normal(size=(N, D))
    return _linear(w), w, u


def _need(suffix: str) -> None:
    if suffix == ".h5":
        pytest.importorskip("h5py")
    if suffix == ".zarr":
        pytest.importorskip("zarr")


def _run(model: Any, u: np.ndarray, out: Path | Store) -> Any:
    return batchjac.jacobian(model, u, out=out, chunk_size=CS, mode="reverse", return_outputs=True)


def _interrupted(model: Any, u: np.ndarray, out: Path, monkeypatch: pytest.MonkeyPatch,
                 at: int = 3) -> Path:
    """A store whose chunks 0..at-1 are done, as a full disk at chunk ``at`` leaves it; the
    work directory."""
    cls = getattr(formats, WRITERS[out.suffix])
    original = cls.write

    def write(self_: Any, i: int, lo: int, hi: int, values: dict[str, np.ndarray]) -> None:
        if i == at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self_, i, lo, hi, values)

    with monkeypatch.context() as m:
        m.setattr(cls, "write", write)
        with pytest.raises(StoreWriteError):
            _run(model, u, out)
    work = Path(f"{out}.partial")
    assert sorted(os.listdir(work / "done")) == [f"{i:08d}.json" for i in range(at)]
    return work


def _victim(path: Path, value: float, shape: tuple[int, ...]) -> bytes:
    """Somebody's file outside the store (a valid .npy of the store's shape and dtype)."""
    with open(path, "wb") as f:
        np.save(f, np.full(shape, value))
    return path.read_bytes()


def _plant(link: Path, target: Path) -> None:
    link.unlink()
    link.symlink_to(target)


def _no_links(path: Path) -> None:
    assert not path.is_symlink()
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            assert not os.path.islink(os.path.join(root, name)), os.path.join(root, name)


def _check_values(out: Path, w: np.ndarray, u: np.ndarray) -> None:
    jac = np.asarray(batchjac._stores.open_store(out)[:])
    np.testing.assert_array_equal(jac, np.broadcast_to(w, (N, M, D)))
    y = np.asarray(batchjac._stores.open_store(out, "outputs")[:])
    np.testing.assert_allclose(y, u @ w.T, rtol=1e-12, atol=1e-12)


def _link_in(work: Path, suffix: str) -> Path:
    """The work file of a done chunk (or the whole data file) a link is planted at."""
    if suffix == ".npy":
        return work / "data" / "jacobians.npy"
    if suffix == ".h5":
        return work / "data" / "chunks" / "00000001.jacobians.npy"
    chunk = work / "data" / "store.zarr" / "jacobians" / "c" / "1"
    return next(p for p in sorted(chunk.rglob("*")) if p.is_file())


@pytest.mark.parametrize("suffix", list(WRITERS))
def test_planted_link_in_work_dir_is_refused_and_victim_untouched(
        problem: tuple[Any, np.ndarray, np.ndarray], tmp_path: Path, suffix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _need(suffix)
    model, w, u = problem
    out = tmp_path / f"jac{suffix}"
    work = _interrupted(model, u, out, monkeypatch)
    link = _link_in(work, suffix)
    victim = tmp_path / "victim.npy"
    shape = (N, M, D) if suffix == ".npy" else (CS, M, D)
    if suffix == ".zarr":
        victim.write_bytes(b"somebody's bytes\n" * 64)
        before = victim.read_bytes()
    else:
        before = _victim(victim, 7.0, shape)
    _plant(link, victim)

    with pytest.raises(StoreError, match=re.escape(repr(os.fspath(link)))) as info:
        _run(model, u, out)
    assert "link" in str(info.value)
    assert victim.read_bytes() == before
    assert not os.path.lexists(out)

    # overwrite discards the unfinished store (the link, never what it points to)
    result = _run(model, u, Store(out, overwrite=True))
    assert result.computed_chunks == N // CS + 1
    assert victim.read_bytes() == before
    _no_links(out)
    assert out.is_dir() if suffix == ".zarr" else out.is_file()
    _check_values(out, w, u)


@pytest.mark.parametrize("name", ["outputs.npy", "manifest", "done"])
def test_every_npy_work_file_is_checked(problem: tuple[Any, np.ndarray, np.ndarray],
                                        tmp_path: Path, name: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    model, _w, u = problem
    out = tmp_path / "jac.npy"
    work = _interrupted(model, u, out, monkeypatch)
    victim = tmp_path / "victim"
    if name == "outputs.npy":
        link = work / "data" / "outputs.npy"
        before = _victim(victim, 3.0, (N, M))
    else:
        link = work / "manifest.json" if name == "manifest" else work / "done" / "00000001.json"
        victim.write_bytes(link.read_bytes())  # a copy outside: reading it is refused too
        before = victim.read_bytes()
    _plant(link, victim)
    with pytest.raises(StoreError, match=re.escape(repr(os.fspath(link)))):
        _run(model, u, out)
    assert victim.read_bytes() == before
    assert not os.path.lexists(out)


def test_work_dir_that_is_a_link_is_refused(problem: tuple[Any, np.ndarray, np.ndarray],
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _w, u = problem
    out = tmp_path / "jac.npy"
    work = _interrupted(model, u, out, monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    work.rename(elsewhere)
    work.symlink_to(elsewhere)
    before = {p.name: p.read_bytes() for p in (elsewhere / "data").iterdir()}
    with pytest.raises(StoreExistsError, match="not made by batchjac"):
        _run(model, u, Store(out, overwrite=True))
    assert {p.name: p.read_bytes() for p in (elsewhere / "data").iterdir()} == before


def test_stale_temporary_link_beside_output_is_not_followed(
        problem: tuple[Any, np.ndarray, np.ndarray], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar manifest is written through a temporary file beside the output: a link
    planted under that name is replaced, not written through (the victim kept its bytes)."""
    model, w, u = problem
    out = tmp_path / "jac.npy"
    _interrupted(model, u, out, monkeypatch)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (tmp_path / ".jac.manifest.json.tmp").symlink_to(victim)
    _run(model, u, out)
    assert victim.read_text() == "keep me\n"
    assert json.loads((tmp_path / "jac.manifest.json").read_text())["complete"] is True
    _check_values(out, w, u)


def _tamper(work: Path, suffix: str) -> None:
    """Change the stored Jacobians of done chunk 1 (rows 10:20) in place, as a disk error or
    another program might."""
    if suffix == ".npy":
        mm = np.load(work / "data" / "jacobians.npy", mmap_mode="r+")
        mm[CS:2 * CS] = 99.0
        mm.flush()
        del mm
    elif suffix == ".h5":
        path = work / "data" / "chunks" / "00000001.jacobians.npy"
        np.save(path, np.full((CS, M, D), 99.0))
    else:
        import zarr

        zarr.open_group(str(work / "data" / "store.zarr"), mode="r+")["jacobians"][CS:2 * CS] = 99.0


@pytest.mark.parametrize("suffix", list(WRITERS))
def test_tampered_done_chunk_is_computed_again(problem: tuple[Any, np.ndarray, np.ndarray],
                                               tmp_path: Path, suffix: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _need(suffix)
    model, w, u = problem
    clean = tmp_path / "clean" / f"jac{suffix}"
    _run(model, u, clean)

    out = tmp_path / f"jac{suffix}"
    _interrupted(model, u, out, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # chunks that are intact are kept without a word
        result = _run(model, u, out)
    assert (result.resumed_chunks, result.computed_chunks) == (3, 7)
    assert _stores.read_manifest(out) == _stores.read_manifest(clean)

    out2 = tmp_path / f"jac2{suffix}"
    work = _interrupted(model, u, out2, monkeypatch)
    _tamper(work, suffix)
    with pytest.warns(UserWarning, match=r"chunk 1 \(rows 10:20\).*computed again"):
        result = _run(model, u, out2)
    assert (result.resumed_chunks, result.computed_chunks) == (2, 8)
    _check_values(out2, w, u)
    assert _stores.read_manifest(out2) == _stores.read_manifest(clean)


# -- the solve store, which shares the mechanism --------------------------------------------

SOLVE_N, BLOCK, K, SOLVE_M = 40, 10, 3, 6


@pytest.fixture(scope="module")
def solve_problem() -> tuple[Any, np.ndarray, SolveInputs]:
    rng = np.random.default_rng(77)
    w = rng.normal(size=(SOLVE_M, K))
    x = rng.uniform(-1, 1, (SOLVE_N, K))
    return _linear(w), x, SolveInputs(targets=x @ w.T)


def _solve_run(model: Any, inputs: SolveInputs, out: Path) -> Any:
    return solve_to_store(model, inputs, out, block_size=BLOCK, n_unknowns=K)


def _solve_interrupted(model: Any, inputs: SolveInputs, out: Path,
                       monkeypatch: pytest.MonkeyPatch) -> Path:
    real, calls = _solve.solve, {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "stop here")
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(_solve, "solve", flaky)
        with pytest.raises(OSError, match="stop here"):
            _solve_run(model, inputs, out)
    work = Path(f"{out}.partial")
    assert sorted(os.listdir(work / "done")) == ["00000000.json", "00000001.json"]
    return work


def test_solve_store_refuses_planted_link(solve_problem: tuple[Any, np.ndarray, SolveInputs],
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, inputs = solve_problem
    out = tmp_path / "sol"
    work = _solve_interrupted(model, inputs, out, monkeypatch)
    victim = tmp_path / "victim.npy"
    before = _victim(victim, 5.0, (SOLVE_N, K))
    link = work / "data" / "x.npy"
    _plant(link, victim)
    with pytest.raises(StoreError, match=re.escape(repr(os.fspath(link)))):
        _solve_run(model, inputs, out)
    assert victim.read_bytes() == before
    res = solve_to_store(model, inputs, out, block_size=BLOCK, n_unknowns=K, overwrite=True)
    assert res.computed_blocks == SOLVE_N // BLOCK
    assert victim.read_bytes() == before
    _no_links(out)
    np.testing.assert_allclose(np.load(out / "x.npy"), x, atol=1e-8)


def test_solve_store_recomputes_tampered_block(solve_problem: tuple[Any, np.ndarray, SolveInputs],
                                               tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, inputs = solve_problem
    clean = tmp_path / "clean"
    _solve_run(model, inputs, clean)
    out = tmp_path / "sol"
    work = _solve_interrupted(model, inputs, out, monkeypatch)
    mm = np.load(work / "data" / "x.npy", mmap_mode="r+")
    mm[0:BLOCK] = 42.0
    mm.flush()
    del mm
    with pytest.warns(UserWarning, match=r"block 0 \(rows 0:10\).*computed again"):
        res = _solve_run(model, inputs, out)
    assert (res.resumed_blocks, res.computed_blocks) == (1, 3)
    for name in sorted(os.listdir(clean)):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    np.testing.assert_allclose(np.load(out / "x.npy"), x, atol=1e-8)


# -- .npy outputs and the files beside them -------------------------------------------------

def _run_npy(model: Any, u: np.ndarray, out: Path | Store, with_outputs: bool) -> Any:
    return batchjac.jacobian(model, u, out=out, chunk_size=CS, mode="reverse",
                             return_outputs=with_outputs)


@pytest.mark.parametrize("with_outputs", [True, False])
@pytest.mark.parametrize("sibling", ["jac.outputs.npy", "jac.manifest.json"])
def test_npy_refuses_sibling_files_it_did_not_make(problem: tuple[Any, np.ndarray, np.ndarray],
                                                   tmp_path: Path, sibling: str,
                                                   with_outputs: bool) -> None:
    model, w, u = problem
    out = tmp_path / "jac.npy"
    theirs = tmp_path / sibling
    theirs.write_bytes(b"somebody's file\n")
    with pytest.raises(StoreExistsError,
                       match=rf"{re.escape(repr(os.fspath(theirs)))}.*overwrite=True \(--overwrite\)"):
        _run_npy(model, u, out, with_outputs)
    assert theirs.read_bytes() == b"somebody's file\n"
    assert not os.path.lexists(out)

    _run_npy(model, u, Store(out, overwrite=True), with_outputs)
    np.testing.assert_array_equal(np.load(out), np.broadcast_to(w, (N, M, D)))
    if sibling == "jac.outputs.npy" and not with_outputs:
        # not written by this job, so not replaced, and never deleted
        assert theirs.read_bytes() == b"somebody's file\n"
        with pytest.raises(batchjac.InputError, match="has no array 'outputs'"):
            _stores.open_store(out, "outputs")
    else:  # replaced by the output's own file, as overwrite allows
        assert theirs.read_bytes() != b"somebody's file\n"
    assert _stores.read_manifest(out) is not None


def test_npy_replaces_its_own_outputs_file(problem: tuple[Any, np.ndarray, np.ndarray],
                                          tmp_path: Path) -> None:
    """The outputs file of a finished output being overwritten is batchjac's: a new output
    without outputs removes it (it would describe other Jacobians)."""
    model, w, u = problem
    out = tmp_path / "jac.npy"
    _run_npy(model, u, out, True)
    assert (tmp_path / "jac.outputs.npy").is_file()
    _run_npy(model, u, Store(out, overwrite=True), False)
    assert not os.path.lexists(tmp_path / "jac.outputs.npy")
    assert _run_npy(model, u, out, False).computed_chunks == 0  # the same job: nothing to do
    np.testing.assert_array_equal(np.load(out), np.broadcast_to(w, (N, M, D)))
