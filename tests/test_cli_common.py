"""What every subcommand shares (``batchjac.cli``): input files of every format, one exit-code
map, one ``--wrt`` parser, one guard. Checked on a linear model ``y = x @ W``, whose Jacobian is
``W.T`` for every instance, so results are compared with closed forms, not with batchjac."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

pytest.importorskip("tensorflow")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import batchjac  # noqa: E402
from batchjac.cli import cli  # noqa: E402
from batchjac.cli.errors import exit_code, one_line  # noqa: E402

N, K, H, M = 40, 2, 3, 3  # instances; unknown and known columns; outputs
COMMANDS = ["compute", "solve", "check", "propagate", "report"]

MODEL = '''
from pathlib import Path

import numpy as np
import tensorflow as tf

W = np.load(Path(__file__).with_name("w.npy"))


def model(x):
    return tf.matmul(x, tf.constant(W, x.dtype))
'''


def _csv(path: Path, a: np.ndarray) -> None:
    header = ",".join(f"c{j}" for j in range(a.shape[1]))
    np.savetxt(path, a, delimiter=",", fmt="%.17g", header=header, comments="")


def _parquet(path: Path, a: np.ndarray) -> None:
    table = pa.Table.from_arrays([pa.array(a[:, j]) for j in range(a.shape[1])],
                                 names=[f"c{j}" for j in range(a.shape[1])])
    pq.write_table(table, path, row_group_size=16)  # several row groups


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """W (5, 3); x (N, 5) = concat([u, h]); y = x @ W; each array as .npy, .csv and .parquet."""
    folder = tmp_path_factory.mktemp("common")
    rng = np.random.default_rng(20240611)
    w = rng.normal(size=(K + H, M))
    np.save(folder / "w.npy", w)
    (folder / "linear.py").write_text(MODEL)
    x = rng.normal(size=(N, K + H))
    arrays = {"x": x, "u": x[:, :K], "h": x[:, K:], "y": x @ w}
    for name, a in arrays.items():
        np.save(folder / f"{name}.npy", a)
        _csv(folder / f"{name}.csv", a)
        _parquet(folder / f"{name}.parquet", a)
    bad = x[:, :K].copy()
    bad[3, 1] = np.nan
    np.save(folder / "u_nan.npy", bad)
    np.save(folder / "x0_nan.npy", bad)
    (folder / "broken.keras").write_bytes(b"not a zip")
    return {"dir": folder, "w": w, "model": f"{folder / 'linear.py'}:model", **arrays}


def invoke(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _file(data: dict[str, Any], name: str, fmt: str) -> Path:
    return Path(data["dir"]) / f"{name}.{fmt}"


# -- (a) every subcommand reads every input format ---------------------------------------------

def _run(command: str, data: dict[str, Any], fmt: str, out: Path) -> Any:
    """Run ``command`` on the inputs in format ``fmt``; return what it computed."""
    u, h, y = (_file(data, name, fmt) for name in ("u", "h", "y"))
    model, f64 = data["model"], ("--dtype", "float64")  # CSV alone would compute in float32
    if command == "compute":
        res = invoke("compute", model, "-i", u, "-k", h, "-o", out / "j.npy", "-q", *f64)
        assert res.exit_code == 0, res.output
        return np.load(out / "j.npy")
    if command == "solve":
        res = invoke("solve", model, "--targets", y, "-k", h, "--n-unknowns", K, "--seed", 1,
                     "-o", out / "solved", "-q", *f64)
        assert res.exit_code == 0, res.output
        return np.load(out / "solved" / "x.npy")
    if command == "propagate":
        res = invoke("propagate", model, "--inputs", u, "--known", h, "--std", "0.1,0.3",
                     "-o", out / "p", *f64)
        assert res.exit_code == 0, res.output
        return np.load(out / "p" / "mean.npy"), np.load(out / "p" / "cov.npy")
    if command == "check":
        res = invoke("check", model, "--inputs", u, "--known", h, *f64)
        assert res.exit_code == 0, res.output
        assert "batchjac check: PASSED" in res.stdout
        return res.stdout.replace(str(u), "U").replace(str(h), "H")
    assert command == "report"
    res = invoke("report", model, "--inputs", u, "--known", h, "-o", out / "r", *f64)
    assert res.exit_code == 0, res.output
    return res.stdout.rsplit("wrote ", 1)[0], (out / "r" / "report.md").read_text()


@pytest.mark.parametrize("command", COMMANDS)
def test_csv_and_parquet_inputs_give_the_npy_results(command: str, data: dict[str, Any],
                                                      tmp_path: Path) -> None:
    results = {}
    for fmt in ("npy", "csv", "parquet"):
        (tmp_path / fmt).mkdir()
        results[fmt] = _run(command, data, fmt, tmp_path / fmt)
    for fmt in ("csv", "parquet"):
        got, ref = results[fmt], results["npy"]
        if isinstance(ref, str) or (isinstance(ref, tuple) and isinstance(ref[0], str)):
            assert got == ref, fmt
        else:
            for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple)
                            else (ref,)):
                np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14, err_msg=fmt)
    # and the npy run is right: J = W.T (its unknown columns), x solved from y = x @ W
    ref, w = results["npy"], data["w"]
    if command == "compute":
        np.testing.assert_allclose(ref, np.broadcast_to(w[:K].T, (N, M, K)), rtol=1e-12, atol=1e-14)
    elif command == "solve":
        np.testing.assert_allclose(ref, data["u"], rtol=1e-6, atol=1e-8)
    elif command == "propagate":
        jac = w[:K].T
        np.testing.assert_allclose(ref[0], data["y"], rtol=1e-12, atol=1e-14)
        expect = jac @ np.diag([0.1**2, 0.3**2]) @ jac.T
        np.testing.assert_allclose(ref[1], np.broadcast_to(expect, (N, M, M)), rtol=1e-10, atol=1e-14)


# -- (b) one exit-code map for every subcommand ------------------------------------------------

def _args(command: str, data: dict[str, Any], out: Path, *, inputs: Any = None, model: Any = None,
          extra: tuple[Any, ...] = ()) -> list[Any]:
    model = model or data["model"]
    d = Path(data["dir"])
    u = inputs or d / "u.npy"
    if command == "compute":
        return ["compute", model, "-i", u, "-k", d / "h.npy", "-o", out / "j.npy", "-q", *extra]
    if command == "solve":
        return ["solve", model, "--targets", inputs or d / "y.npy", "-k", d / "h.npy",
                "--n-unknowns", K, "-o", out / "s", "-q", *extra]
    if command == "check":
        return ["check", model, "--inputs", u, "--known", d / "h.npy", *extra]
    if command == "propagate":
        return ["propagate", model, "--inputs", u, "--known", d / "h.npy", "--std", "0.1",
                "-o", out / "p", *extra]
    return ["report", model, "--inputs", u, "--known", d / "h.npy", "-o", out / "r", *extra]


def assert_error(result: Result, command: str, code: int, pattern: str) -> None:
    """One line on stderr, ``batchjac COMMAND: error: ...``, no traceback, the exit code."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and " W0000 " not in ln
             and not ln.startswith(("W0000", "I0000", "E0000"))]  # TensorFlow's own log lines
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"batchjac {command}: error: "), lines[0]
    assert "Traceback" not in result.output
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_missing_input_file_exits_3(command: str, data: dict[str, Any], tmp_path: Path) -> None:
    res = invoke(*_args(command, data, tmp_path, inputs=tmp_path / "missing.npy"))
    assert_error(res, command, 3, r"file '.*missing\.npy' does not exist")


@pytest.mark.parametrize("command", COMMANDS)
def test_invalid_data_exits_4(command: str, data: dict[str, Any], tmp_path: Path) -> None:
    d = Path(data["dir"])
    if command == "solve":  # NaN targets are instances marked invalid; NaN starts are an error
        res = invoke(*_args(command, data, tmp_path, extra=("--x0", d / "x0_nan.npy")))
    else:
        res = invoke(*_args(command, data, tmp_path, inputs=d / "u_nan.npy"))
    assert_error(res, command, 4, r"non-finite value.* in row 3")


@pytest.mark.parametrize("command", COMMANDS)
def test_unloadable_model_exits_5(command: str, data: dict[str, Any], tmp_path: Path) -> None:
    res = invoke(*_args(command, data, tmp_path, model=Path(data["dir"]) / "broken.keras"))
    assert_error(res, command, 5, r"Cannot load the model '.*broken\.keras'")
    res = invoke(*_args(command, data, tmp_path, model=f"{data['model'][:-6]}:nothere"))
    assert_error(res, command, 5, r"has no attribute 'nothere'")


USAGE = {
    "compute": (("--wrt", "0"), "--known goes with one --inputs file and no --wrt"),
    "solve": (("--lower", "low"), "--lower must be a number or a file"),
    "check": (("--wrt", "0"), "--known goes with one --inputs file and no --wrt"),
    "propagate": (("--cov", "c.npy"), "exactly one of `cov`"),
    "report": (("--outputs", "y.npy"), "--outputs goes with --jacobians"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_usage_errors_exit_2(command: str, data: dict[str, Any], tmp_path: Path) -> None:
    extra, message = USAGE[command]
    res = invoke(*_args(command, data, tmp_path, extra=extra))
    assert res.exit_code == 2, res.output
    assert message in res.stderr
    assert "Traceback" not in res.output
    res = invoke(*_args(command, data, tmp_path, extra=("--no-such-option",)))
    assert res.exit_code == 2, res.output
    assert "No such option" in res.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_interrupt_exits_130_and_bugs_keep_their_traceback(command: str, data: dict[str, Any],
                                                           tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(ref: str, *, trust: bool) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(f"batchjac.cli.{command}.load_model", interrupted)
    res = invoke(*_args(command, data, tmp_path))
    assert res.exit_code == 130, res.output
    assert re.fullmatch(f"batchjac {command}: interrupted; .*run the same command again.*\n",
                        res.stderr), res.stderr

    def bug(ref: str, *, trust: bool) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(f"batchjac.cli.{command}.load_model", bug)
    res = invoke(*_args(command, data, tmp_path))
    assert res.exit_code == 1
    assert isinstance(res.exception, RuntimeError)  # re-raised: the console script prints it


def test_exit_code_map() -> None:
    from batchjac._io import InputFileError
    from batchjac._loaders import ModelLoadError
    from batchjac._stores import StoreBusyError, StoreExistsError, StoreWriteError

    cases = [(InputFileError("x"), 3), (batchjac.InputError("x"), 4), (batchjac.InputTypeError("x"), 4),
             (batchjac.BatchJacError("x"), 4), (ModelLoadError("x"), 5), (batchjac.ModelError("x"), 5),
             (batchjac.NotConnectedError("x"), 5), (batchjac.BackendNotAvailableError("x"), 5),
             (StoreExistsError("x"), 6), (StoreBusyError("x"), 6), (StoreWriteError("x"), 7)]
    for error, code in cases:
        assert exit_code(error) == code, error
    assert exit_code(ValueError("not ours")) is None
    assert exit_code(RuntimeError("a bug")) is None
    assert one_line(ValueError("first\n  second\n  [backend=jax; inputs: x]")) == "first second"


def test_write_failure_exits_7(data: dict[str, Any], tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def full(*a: Any, **kw: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np.lib.format, "open_memmap", full)
    res = invoke(*_args("propagate", data, tmp_path))
    assert_error(res, "propagate", 7, r"Writing the results into -o '.*p' failed: No space left")
    monkeypatch.setattr("batchjac._report.write_report", full)
    res = invoke(*_args("report", data, tmp_path))
    assert_error(res, "report", 7, r"Writing the results into -o '.*r' failed: No space left")


# -- (c) --wrt selects exactly the named columns --------------------------------------------------

def test_propagate_wrt_columns_closed_form(data: dict[str, Any], tmp_path: Path) -> None:
    """Unknowns 0, 2, 4 of x (the rest known): cov = J S J^T with J = W.T[:, [0, 2, 4]]."""
    w, cols, std = data["w"], [0, 2, 4], np.array([0.2, 0.5, 1.5])
    for wrt in ("0,2,4", "c0,c2,c4"):  # indices, and the CSV's column names
        x = _file(data, "x", "csv" if wrt.startswith("c") else "npy")
        res = invoke("propagate", data["model"], "--inputs", x, "--wrt", wrt, "--std",
                     ",".join(map(str, std)), "--dtype", "float64", "-o", tmp_path / wrt)
        assert res.exit_code == 0, res.output
        jac = w[cols].T
        expect = jac @ np.diag(std**2) @ jac.T
        np.testing.assert_allclose(np.load(tmp_path / wrt / "cov.npy"),
                                   np.broadcast_to(expect, (N, M, M)), rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(np.load(tmp_path / wrt / "mean.npy"), data["y"], rtol=1e-12,
                                   atol=1e-14)


@pytest.mark.parametrize("wrt", ["0,2,4", "0:5:2", "0-4"])
def test_check_and_report_wrt_columns(wrt: str, data: dict[str, Any], tmp_path: Path) -> None:
    """check's table of entries and report's ranking name the selected columns with W's values."""
    w, x = data["w"], _file(data, "x", "npy")
    if wrt == "0:5:2":  # not a range of parse_wrt: a column name, which x.npy does not have
        assert_error(invoke("check", data["model"], "--inputs", x, "--wrt", wrt), "check", 4,
                     r"names column '0:5:2', but .* has no column names")
        return
    cols = [0, 2, 4] if wrt == "0,2,4" else [0, 1, 2, 3, 4]
    res = invoke("check", data["model"], "--inputs", x, "--wrt", wrt)
    assert res.exit_code == 0, res.output
    # an unknown is labelled by its column of x, or u[j] when every column is unknown
    entries = re.findall(r"y\[(\d)\]\s+(?:x \(.*?x\.npy\)\[:, |u\[)(\d)\]\s+(\S+)\s+(\S+)",
                         res.stdout)
    assert entries, res.stdout
    assert {int(c) for _, c, _, _ in entries} <= set(cols)
    for out, col, jac, _ in entries:
        np.testing.assert_allclose(float(jac), w[int(col), int(out)], rtol=1e-4)
    names = [f"col{c}" for c in cols]
    res = invoke("report", data["model"], "--inputs", x, "--wrt", wrt, "--input-names",
                 ",".join(names), "-o", tmp_path / "r")
    assert res.exit_code == 0, res.output
    for o in range(M):
        line = re.search(rf"^  y{o}: (.*)$", res.stdout, re.M)
        assert line, res.stdout
        ranked = dict(item.rsplit(" ", 1) for item in line.group(1).split(", "))
        assert set(ranked) == set(names)
        for name, value in ranked.items():
            np.testing.assert_allclose(float(value), abs(w[int(name[3:]), o]), rtol=5e-3)


# -- (d) --cov is the input covariance, read from any format ----------------------------------

def test_propagate_cov_closed_form(data: dict[str, Any], tmp_path: Path) -> None:
    """cov_i = J Sigma J^T (J = W.T) for a shared Sigma from .npy and .csv, and a per-instance
    stack; the mean is f(x)."""
    rng = np.random.default_rng(7)
    w, k = data["w"], K + H
    a = rng.normal(size=(k, k))
    sigma = a @ a.T + 0.1 * np.eye(k)
    np.save(tmp_path / "sigma.npy", sigma)
    _csv(tmp_path / "sigma.csv", sigma)
    b = rng.normal(size=(N, k, k))
    stack = b @ b.transpose(0, 2, 1) + 0.1 * np.eye(k)
    np.save(tmp_path / "stack.npy", stack)
    cases = {"sigma.npy": np.broadcast_to(w.T @ sigma @ w, (N, M, M)),
             "sigma.csv": np.broadcast_to(w.T @ sigma @ w, (N, M, M)),
             "stack.npy": w.T @ stack @ w}
    for name, expect in cases.items():
        out = tmp_path / name.replace(".", "_")
        res = invoke("propagate", data["model"], "--inputs", _file(data, "x", "npy"), "--cov",
                     tmp_path / name, "-o", out)
        assert res.exit_code == 0, res.output
        np.testing.assert_allclose(np.load(out / "cov.npy"), expect, rtol=1e-10, atol=1e-12,
                                   err_msg=name)
        np.testing.assert_allclose(np.load(out / "mean.npy"), data["y"], rtol=1e-12, atol=1e-14)


def test_npy_arrays_stay_memory_mapped(tmp_path: Path) -> None:
    """--cov/--std stacks may be larger than memory: a .npy is mapped, other formats read."""
    from batchjac.cli.common import Files

    a = np.random.default_rng(3).normal(size=(6, 4))
    np.save(tmp_path / "a.npy", a)
    _csv(tmp_path / "a.csv", a)
    with Files() as files:
        mapped = files.array(str(tmp_path / "a.npy"), "--cov")
        read = files.array(str(tmp_path / "a.csv"), "--cov")
        assert isinstance(mapped, np.memmap)
        np.testing.assert_array_equal(mapped, a)
        np.testing.assert_array_equal(read, a)


# -- the package ------------------------------------------------------------------------------

def test_help_imports_no_framework() -> None:
    """`batchjac --help` and each command's help load click and numpy, not a framework."""
    code = ("import sys\nfrom click.testing import CliRunner\nfrom batchjac.cli import cli\n"
            "for c in ([], " + ", ".join(f"[{c!r}]" for c in [*COMMANDS, "demo", "bench"]) + "):\n"
            "    assert CliRunner().invoke(cli, [*c, '--help']).exit_code == 0, c\n"
            "heavy = ('tensorflow', 'torch', 'jax', 'keras', 'zarr', 'h5py', 'pyarrow', "
            "'matplotlib', 'scipy', 'dask')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(batchjac.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_python_m_batchjac_and_the_console_script(tmp_path: Path) -> None:
    """`python -m batchjac` runs batchjac.cli:main, the console script of pyproject.toml."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'batchjac = "batchjac.cli:main"' in pyproject
    env = {**os.environ, "PYTHONPATH": str(Path(batchjac.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-m", "batchjac", "--version"], capture_output=True,
                         text=True, env=env, check=True)
    assert batchjac.__version__ in out.stdout
    np.save(tmp_path / "x.npy", np.zeros((2, 3)))
    res = subprocess.run([sys.executable, "-m", "batchjac", "check", "nocolon", "--inputs",
                          str(tmp_path / "x.npy")], capture_output=True, text=True, env=env)
    assert res.returncode == 2, res.stderr
    assert "MODEL must be 'module:attr'" in res.stderr
