"""``batchjac check | propagate | report``, run in-process."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from batchjac.cli import cli

pytest.importorskip("tensorflow")

MODELS = '''
import numpy as np
import tensorflow as tf

W = np.random.default_rng(0).normal(size=(3, 2))


def _make(factor):
    @tf.custom_gradient
    def sin(z):
        def grad(dy):
            return dy * factor * tf.cos(z)
        return tf.sin(z), grad

    def model(x):
        return sin(tf.matmul(x, tf.constant(W, x.dtype)))
    return model


good = _make(1.0)
wrong = _make(2.0)


class Factory:
    @staticmethod
    def build():
        return good
'''


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "models.py").write_text(MODELS)
    x = np.random.default_rng(1).normal(size=(30, 3)).astype("f4")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "cov.npy", np.diag([0.01, 0.02, 0.03]))
    return {"model": str(tmp_path / "models.py"), "x": str(tmp_path / "x.npy"),
            "cov": str(tmp_path / "cov.npy"), "dir": str(tmp_path)}


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_check_passes_and_fails_with_exit_codes(files: dict[str, str]) -> None:
    ok = run("check", f"{files['model']}:good", "--inputs", files["x"], "--sample", "10")
    assert ok.exit_code == 0, ok.output
    assert "batchjac check: PASSED" in ok.output
    assert "a random sample of 10 of 30" in ok.output
    bad = run("check", f"{files['model']}:wrong", "--inputs", files["x"], "--mode", "reverse")
    assert bad.exit_code == 1
    assert "batchjac check: FAILED" in bad.output
    assert "failed: 30 instance(s)" in bad.output


def test_check_with_wrt_and_factory(files: dict[str, str], tmp_path: Path) -> None:
    wide = np.random.default_rng(2).normal(size=(12, 5)).astype("f4")
    np.save(tmp_path / "wide.npy", wide)
    # a model of 5 columns that reads 0, 2 and 4 (a sibling import of the model file)
    (tmp_path / "wrap.py").write_text(
        "from models import good\nimport tensorflow as tf\n"
        "def model(x):\n    return good(tf.gather(x, [0, 2, 4], axis=1))\n")
    res = run("check", f"{tmp_path / 'wrap.py'}:model", "--inputs", str(tmp_path / "wide.npy"),
              "--wrt", "0,2,4")
    assert res.exit_code == 0, res.output
    # unknowns named by their column (of the input, named by its file: every subcommand reads
    # its inputs with batchjac's file readers, as `compute` does)
    assert re.search(r"x \(.*wide\.npy\)\[:, [024]\]", res.output), res.output
    res = run("check", f"{files['model']}:Factory.build()", "--inputs", files["x"])
    assert res.exit_code == 0, res.output


def test_propagate_writes_memmapped_results(files: dict[str, str]) -> None:
    out = Path(files["dir"]) / "prop"
    res = run("propagate", f"{files['model']}:good", "--inputs", files["x"], "--cov", files["cov"],
              "-o", str(out))
    assert res.exit_code == 0, res.output
    mean, cov = np.load(out / "mean.npy"), np.load(out / "cov.npy")
    assert mean.shape == (30, 2)
    assert cov.shape == (30, 2, 2)
    assert np.all(np.diagonal(cov, axis1=1, axis2=2) > 0)
    assert "instance 0: output std" in res.output


def test_propagate_failure_leaves_no_partial_files(files: dict[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from batchjac import _propagate
    from batchjac._errors import ModelError

    out = Path(files["dir"]) / "prop_fail"
    args = ("propagate", f"{files['model']}:good", "--inputs", files["x"], "--cov", files["cov"],
            "-o", str(out))
    assert run(*args).exit_code == 0
    before = {name: (out / name).read_bytes() for name in ("mean.npy", "cov.npy")}

    def half_then_fail(*a: Any, out: Any, **kw: Any) -> Any:
        out[0][:10] = 1.0  # some instances written, then the model fails
        raise ModelError("the model failed on instance 10")

    monkeypatch.setattr(_propagate, "propagate", half_then_fail)
    res = run(*args, "--overwrite")  # the earlier results are replaced only when a run succeeds
    assert res.exit_code != 0
    assert "instance 10" in res.output
    # the earlier results are intact, and nothing half-written is left
    assert {name: (out / name).read_bytes() for name in ("mean.npy", "cov.npy")} == before
    assert sorted(p.name for p in out.iterdir()) == ["cov.npy", "mean.npy"]


def test_propagate_std_forms(files: dict[str, str]) -> None:
    import batchjac
    from batchjac.cli.common import load_model

    model = load_model(f"{files['model']}:good", trust=False).model
    x = np.load(files["x"])
    for std, expect in (("0.1", 0.1), ("0.1,0.2,0.3", [0.1, 0.2, 0.3])):
        out = Path(files["dir"]) / f"p{len(std)}"
        res = run("propagate", f"{files['model']}:good", "--inputs", files["x"], "--std", std,
                  "--method", "unscented", "-o", str(out))
        assert res.exit_code == 0, res.output
        ref = batchjac.propagate(model, x, std=expect, method="unscented")
        np.testing.assert_allclose(np.load(out / "cov.npy"), ref.cov, rtol=1e-6)


def test_report_from_model_and_from_files(files: dict[str, str]) -> None:
    out = Path(files["dir"]) / "rep"
    res = run("report", f"{files['model']}:good", "--inputs", files["x"], "--input-names",
              "a,b,c", "--output-names", "u,v", "-o", str(out))
    assert res.exit_code == 0, res.output
    assert (out / "report.md").exists()
    assert (out / "sensitivity_heatmap.png").exists()
    assert "u: " in res.output
    jac = np.random.default_rng(3).normal(size=(10, 2, 3)) * [1.0, 5.0, 0.1]
    np.save(Path(files["dir"]) / "j.npy", jac)
    out2 = Path(files["dir"]) / "rep2"
    res = run("report", "--jacobians", str(Path(files["dir"]) / "j.npy"), "-o", str(out2))
    assert res.exit_code == 0, res.output
    assert "y0: x1" in res.output


def test_an_earlier_report_is_kept_unless_overwrite(files: dict[str, str]) -> None:
    """A report in the output directory (its Markdown, a chart) is not replaced by another run
    without --overwrite (exit 6, the files untouched); with it, the new report replaces it."""
    jac = np.random.default_rng(4).normal(size=(10, 2, 3)) * [1.0, 5.0, 0.1]
    np.save(Path(files["dir"]) / "j.npy", jac)
    out = Path(files["dir"]) / "rep3"
    args = ["report", "--jacobians", str(Path(files["dir"]) / "j.npy"), "-o", str(out)]
    assert run(*args).exit_code == 0
    (out / "report.md").write_text("the user's edits\n")
    res = run(*args)
    assert res.exit_code == 6, res.output
    assert "--overwrite" in res.output
    assert "report.md" in res.output
    assert (out / "report.md").read_text() == "the user's edits\n"
    (out / "report.md").unlink()  # a chart alone is kept too
    before = (out / "sensitivity_0_y0.png").read_bytes()
    res = run(*args, "--input-names", "p,q,r")
    assert res.exit_code == 6, res.output
    assert "sensitivity_" in res.output
    assert (out / "sensitivity_0_y0.png").read_bytes() == before
    res = run(*args, "--overwrite")
    assert res.exit_code == 0, res.output
    assert (out / "report.md").read_text().startswith("# batchjac sensitivity report")


@pytest.mark.parametrize(
    ("args", "match", "code"),
    [
        (["check", "nocolon", "--inputs", "{x}"], "MODEL must be 'module:attr'", 2),
        (["check", "missing.py:f", "--inputs", "{x}"], "does not exist", 3),
        (["check", "{model}:nothere", "--inputs", "{x}"], "has no attribute 'nothere'", 5),
        (["check", "{model}:W", "--inputs", "{x}"], "not a callable model", 5),
        (["check", "{model}:good"], "--inputs FILE.npy", 2),
        (["check", "{model}:good", "--inputs", "nope.npy"], "does not exist", 3),
        (["check", "{model}:good", "--inputs", "{x}", "--wrt", "a,b"], "has no column names", 4),
        (["check", "{model}:good", "--inputs", "{x}", "--inputs", "{x}"], "--wrt-input INDEX", 2),
        (["propagate", "{model}:good", "--inputs", "{x}", "-o", "{out}"], "exactly one of `cov`", 2),
        (["propagate", "{model}:good", "--inputs", "{x}", "--std", "big", "-o", "{out}"],
         "--std must be a number", 2),
        (["propagate", "{model}:good", "--inputs", "{x}", "--cov", "{x}", "-o", "{out}"],
         "`cov` has shape (30, 3)", 4),
        (["report", "-o", "{out}"], "Give either MODEL", 2),
        (["check", "no_such_module_xyz:f", "--inputs", "{x}"], "Cannot import module", 3),
    ],
)
def test_user_errors_exit_without_traceback(files: dict[str, str], args: list[str],
                                             match: str, code: int) -> None:
    """Usage errors exit 2; a missing file 3, invalid data (a column name for a file without
    names, a covariance of the wrong shape) 4, a model that cannot be loaded 5: the codes of
    every subcommand (docs/cli.md)."""
    fill = {"model": files["model"], "x": files["x"], "out": str(Path(files["dir"]) / "o")}
    res = CliRunner().invoke(cli, [a.format(**fill) for a in args])
    assert res.exit_code == code, res.output
    assert match in res.output
    assert "Traceback" not in res.output


def test_commands_are_registered() -> None:
    res = run("--help")
    for name in ("check", "propagate", "report"):
        assert name in res.output
