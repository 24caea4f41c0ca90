"""The command line's file paths (issue 33): an output never replaces one of the command's own
inputs, even with ``--overwrite``; ``propagate`` keeps files it cannot tell from its own
results, as ``compute`` keeps files beside its output (exit 6); an input that is not a
regular file (a FIFO, a link to ``/dev/zero``) is refused at once; an output name too long
for the filesystem once batchjac derives its work names from it is refused up front.

The model is a numpy closed form, ``y = z @ A.T`` (no framework: each command takes a
fraction of a second), so results are checked against ``A``. Commands that could block (a
FIFO) run in a subprocess with a timeout; the others in-process (click's CliRunner).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

from batchjac.cli import cli

A = np.array([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]])
MODEL = '''
import numpy as np
from batchjac import ClosedForm

A = np.array([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]])
model = ClosedForm(lambda z: z @ A.T, lambda z: np.broadcast_to(A, (len(z), *A.shape)).copy())
'''
N = 6
#: seconds a command may take in a subprocess before it is taken to block
BLOCKS = 60


@pytest.fixture
def d(tmp_path: Path) -> Path:
    (tmp_path / "m.py").write_text(MODEL)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 2))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "h.npy", rng.normal(size=(N, 1)))
    np.save(tmp_path / "sigma.npy", np.diag([0.1, 0.2]))
    np.save(tmp_path / "y.npy", x @ A.T)
    return tmp_path


def invoke(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_refused(result: Result, code: int, *needles: str) -> str:
    """A user error: the exit code, one line on stderr with no traceback, naming ``needles``."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert "error: " in lines[0]
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (links as their targets' names) with its bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(folder))] = os.readlink(p).encode()
        elif p.is_file():
            out[str(p.relative_to(folder))] = p.read_bytes()
    return out


# -- propagate: its outputs never replace its inputs or files it did not write --------------

@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("inside", ["mean", "cov", "both"])
def test_propagate_into_its_own_input_directory_keeps_the_inputs(
        d: Path, inside: str, overwrite: bool) -> None:
    """``propagate -i d/mean.npy -o d`` (or ``--cov d/cov.npy -o d``) used to write its
    results over its own inputs, exit 0, without --overwrite."""
    data = d / "data"
    data.mkdir()
    np.save(data / "mean.npy", np.load(d / "x.npy"))
    np.save(data / "cov.npy", np.load(d / "sigma.npy"))
    mean = data / "mean.npy" if inside in ("mean", "both") else d / "x.npy"
    cov = data / "cov.npy" if inside in ("cov", "both") else d / "sigma.npy"
    before = snapshot(d)
    result = invoke("propagate", f"{d / 'm.py'}:model", "-i", mean, "--cov", cov, "-o", data,
                    *(["--overwrite"] if overwrite else []))
    hit = "--inputs" if inside in ("mean", "both") else "--cov"
    line = assert_refused(result, 6, "--output", hit, str(mean if hit == "--inputs" else cov))
    assert "--overwrite does not allow" in line or "even with --overwrite" in line
    assert snapshot(d) == before  # byte-identical, and nothing left beside them


def test_propagate_keeps_a_file_it_did_not_write_unless_overwrite(d: Path) -> None:
    out = d / "prop"
    out.mkdir()
    np.save(out / "mean.npy", np.arange(3.0))  # someone else's mean.npy, not an input
    before = snapshot(d)
    args = ["propagate", f"{d / 'm.py'}:model", "-i", d / "x.npy", "--cov", d / "sigma.npy",
            "-o", out]
    assert_refused(invoke(*args), 6, str(out / "mean.npy"), "--overwrite")
    assert snapshot(d) == before
    done = invoke(*args, "--overwrite")
    assert done.exit_code == 0, done.output
    x, cov = np.load(d / "x.npy"), np.load(d / "sigma.npy")
    np.testing.assert_allclose(np.load(out / "mean.npy"), x @ A.T)
    np.testing.assert_allclose(np.load(out / "cov.npy"), np.broadcast_to(A @ cov @ A.T, (N, 3, 3)))
    # an earlier run's results are files like any other: kept unless --overwrite
    assert_refused(invoke(*args), 6, str(out / "mean.npy"))
    assert sorted(p.name for p in out.iterdir()) == ["cov.npy", "mean.npy"]


def test_propagate_never_replaces_a_directory(d: Path) -> None:
    out = d / "prop"
    (out / "cov.npy").mkdir(parents=True)
    (out / "cov.npy" / "keep.txt").write_text("mine")
    result = invoke("propagate", f"{d / 'm.py'}:model", "-i", d / "x.npy", "--std", "0.1",
                    "-o", out, "--overwrite")
    assert_refused(result, 6, str(out / "cov.npy"), "directory")
    assert (out / "cov.npy" / "keep.txt").read_text() == "mine"
    assert not (out / "mean.npy").exists()


def test_propagate_writes_beside_inputs_in_its_directory(d: Path) -> None:
    """A directory that holds the inputs is a fine --output when nothing in it is replaced."""
    result = invoke("propagate", f"{d / 'm.py'}:model", "-i", d / "x.npy", "--std", "0.1",
                    "-o", d)
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(d / "mean.npy"), np.load(d / "x.npy") @ A.T)
    np.testing.assert_allclose(np.load(d / "cov.npy"), np.broadcast_to(0.01 * A @ A.T, (N, 3, 3)))


def test_propagate_temporary_is_not_written_through_a_planted_link(d: Path) -> None:
    out = d / "prop"
    out.mkdir()
    victim = d / "victim.npy"
    np.save(victim, np.arange(5.0))
    before = victim.read_bytes()
    os.symlink(victim, out / ".mean.npy.partial")
    result = invoke("propagate", f"{d / 'm.py'}:model", "-i", d / "x.npy", "--std", "0.1",
                    "-o", out)
    assert result.exit_code == 0, result.output
    assert victim.read_bytes() == before
    assert not (out / "mean.npy").is_symlink()
    np.testing.assert_allclose(np.load(out / "mean.npy"), np.load(d / "x.npy") @ A.T)


# -- every subcommand: an output is never one of its inputs ------------------------------------

def _cases(d: Path) -> dict[str, tuple[list[Any], str, Path]]:
    """name: (arguments, the option whose file the output would replace, that file)."""
    m = f"{d / 'm.py'}:model"
    (d / "solved").mkdir()
    np.save(d / "solved" / "y.npy", np.load(d / "y.npy"))
    (d / "model.h5").write_bytes(b"\x89HDF\r\n\x1a\nnot really a model")
    (d / "rep").mkdir()
    (d / "rep" / "report.md").write_text("a\nb\n")
    return {
        "compute -o = -i": (["compute", m, "-i", d / "x.npy", "-o", d / "x.npy"], "--inputs",
                            d / "x.npy"),
        "compute -o = -k": (["compute", m, "-i", d / "x.npy", "-k", d / "h.npy", "-o",
                             d / "h.npy"], "--known", d / "h.npy"),
        "compute -o, spelled otherwise": (["compute", m, "-i", d / "x.npy", "-o",
                                          d / "solved" / ".." / "x.npy"], "--inputs", d / "x.npy"),
        "compute side file = -k": (["compute", m, "-i", d / "x.npy", "-k", d / "jac.outputs.npy",
                                    "-o", d / "jac.npy", "--with-outputs"], "--known",
                                   d / "jac.outputs.npy"),
        "compute -o = MODEL": (["compute", d / "model.h5", "-i", d / "x.npy", "-o", d / "model.h5"],
                               "MODEL", d / "model.h5"),
        "hessian -o = -i": (["hessian", m, "-i", d / "x.npy", "-o", d / "x.npy"], "--inputs",
                            d / "x.npy"),
        "solve -o holds --targets": (["solve", m, "--targets", d / "solved" / "y.npy",
                                      "--n-unknowns", 2, "-o", d / "solved"], "--targets",
                                     d / "solved" / "y.npy"),
        "solve -o = --x0": (["solve", m, "--targets", d / "y.npy", "--x0", d / "x0.zarr",
                             "-o", d / "x0.zarr"], "--x0", d / "x0.zarr"),
        "report -o = --input-names": (["report", m, "-i", d / "x.npy", "--input-names",
                                       f"@{d / 'rep' / 'report.md'}", "-o", d / "rep"],
                                      "--input-names", d / "rep" / "report.md"),
    }


CASES = ["compute -o = -i", "compute -o = -k", "compute -o, spelled otherwise",
         "compute side file = -k", "compute -o = MODEL", "hessian -o = -i",
         "solve -o holds --targets", "solve -o = --x0", "report -o = --input-names"]


@pytest.mark.parametrize(("case", "overwrite"), [
    (case, overwrite) for case in CASES for overwrite in (False, True)])
def test_an_output_is_never_one_of_the_inputs(d: Path, case: str, overwrite: bool) -> None:
    """``-o`` equal to ``-i`` with --overwrite destroyed the input, exit 0."""
    args, option, path = _cases(d)[case]
    if case == "solve -o = --x0":  # an input that is a directory (a Zarr store), as the output
        zarr = pytest.importorskip("zarr")
        zarr.save_array(str(path), np.load(d / "x.npy"))
    if case == "compute side file = -k":
        np.save(path, np.load(d / "h.npy"))
    before = snapshot(d)
    result = invoke(*args, *(["--overwrite"] if overwrite else []))
    assert_refused(result, 6, option, str(path))
    assert snapshot(d) == before
    assert not list(d.glob("**/*.partial"))


def test_a_hard_link_to_an_input_is_that_input(d: Path) -> None:
    os.link(d / "x.npy", d / "same.npy")
    before = (d / "x.npy").read_bytes()
    result = invoke("compute", f"{d / 'm.py'}:model", "-i", d / "x.npy", "-o", d / "same.npy",
                    "--overwrite")
    assert_refused(result, 6, "--inputs", str(d / "x.npy"))
    assert (d / "x.npy").read_bytes() == before


def test_outputs_beside_the_inputs_still_work(d: Path) -> None:
    """The refusal is of the input's own path, not of its folder or its name's stem."""
    res = invoke("compute", f"{d / 'm.py'}:model", "-i", d / "x.npy", "-o", d / "x.out.npy", "-q")
    assert res.exit_code == 0, res.output
    np.testing.assert_allclose(np.load(d / "x.out.npy"), np.broadcast_to(A, (N, 3, 2)))
    res = invoke("solve", f"{d / 'm.py'}:model", "--targets", d / "y.npy", "--n-unknowns", 2,
                 "-o", d / "solved_here", "-q")
    assert res.exit_code == 0, res.output
    np.testing.assert_allclose(np.load(d / "solved_here" / "x.npy"), np.load(d / "x.npy"),
                               atol=1e-6)


# -- inputs that are not regular files ---------------------------------------------------------

def run_cli(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``batchjac ARGS`` in a fresh process: a command that blocks fails the test at BLOCKS s
    instead of hanging it."""
    try:
        return subprocess.run([sys.executable, "-m", "batchjac", *map(str, args)], cwd=cwd,
                              capture_output=True, text=True, timeout=BLOCKS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"batchjac {' '.join(map(str, args))} blocked for {BLOCKS} s")


def assert_refused_at_once(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "MemoryError" not in proc.stderr
    assert "not a regular file" in lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("suffix", [".npy", ".csv"])
def test_a_fifo_as_input_is_refused_without_blocking(d: Path, suffix: str) -> None:
    fifo = d / f"pipe{suffix}"
    os.mkfifo(fifo)
    proc = run_cli("compute", "m.py:model", "-i", fifo.name, "-o", "out.npy", cwd=d)
    assert_refused_at_once(proc, "--inputs", fifo.name, "FIFO")
    assert not (d / "out.npy").exists()


@pytest.mark.parametrize("suffix", [".npy", ".csv"])
def test_a_link_to_dev_zero_as_input_is_refused(d: Path, suffix: str) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    os.symlink("/dev/zero", d / f"zero{suffix}")
    proc = run_cli("propagate", "m.py:model", "-i", "x.npy", "--cov", f"zero{suffix}", "-o", "p",
                   cwd=d)
    assert_refused_at_once(proc, "--cov", f"zero{suffix}", "character device", "/dev/zero")


def test_other_files_read_by_the_cli_are_refused_when_not_regular(d: Path) -> None:
    os.mkfifo(d / "names.txt")
    proc = run_cli("report", "m.py:model", "-i", "x.npy", "--input-names", "@names.txt",
                   "-o", "rep", cwd=d)
    assert_refused_at_once(proc, "--input-names", "names.txt")
    os.mkfifo(d / "pipe.py")
    proc = run_cli("compute", "pipe.py:model", "-i", "x.npy", "-o", "j.npy", cwd=d)
    assert_refused_at_once(proc, "MODEL", "pipe.py")


# -- output names the filesystem cannot hold ---------------------------------------------------

def test_an_output_name_too_long_for_its_work_files_is_refused_up_front(d: Path) -> None:
    """A 250-character --out failed on the internal OUT.partial name, and the message said
    to run the same command again."""
    limit = os.pathconf(d, "PC_NAME_MAX")
    name = "a" * (limit - 5) + ".npy"  # fits, but OUT.partial does not
    result = invoke("compute", f"{d / 'm.py'}:model", "-i", d / "x.npy", "-o", d / name)
    line = assert_refused(result, 3, "--out", f"{limit} bytes", "NAME_MAX", ".partial")
    assert "run the same command again" not in line
    assert sorted(p.name for p in d.iterdir()) == ["h.npy", "m.py", "sigma.npy", "x.npy", "y.npy"]


def test_the_longest_name_that_fits_is_accepted(d: Path) -> None:
    """The limit is the one the stores need: the work directory's name as it is deleted
    (``OUT.partial.removed-PID-NANOSECONDS``), not less."""
    from batchjac.cli.common import store_suffix

    room = os.pathconf(d, "PC_NAME_MAX") - len(store_suffix())
    name = "b" * (room - 4) + ".npy"
    result = invoke("compute", f"{d / 'm.py'}:model", "-i", d / "x.npy", "-o", d / name, "-q")
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(d / name), np.broadcast_to(A, (N, 3, 2)))
    too_long = "b" * (room - 3) + ".npy"
    assert_refused(invoke("compute", f"{d / 'm.py'}:model", "-i", d / "x.npy", "-o",
                          d / too_long), 3, f"at most {room} bytes")


@pytest.mark.parametrize("command", ["propagate", "report"])
def test_a_directory_name_too_long_is_refused_up_front(d: Path, command: str) -> None:
    limit = os.pathconf(d, "PC_NAME_MAX")
    out = d / ("c" * (limit + 1))
    extra = ["--std", "0.1"] if command == "propagate" else []
    result = invoke(command, f"{d / 'm.py'}:model", "-i", d / "x.npy", *extra, "-o", out)
    assert_refused(result, 3, "--output", f"{limit + 1} bytes", f"{limit} bytes per name")
