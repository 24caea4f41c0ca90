"""Promises of the README and docs/cli.md that no other test would catch breaking (issue 18):
progress reporting, the memory budget from each place it can come from, ``out=`` errors, the
CLI's --explain, --nan-policy propagate and exit codes 1, 6, 7 and 130.

Every model here is a :class:`batchjac.ClosedForm` (numpy code with its own Jacobian), so the
tests need no framework and every value is compared with the closed form.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import batchjac
from batchjac._plan import bytes_per_row, make_plan
from batchjac.cli import cli

from .helpers import without_dac_capabilities

D, M = 6, 3
MODEL_SOURCE = '''
import numpy as np
from batchjac import ClosedForm

_rng = np.random.default_rng(42)
A, B = _rng.normal(size=(3, 5)), _rng.normal(size=(5, 6))


def f(z):
    return np.tanh(z @ B.T) @ A.T


def jac(z):
    s = 1 - np.tanh(z @ B.T) ** 2
    return np.einsum("mh,nh,hd->nmd", A, s, B)


model = ClosedForm(f, jac)
'''
_ns: dict[str, Any] = {}
exec(compile(MODEL_SOURCE, "<closed form>", "exec"), _ns)
MODEL, F, JAC = _ns["model"], _ns["f"], _ns["jac"]


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, D))


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "m.py").write_text(MODEL_SOURCE)
    z = data(300, 7)
    np.save(tmp_path / "z.npy", z)
    return {"model": f"{tmp_path / 'm.py'}:model", "z": z, "inputs": str(tmp_path / "z.npy"),
            "dir": tmp_path}


def compute(files: dict[str, Any], *args: str, out: str = "j.zarr") -> Any:
    return CliRunner().invoke(cli, ["compute", files["model"], "-i", files["inputs"],
                                    "-o", str(files["dir"] / out), *args])


def planned_chunk(n: int, budget: int) -> int:
    """The planner's chunk for this model's float64 rows under ``budget`` bytes."""
    return make_plan(n=n, k=D, m=M, in_elems=D, dtype=np.dtype(np.float64), mode="reverse",
                     chunk_size=None, max_memory=budget).chunk_size


# -- progress ----------------------------------------------------------------------------------
def test_progress_callable_gets_each_chunks_rows() -> None:
    z = data(1000, 1)
    rows: list[int] = []
    jac = batchjac.jacobian(MODEL, z, chunk_size=64, progress=rows.append)
    assert rows == [64] * 15 + [1000 - 15 * 64]  # one call per finished chunk, its real rows
    np.testing.assert_allclose(jac, JAC(z), rtol=1e-12, atol=1e-12)


def test_progress_true_draws_a_bar_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    z = data(500, 2)
    batchjac.jacobian(MODEL, z, chunk_size=100, progress=True)
    err = capsys.readouterr().err
    assert "100%" in err
    assert "500/500" in err
    batchjac.jacobian(MODEL, z, chunk_size=100)  # progress=False (the default): nothing
    assert capsys.readouterr().err == ""


def test_cli_progress_bar_and_quiet(files: dict[str, Any]) -> None:
    loud = compute(files, "--chunk-size", "50", out="a.zarr")
    assert loud.exit_code == 0, loud.output
    assert "100%" in loud.stderr
    assert "300/300" in loud.stderr
    assert "300 rows ->" in loud.stderr  # the one-line summary
    quiet = compute(files, "--chunk-size", "50", "-q", out="b.zarr")
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == ""


# -- the memory budget, from each place it can come from ----------------------------------------
def test_max_memory_sets_the_chunk_through_jacobian(capsys: pytest.CaptureFixture[str]) -> None:
    z = data(1000, 3)
    per_row = bytes_per_row(D, M, D, 8)
    for budget, text in ((10**6, "1MB"), (4 * 10**5, "400kB")):
        want = planned_chunk(1000, budget)
        assert want * per_row <= budget
        rows: list[int] = []
        jac = batchjac.jacobian(MODEL, z, max_memory=text, mode="reverse", explain=True, progress=rows.append)
        explained = capsys.readouterr().err
        assert f"chunks of {want} rows" in explained, explained
        assert rows[0] == want  # the chunks that ran are the explained ones
        np.testing.assert_allclose(jac, JAC(z), rtol=1e-12, atol=1e-12)
    assert planned_chunk(1000, 10**6) != planned_chunk(1000, 4 * 10**5)  # the budget mattered


def test_batchjac_max_memory_is_the_default_budget(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("BATCHJAC_MAX_MEMORY", "500kB")
    z = data(1000, 4)
    batchjac.jacobian(MODEL, z, mode="reverse", explain=True)
    assert f"chunks of {planned_chunk(1000, 5 * 10**5)} rows" in capsys.readouterr().err
    # an explicit max_memory wins over the variable
    batchjac.jacobian(MODEL, z, mode="reverse", explain=True, max_memory="2MB")
    assert f"chunks of {planned_chunk(1000, 2 * 10**6)} rows" in capsys.readouterr().err
    monkeypatch.setenv("BATCHJAC_MAX_MEMORY", "lots")
    with pytest.raises(batchjac.InputError, match=r"BATCHJAC_MAX_MEMORY.*got 'lots'"):
        batchjac.jacobian(MODEL, z)


def test_cli_max_memory_and_explain(files: dict[str, Any]) -> None:
    result = compute(files, "--max-memory", "300kB", "--mode", "reverse", "--explain", "--json", "-q")
    assert result.exit_code == 0, result.output
    want = planned_chunk(300, 3 * 10**5)
    assert want < 300
    summary = json.loads(result.stdout)
    assert summary["chunk_size"] == want
    assert summary["chunks"] == -(-300 // want)
    assert f"chunks of {want} rows" in result.stderr  # --explain: the plan and why, on stderr
    assert "reverse mode" in result.stderr
    import zarr

    stored = zarr.open_group(str(files["dir"] / "j.zarr"), mode="r")["jacobians"][:]
    np.testing.assert_allclose(stored, JAC(files["z"]), rtol=1e-12, atol=1e-12)
    bad = compute(files, "--max-memory", "lots", out="c.zarr")
    assert bad.exit_code == 2
    assert "--max-memory" in bad.output


# -- out= errors -----------------------------------------------------------------------------------
def test_out_of_the_wrong_shape_or_read_only_is_refused(tmp_path: Path) -> None:
    z = data(20, 5)
    with pytest.raises(batchjac.InputError, match=r"`out` has shape \(20, 3, 5\) but the Jacobians have "
                                                  r"shape \(20, 3, 6\); allocate it as np.empty"):
        batchjac.jacobian(MODEL, z, out=np.empty((20, 3, 5)))
    frozen = np.empty((20, 3, 6))
    frozen.flags.writeable = False
    with pytest.raises(batchjac.InputError, match=r"`out` is read-only; open the memmap with mode='r\+'"):
        batchjac.jacobian(MODEL, z, out=frozen)
    np.save(tmp_path / "j.npy", np.zeros((20, 3, 6)))
    with pytest.raises(batchjac.InputError, match="`out` is read-only"):
        batchjac.jacobian(MODEL, z, out=np.load(tmp_path / "j.npy", mmap_mode="r"))
    good = np.full((20, 3, 6), np.nan)
    assert batchjac.jacobian(MODEL, z, out=good, chunk_size=6) is good
    np.testing.assert_allclose(good, JAC(z), rtol=1e-12, atol=1e-12)


# -- --nan-policy propagate -----------------------------------------------------------------------
def test_cli_nan_policy_propagate_gives_nan_rows_only(files: dict[str, Any]) -> None:
    z = files["z"].copy()
    z[[4, 150], [1, 5]] = np.nan
    np.save(files["inputs"], z)
    refused = compute(files, "-q", out="r.zarr")
    assert refused.exit_code == 4
    assert "row 4" in refused.output
    result = compute(files, "--nan-policy", "propagate", "--chunk-size", "64", "-q")
    assert result.exit_code == 0, result.output
    import zarr

    stored = zarr.open_group(str(files["dir"] / "j.zarr"), mode="r")["jacobians"][:]
    bad = np.zeros(300, bool)
    bad[[4, 150]] = True
    assert np.isnan(stored[bad]).all()
    np.testing.assert_allclose(stored[~bad], JAC(z[~bad]), rtol=1e-12, atol=1e-12)


# -- exit codes (docs/cli.md) ----------------------------------------------------------------------
def test_exit_1_is_a_bug_with_its_traceback(files: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import batchjac._runner

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(batchjac._runner, "iter_results", broken)
    result = compute(files, "-q")
    assert result.exit_code == 1
    assert isinstance(result.exception, RuntimeError)  # not swallowed into a one-line message
    assert "an internal bug" in str(result.exception)


def test_exit_130_on_ctrl_c_keeps_finished_chunks(files: dict[str, Any], tmp_path: Path) -> None:
    """Ctrl-C in the middle of a run: exit 130, a "run the same command again" line; the same
    command then resumes the chunks that were finished."""
    marker = tmp_path / "interrupted-once"  # the model file is loaded afresh by each run
    source = MODEL_SOURCE + f'''
import os
calls = {{"n": 0}}


def _interrupting(z):
    calls["n"] += 1
    if calls["n"] == 4 and not os.path.exists({str(marker)!r}):
        open({str(marker)!r}, "w").close()
        raise KeyboardInterrupt
    return jac(z)


model = ClosedForm(f, _interrupting)
'''
    (tmp_path / "ctrlc.py").write_text(source)
    args = ["compute", f"{tmp_path / 'ctrlc.py'}:model", "-i", files["inputs"], "-o",
            str(tmp_path / "j.zarr"), "--chunk-size", "50", "-q", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 130, result.output
    assert "run the same command again" in result.stderr
    assert not (tmp_path / "j.zarr").exists()
    assert marker.exists()
    again = CliRunner().invoke(cli, args)  # interrupted once only
    assert again.exit_code == 0, again.output
    summary = json.loads(again.stdout)
    assert 1 <= summary["resumed_chunks"] < 6
    assert summary["resumed_chunks"] + summary["computed_chunks"] == 6
    import zarr

    stored = zarr.open_group(str(tmp_path / "j.zarr"), mode="r")["jacobians"][:]
    np.testing.assert_allclose(stored, JAC(files["z"]), rtol=1e-12, atol=1e-12)


def test_exit_6_for_a_store_of_another_job(files: dict[str, Any]) -> None:
    first = compute(files, "--chunk-size", "50", "-q")
    assert first.exit_code == 0, first.output
    other = compute(files, "--chunk-size", "60", "-q")  # other options: another job
    assert other.exit_code == 6
    assert "--overwrite" in other.output
    assert "Traceback" not in other.output
    assert compute(files, "--chunk-size", "60", "-q", "--overwrite").exit_code == 0
    (files["dir"] / "foreign.zarr").write_text("somebody's file\n")
    foreign = compute(files, "-q", out="foreign.zarr")  # a file that is not a batchjac output
    assert foreign.exit_code == 6
    assert (files["dir"] / "foreign.zarr").read_text() == "somebody's file\n"


def test_exit_7_when_the_output_directory_cannot_be_written(files: dict[str, Any]) -> None:
    """Permission denied, for real: a read-only directory, and (as root, which writes anywhere)
    a child process without the capabilities that let it."""
    locked = files["dir"] / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        child = subprocess.run(
            without_dac_capabilities([sys.executable, "-m", "batchjac", "compute", files["model"], "-i",
                                      files["inputs"], "-o", str(locked / "j.zarr"), "-q"]),
            capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    finally:
        locked.chmod(0o755)
    assert child.returncode == 7, child.stdout + child.stderr
    assert "batchjac compute: error:" in child.stderr
    assert "Traceback" not in child.stderr
    assert not list(locked.iterdir())


# -- --backend ---------------------------------------------------------------------------------------
# numpy's ufunc on a torch tensor (the numpy model run as torch) warns through torch
@pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning")
def test_cli_backend_overrides_detection(files: dict[str, Any]) -> None:
    """--backend torch on a numpy model: the model is run as a torch model (and refused, exit 5,
    naming torch), not detected as the numpy model it is."""
    pytest.importorskip("torch")
    result = compute(files, "--backend", "torch", "-q")
    assert result.exit_code == 5, result.output
    assert "not a torch tensor" in result.stderr
    assert compute(files, "-q", out="detected.zarr").exit_code == 0


# -- solve and propagate: chunked against whole, both against closed forms ----------------------------
def test_solve_in_chunks_equals_whole_and_fits_the_targets() -> None:
    rng = np.random.default_rng(17)
    x = rng.uniform(-0.5, 0.5, (40, 3))
    h = rng.normal(size=(40, 3))
    targets = F(np.concatenate([x, h], 1))
    x0 = x + 0.05 * rng.normal(size=x.shape)
    whole = batchjac.solve(MODEL, targets, h, x0=x0)
    chunked = batchjac.solve(MODEL, targets, h, x0=x0, chunk_size=7)
    for res in (whole, chunked):
        assert res.success.all(), res.status_names
        # the reference: the model's own outputs at the solution are the targets
        np.testing.assert_allclose(F(np.concatenate([res.x, h], 1)), targets, rtol=0, atol=1e-9)
    np.testing.assert_allclose(chunked.x, whole.x, rtol=1e-10, atol=1e-12)


def test_propagate_linear_into_out_arrays_in_chunks(tmp_path: Path) -> None:
    mu = data(50, 18)
    sigma = np.diag([0.1, 0.2, 0.05, 0.3, 0.1, 0.2]) ** 2
    mean_out = np.lib.format.open_memmap(tmp_path / "mean.npy", mode="w+", dtype=np.float64, shape=(50, M))
    cov_out = np.lib.format.open_memmap(tmp_path / "cov.npy", mode="w+", dtype=np.float64, shape=(50, M, M))
    batchjac.propagate(MODEL, mu, cov=sigma, chunk_size=8, out=(mean_out, cov_out))
    mean_out.flush()
    cov_out.flush()
    j = JAC(mu)
    np.testing.assert_allclose(np.load(tmp_path / "mean.npy"), F(mu), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.load(tmp_path / "cov.npy"), j @ sigma @ j.transpose(0, 2, 1),
                               rtol=1e-10, atol=1e-14)
    with pytest.raises(batchjac.InputError,
                       match=r"`out` .* has shape \(50, 3, 2\); it must be \(50, 3, 3\)"):
        batchjac.propagate(MODEL, mu, cov=sigma, out=(np.empty((50, M)), np.empty((50, M, 2))))


def test_propagate_monte_carlo_does_not_depend_on_chunking() -> None:
    """Monte Carlo samples are seeded by ``seed`` and the instance index: chunked runs give the
    same numbers, and for small input noise they approach the linearisation J S J^T."""
    mu = data(12, 19)
    std = 0.01
    kw = {"std": std, "method": "monte_carlo", "n_samples": 4000, "seed": 3}
    whole = batchjac.propagate(MODEL, mu, **kw)
    chunked = batchjac.propagate(MODEL, mu, chunk_size=5, **kw)
    np.testing.assert_allclose(chunked.mean, whole.mean, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(chunked.cov, whole.cov, rtol=1e-10, atol=1e-16)
    j = JAC(mu)
    linear = std**2 * j @ j.transpose(0, 2, 1)
    var = np.diagonal(whole.cov, axis1=1, axis2=2)
    # sampling error of a variance from 4,000 samples: sqrt(2 / 4000) ~ 2.2%; 4 sigma
    np.testing.assert_allclose(var, np.diagonal(linear, axis1=1, axis2=2), rtol=0.09)
    np.testing.assert_allclose(whole.mean, F(mu), atol=4 * std * np.abs(j).sum(-1).max() / np.sqrt(4000))
    different = batchjac.propagate(MODEL, mu, **{**kw, "seed": 4})
    assert not np.allclose(different.cov, whole.cov, rtol=1e-6)


def test_a_store_keeps_memory_flat_over_ten_times_the_rows(tmp_path: Path) -> None:
    """The README's promise for stores: memory does not grow with the rows (chunks are written
    as they come). A 16 -> 32 linear model (4 KB of Jacobian a row) to Zarr, 4,000 and 40,000
    rows in chunks of 1,000: the peak of Python's traced allocations (numpy's buffers are
    traced; 12-13 MB at both sizes) stays within 1.5x plus 2 MB and under a fifth of the 164
    MB result; the same rows kept in
    memory take at least the whole result (the control: the tracing sees the buffers)."""
    import tracemalloc

    weights = np.random.default_rng(11).normal(size=(32, 16))
    model = batchjac.ClosedForm(lambda z: z @ weights.T,
                                lambda z: np.broadcast_to(weights, (len(z), 32, 16)).copy())
    peaks = {}
    for n in (4_000, 40_000):
        z = np.random.default_rng(n).normal(size=(n, 16))
        tracemalloc.start()
        batchjac.jacobian(model, z, out=str(tmp_path / f"j{n}.zarr"), chunk_size=1000)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    import zarr

    stored = zarr.open_group(str(tmp_path / "j40000.zarr"), mode="r")["jacobians"]
    assert stored.shape == (40_000, 32, 16)
    np.testing.assert_array_equal(stored[-3:], np.broadcast_to(weights, (3, 32, 16)))
    result_bytes = 40_000 * 32 * 16 * 8
    assert peaks[40_000] < 1.5 * peaks[4_000] + 2e6, peaks
    assert peaks[40_000] < result_bytes / 5, peaks
    z = np.random.default_rng(5).normal(size=(4_000, 16))
    tracemalloc.start()
    batchjac.jacobian(model, z, chunk_size=1000)
    in_memory = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert in_memory >= 4_000 * 32 * 16 * 8, in_memory
