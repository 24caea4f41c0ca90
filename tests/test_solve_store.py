"""``batchjac solve`` into a resumable output: blocks, formats, resume (bitwise), job checks,
streamed input files, and real processes killed with SIGKILL."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import batchjac  # noqa: E402
from batchjac import _solve  # noqa: E402
from batchjac._solve import Status  # noqa: E402
from batchjac._solve_store import SolveInputs, open_result, result_format, solve_to_store  # noqa: E402
from batchjac._stores import Format, StoreExistsError, StoreMismatchError  # noqa: E402

from .store_conformance import ResumableStoreConformance, StoreKind  # noqa: E402

N, BLOCK, K, H = 300, 64, 3, 4  # 5 blocks, the last one short
_rng = np.random.default_rng(1)
W1 = _rng.normal(size=(K + H, 16)) * 0.5
W2 = _rng.normal(size=(16, 6)) * 0.5
MODEL_SOURCE = (
    "import numpy as np, tensorflow as tf\n"
    f"W1 = np.array({W1.tolist()})\nW2 = np.array({W2.tolist()})\n"
    "def model(z):\n"
    "    return tf.matmul(tf.tanh(tf.matmul(z, tf.cast(W1, z.dtype))), tf.cast(W2, z.dtype))\n")


def model(z: Any) -> Any:
    return tf.matmul(tf.tanh(tf.matmul(z, tf.cast(W1, z.dtype))), tf.cast(W2, z.dtype))


def problem(seed: int = 0, n: int = N) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, K))
    h = rng.normal(size=(n, H))
    t = np.tanh(np.concatenate([x, h], 1) @ W1) @ W2
    return x, h.astype(np.float32), t.astype(np.float32)


def files(out: Path) -> dict[str, bytes]:
    """Every file of a finished output, by relative path, and its bytes."""
    if out.is_file():
        return {out.name: out.read_bytes()}
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def run(out: Path, inputs: SolveInputs, **kw: Any) -> Any:
    kw = {"block_size": BLOCK, "n_unknowns": K, **kw}
    return solve_to_store(model, inputs, out, **kw)


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    x, h, t = problem()
    t = t.copy()
    t[7] = np.nan  # one invalid instance: reported, the others solve
    return {"x": x, "inputs": SolveInputs(targets=t, known=h, lower=-2.0, upper=2.0)}


def test_results_match_in_memory_solve(data: dict[str, Any], tmp_path: Path) -> None:
    res = run(tmp_path / "out", data["inputs"])
    assert (res.blocks, res.computed_blocks, res.resumed_blocks) == (5, 5, 0)
    assert res.status_counts["invalid_input"] == 1
    assert res.succeeded == N - 1
    x = np.load(tmp_path / "out" / "x.npy")
    status = np.load(tmp_path / "out" / "status.npy")
    assert status[7] == Status.INVALID_INPUT
    assert np.isnan(x[7]).all()
    ok = np.arange(N) != 7
    np.testing.assert_allclose(x[ok], data["x"][ok], atol=2e-3)  # float32 targets
    ref = batchjac.solve(model, data["inputs"].targets, data["inputs"].known, n_unknowns=K,
                         bounds=(-2.0, 2.0))
    np.testing.assert_allclose(x[ok], ref.x[ok], atol=1e-4)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "success.npy"), ref.success)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["succeeded"] == N - 1
    assert summary["status_codes"]["invalid_input"] == -1
    assert not (tmp_path / "out.partial").exists()
    # the same job again: nothing to do
    again = run(tmp_path / "out", data["inputs"])
    assert again.computed_blocks == 0
    assert again.resumed_blocks == 5


class _Fail(Exception):
    pass


def _fail_on(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    real, calls = _solve.solve, {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == call:
            raise _Fail("stop here")
        return real(*args, **kwargs)

    monkeypatch.setattr(_solve, "solve", flaky)


@pytest.mark.parametrize("name", ["out", "out.zarr", "out.h5"])
def test_resume_after_failure_gives_the_same_bytes(data: dict[str, Any], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   name: str) -> None:
    pytest.importorskip("zarr")
    pytest.importorskip("h5py")
    run(tmp_path / "ref" / name, data["inputs"], return_covariance=True)
    out = tmp_path / "run" / name
    with monkeypatch.context() as m:
        _fail_on(m, 3)
        with pytest.raises(_Fail):
            run(out, data["inputs"], return_covariance=True)
    assert not out.exists()  # nothing half-done under the output's name
    assert len(os.listdir(f"{out}.partial/done")) == 2
    res = run(out, data["inputs"], return_covariance=True)
    assert (res.computed_blocks, res.resumed_blocks) == (3, 2)
    assert files(out) == files(tmp_path / "ref" / name)
    ref_status = open_result(tmp_path / "ref" / name, "status")[:]
    np.testing.assert_array_equal(open_result(out, "status")[:], ref_status)
    assert open_result(out, "covariance").shape == (N, K, K)


def test_random_starts_seed_is_kept_for_the_resume(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _x, h, t = problem(seed=3, n=200)
    inputs = SolveInputs(targets=t, known=h, lower=-1.5, upper=1.5)
    with monkeypatch.context() as m:
        _fail_on(m, 2)
        with pytest.raises(_Fail):
            run(tmp_path / "a", inputs, n_starts=3)
    seed = json.loads(Path(tmp_path / "a.partial" / "manifest.json").read_text())["seed"]
    assert isinstance(seed, int)
    run(tmp_path / "a", inputs, n_starts=3)  # resumed with the recorded seed
    run(tmp_path / "b", inputs, n_starts=3, seed=seed)  # uninterrupted, that seed given
    got, ref = files(tmp_path / "a"), files(tmp_path / "b")
    arrays = [n for n in ref if n.endswith(".npy")]
    assert arrays
    assert all(got[n] == ref[n] for n in arrays)
    starts = np.load(tmp_path / "a" / "start.npy")
    assert set(np.unique(starts)) <= {0, 1, 2}
    assert len(np.unique(starts)) > 1


def test_other_jobs_are_refused(data: dict[str, Any], tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _fail_on(m, 3)
        with pytest.raises(_Fail):
            run(out, data["inputs"])
    with pytest.raises(StoreMismatchError, match=r"different job .*max_iter"):
        run(out, data["inputs"], max_iter=5)
    changed = data["inputs"].targets.copy()
    changed[3] += 1.0  # a row of the first (finished) block
    other = SolveInputs(targets=changed, known=data["inputs"].known, lower=-2.0, upper=2.0)
    with pytest.raises(StoreMismatchError, match=r"rows 0:64 differ"):
        run(out, other)
    res = run(out, other, overwrite=True)  # discards the unfinished output, starts again
    assert res.computed_blocks == 5
    with pytest.raises(StoreMismatchError, match="--overwrite"):
        run(out, data["inputs"])  # finished output of another job
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(StoreExistsError, match="did not make"):
        run(tmp_path / "mine", data["inputs"], overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").exists()


def test_per_instance_inputs_and_bad_input(tmp_path: Path) -> None:
    x, h, t = problem(seed=5, n=150)
    lo = np.full((150, K), -1.0)
    lo[:, 0] = 0.2  # per instance bounds: unknown 0 kept above 0.2
    x0 = np.clip(x + 0.1, lo, 1.0)
    w = np.ones((150, 6))
    w[:, 5] = 0.0  # one output dropped, still identifiable
    res = run(tmp_path / "o", SolveInputs(targets=t, known=h, x0=x0, lower=lo, upper=1.0,
                                          weights=w))
    got = np.load(tmp_path / "o" / "x.npy")
    assert (got[:, 0] >= 0.2).all()
    inside = x[:, 0] > 0.25
    np.testing.assert_allclose(got[inside], x[inside], atol=3e-3)
    assert res.instances == 150
    with pytest.raises(batchjac.InputError, match=r"`targets` has shape \(150, 5\)"):
        run(tmp_path / "bad", SolveInputs(targets=t[:, :5], known=h))
    with pytest.raises(batchjac.InputError, match=r"`known` has 149 rows"):
        run(tmp_path / "bad", SolveInputs(targets=t, known=h[:149]))
    with pytest.raises(batchjac.InputError, match=r"directory \(no suffix\), a \.zarr or an \.h5"):
        run(tmp_path / "bad.npy", SolveInputs(targets=t, known=h))


# -- the conformance suite of every kind of store ---------------------------------------------
class SolveKind(StoreKind):
    """The solve output's job for the conformance suite (tests/store_conformance.py): 60
    instances of the model above, bounded, in 6 blocks of 10."""

    what, unit, stem = "batchjac solve output", "block", "sol"
    n, unit_rows, units = 60, 10, 6
    main, main_shape = "x", (K,)
    edited_rows = (16, 52)  # in block 1 (rows 10:20), and in block 5

    def __init__(self) -> None:
        _x, self.known, self.original = problem(seed=2, n=self.n)
        self.edit(None)

    def run(self, out: Path, *, overwrite: bool = False, **variant: Any) -> tuple[int, int]:
        inputs = SolveInputs(targets=self.targets, known=self.known, lower=-2.0, upper=2.0)
        res = solve_to_store(model, inputs, out, block_size=self.unit_rows, n_unknowns=K,
                             overwrite=overwrite, **variant)
        return res.computed_blocks, res.resumed_blocks

    def others(self) -> list[tuple[dict[str, Any], str]]:
        return [({"max_iter": 5}, r"different job .*max_iter"),
                ({"xtol": 1e-3}, r"different job \(options\.xtol: the store has None, this call 0\.001")]

    def edit(self, row: int | None) -> None:
        self.targets = self.original.copy()
        if row is not None:
            self.targets[row, 0] += 0.5

    def inputs_changed(self, lo: int, hi: int, index: int) -> str:
        return rf"rows {lo}:{hi} differ"

    def format(self, out: Path) -> Format:
        return result_format(out)

    def open(self, out: Path) -> Any:
        return open_result(out)

    def check_values(self, out: Path) -> None:
        # float32 targets, and an edited row no unknowns fit exactly: close, not bitwise (the
        # in-memory solve chunks the instances differently)
        ref = batchjac.solve(model, self.targets, self.known, n_unknowns=K, bounds=(-2.0, 2.0))
        np.testing.assert_allclose(np.asarray(open_result(out, "x")[:]), ref.x, atol=2e-3)


class SolveStoreConformance(ResumableStoreConformance):
    @pytest.fixture
    def kind(self) -> SolveKind:
        if self.suffix == ".zarr":
            pytest.importorskip("zarr")
        if self.suffix == ".h5":
            pytest.importorskip("h5py")
        return SolveKind()


class TestSolveNpyDir(SolveStoreConformance):
    suffix = ""
    writer = "NpyWriter"


class TestSolveZarr(SolveStoreConformance):
    suffix = ".zarr"
    writer = "ZarrWriter"


class TestSolveHDF5(SolveStoreConformance):
    suffix = ".h5"
    writer = "StagedWriter"


# -- command line ---------------------------------------------------------------------------------
def test_cli_streams_files_and_reports(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from batchjac.cli import cli

    (tmp_path / "m.py").write_text(MODEL_SOURCE)
    x, h, t = problem(seed=8, n=200)
    t = t.astype(np.float64)
    t[2] = np.nan
    np.savetxt(tmp_path / "t.csv", t, delimiter=",", header=",".join(f"y{i}" for i in range(6)),
               comments="")
    np.save(tmp_path / "h.npy", h)
    np.save(tmp_path / "lo.npy", np.full(K, -2.0))
    args = ["solve", f"{tmp_path / 'm.py'}:model", "--targets", str(tmp_path / "t.csv"), "-k",
            str(tmp_path / "h.npy"), "--lower", str(tmp_path / "lo.npy"), "--upper", "2",
            "--block-size", "50", "--covariance", "--json", "--out"]
    result = CliRunner().invoke(cli, [*args, str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # the summary on stdout; progress and messages on stderr
    assert summary["blocks"] == 4
    assert summary["succeeded"] == 199
    assert "199/200 instances fitted" in result.output
    got = np.load(tmp_path / "out" / "x.npy")
    ok = np.arange(200) != 2
    np.testing.assert_allclose(got[ok], x[ok], atol=2e-3)
    assert np.load(tmp_path / "out" / "status.npy")[2] == Status.INVALID_INPUT
    assert np.load(tmp_path / "out" / "covariance.npy").shape == (200, K, K)

    again = CliRunner().invoke(cli, [*args, str(tmp_path / "out"), "--max-iter", "3"])
    assert again.exit_code == 6
    assert "--overwrite" in again.output
    err = CliRunner().invoke(cli, ["solve", f"{tmp_path / 'm.py'}:model", "--targets",
                                   str(tmp_path / "t.csv"), "-k", str(tmp_path / "h.npy"),
                                   "--out", str(tmp_path / "o3"), "--lower", "1", "--upper", "0",
                                   "--n-unknowns", "3"])
    assert err.exit_code == 4
    assert "lower >= upper" in err.output
    assert "Traceback" not in err.output
    err = CliRunner().invoke(cli, ["solve", "no_such_module_xyz:model", "--targets",
                                   str(tmp_path / "t.csv"), "--out", str(tmp_path / "o4")])
    assert err.exit_code == 3
    assert "cannot be imported" in err.output
    err = CliRunner().invoke(cli, ["solve", f"{tmp_path / 'm.py'}:model", "--targets",
                                   str(tmp_path / "missing.npy"), "--out", str(tmp_path / "o5")])
    assert err.exit_code == 3
    assert "missing.npy" in err.output


def test_cli_sigkill_and_resume_bitwise(tmp_path: Path) -> None:
    """Real processes killed with SIGKILL while solving and while committing; the same command
    then finishes, and the output is bitwise that of an uninterrupted run."""
    from .resume_zygote import Zygote, count_done, kill_when

    (tmp_path / "m.py").write_text(MODEL_SOURCE)
    _x, h, t = problem(seed=9, n=2000)
    np.save(tmp_path / "t.npy", t)
    np.save(tmp_path / "h.npy", h)
    args = [f"{tmp_path / 'm.py'}:model", "--targets", str(tmp_path / "t.npy"), "-k",
            str(tmp_path / "h.npy"), "--n-unknowns", "3", "--lower", "-2", "--upper", "2",
            "--n-starts", "2", "--seed", "4", "--block-size", "100", "-q", "--json", "--out"]
    zygote = Zygote()
    try:
        ref = zygote.start([*args, str(tmp_path / "ref")], tmp_path / "ref.log", command="solve")
        assert ref.wait() == 0, ref.output()
        out = tmp_path / "out"
        first = zygote.start([*args, str(out)], tmp_path / "r1.log", command="solve")
        recorded = kill_when(first, out, 3, 0.01)
        assert first.wait() == -9
        assert 3 <= recorded < 20
        assert not out.exists()
        commit = {"target": "os:rename", "nth": 1,
                  "within": "batchjac._stores.formats:NpyDirFormat.commit"}
        second = zygote.start([*args, str(out)], tmp_path / "r2.log", command="solve",
                              kill_at=commit)
        assert second.wait() == -9, second.output()
        assert not out.exists()
        assert count_done(out) == 20
        last = zygote.start([*args, str(out)], tmp_path / "r3.log", command="solve")
        assert last.wait() == 0, last.output()
        summary = json.loads(last.output().strip().splitlines()[-1])
        assert summary["computed_blocks"] == 0
        assert summary["resumed_blocks"] == 20
    finally:
        zygote.close()
    assert files(out) == files(tmp_path / "ref")
    assert not list(tmp_path.glob("out.partial*"))
