"""A quiet terminal (batchjac.cli.quiet): a command run as a user runs it, in a fresh process,
prints on stderr only its progress bar and summary (nothing with -q); the frameworks' logs come
back with -v; batchjac's warnings are one line each, in the command's flags."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchjac.cli.quiet import in_cli_terms, is_noise, min_log_level, wants_verbose

SRC = str(Path(__file__).resolve().parents[1] / "src")


def batchjac_cli(*args: Any, cwd: Path,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m batchjac ARGS`` in a fresh process, the environment as a user's: no
    TF_CPP_MIN_LOG_LEVEL (unless ``env`` sets it), no warning filters."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONWARNINGS")}
    base["PYTHONPATH"] = SRC + os.pathsep + base.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "batchjac", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env={**base, **(env or {})}, timeout=300)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("quiet")
    torch = pytest.importorskip("torch")
    from batchjac.examples import seed_model

    seed_model("tensorflow").save(str(folder / "m.keras"))
    with warnings.catch_warnings():  # torch deprecates TorchScript; users still have .pt files
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(seed_model("torch")), str(folder / "m.pt"))
    rng = np.random.default_rng(0)
    np.save(folder / "u.npy", rng.normal(size=(300, 5)).astype("float32"))
    np.save(folder / "h.npy", rng.normal(size=(300, 3)).astype("float32"))
    (folder / "jax_model.py").write_text(
        "import jax.numpy as jnp\n"
        "def model(x):\n"
        "    return jnp.tanh(2.0 * x[:, :4]) + x[:, 4:5] * x[:, 7:8]\n")
    (folder / "blind.py").write_text(
        "import torch\n"
        "def model(x):\n"
        "    return torch.tanh(x[:, 5:]).sum(-1, keepdim=True) + 0 * x[:, :5].sum(-1, keepdim=True)\n")
    return folder


def _fresh_cache(tmp_path: Path, name: str) -> dict[str, str]:
    """A cache directory of its own: no decision remembered by an earlier run (which compile
    was chosen, which probes passed) changes what this run does, and prints."""
    return {"BATCHJAC_CACHE_DIR": str(tmp_path / f"cache-{name}")}


def _stderr_lines(text: str) -> list[str]:
    """stderr split at newlines and at the carriage returns of the progress bar."""
    return [part for line in text.split("\n") for part in line.split("\r") if part.strip()]


@pytest.mark.parametrize("model", ["m.keras", "jax_model.py:model"])
def test_compute_prints_only_the_bar_and_the_summary(files: Path, model: str) -> None:
    """Keras: TensorFlow's oneDNN banner and absl preamble (twice); JAX: XLA's PjRt lines."""
    out = f"j-{model.split('.')[0]}.npy"
    res = batchjac_cli("compute", model, "-i", "u.npy", "-k", "h.npy", "-o", out, cwd=files)
    assert res.returncode == 0, res.stderr
    lines = _stderr_lines(res.stderr)
    summary = [ln for ln in lines if ln.startswith(f"batchjac: 300 rows -> {out}")]
    assert len(summary) == 1, res.stderr
    bar = [ln for ln in lines if ln.startswith("batchjac: ") and "row" in ln and "%|" in ln]
    assert bar, f"no progress bar in {res.stderr!r}"
    assert set(lines) == set(summary) | set(bar), res.stderr  # nothing else at all
    assert np.load(files / out).shape[0] == 300


def test_quiet_means_an_empty_stderr(files: Path) -> None:
    res = batchjac_cli("compute", "m.keras", "-i", "u.npy", "-k", "h.npy", "-o", "jq.npy", "-q",
                       cwd=files)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert np.load(files / "jq.npy").shape == (300, 4, 5)


@pytest.mark.parametrize("model", ["m.keras", "m.pt"])
def test_check_prints_its_report_and_nothing_on_stderr(files: Path, model: str) -> None:
    """On a Keras model TensorFlow logged 'Not handling type DT_DOUBLE' ~20 times (the float64
    copy of the reference), plus its oneDNN banner twice."""
    for extra in ((), ("-q",)):
        res = batchjac_cli("check", model, "-i", "u.npy", "-k", "h.npy", *extra, cwd=files)
        assert res.returncode == 0, res.stderr
        assert "PASSED" in res.stdout
        assert res.stderr == ""


def test_verbose_gives_the_frameworks_logs_back(files: Path) -> None:
    res = batchjac_cli("check", "m.keras", "-i", "u.npy", "-k", "h.npy", "-v", cwd=files)
    assert res.returncode == 0, res.stderr
    # (which lines TensorFlow logs depends on the CPU: an Intel one with AVX-512 gets the
    # oneDNN banner, an AMD EPYC only the cpu_feature_guard line; both are INFO lines)
    assert _tensorflow_info_lines(res.stderr), res.stderr
    # the user's own setting is kept, and honoured for the lines batchjac filters
    res = batchjac_cli("check", "m.keras", "-i", "u.npy", "-k", "h.npy", cwd=files,
                       env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert _tensorflow_info_lines(res.stderr), res.stderr


def _tensorflow_info_lines(stderr: str) -> list[str]:
    """TensorFlow's (absl's) INFO lines: ``I0000 00:00:1796207083.193444   30259 port.cc:153] ...``."""
    return [ln for ln in stderr.splitlines() if re.match(r"I\d{4} \d\d:\d\d:\d+\.\d+ ", ln)]


def test_a_warning_is_one_line_of_batchjac_in_cli_terms(files: Path) -> None:
    """A model that reads only the known columns: the ZeroJacobianWarning, as one line, with no
    Python file path of batchjac's; -q drops it."""
    res = batchjac_cli("compute", "blind.py:model", "-i", "u.npy", "-k", "h.npy", "-o", "z.npy",
                       "--backend", "torch", cwd=files)
    assert res.returncode == 0, res.stderr
    lines = _stderr_lines(res.stderr)
    warned = [ln for ln in lines if ln.startswith("batchjac: warning: ")]
    assert len(warned) == 1, res.stderr
    assert "zero" in warned[0].lower()
    assert ".py:" not in res.stderr.replace("blind.py:model", "")
    assert "warnings.warn" not in res.stderr
    quiet = batchjac_cli("compute", "blind.py:model", "-i", "u.npy", "-k", "h.npy", "-o", "z2.npy",
                         "--backend", "torch", "-q", cwd=files)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""


def test_an_error_still_reaches_stderr_in_cli_terms(files: Path) -> None:
    (files / "taken.manifest.json").write_text("{}")
    res = batchjac_cli("compute", "m.pt", "-i", "u.npy", "-k", "h.npy", "-o", "taken.npy", "-q",
                       cwd=files)
    assert res.returncode == 6
    assert res.stderr.startswith("batchjac compute: error: ")
    assert "--overwrite" in res.stderr
    assert "overwrite=True" not in res.stderr


def test_the_filter_and_the_advice() -> None:
    glog = b"I0000 00:00:1796131449.801629   30259 port.cc:153] oneDNN custom operations are on."
    assert is_noise(glog, 2)
    assert not is_noise(glog, 0)
    assert is_noise(b"W0000 00:00:1796131632.019732   31816 util.cc:163] Not handling type DT_DOUBLE", 2)
    assert not is_noise(b"F0000 00:00:1796131632.019732   31816 util.cc:163] Check failed", 2)
    assert not is_noise(b"Iteration 3: loss 0.1", 2)
    assert wants_verbose(["check", "m.keras", "-v"])
    assert not wants_verbose(["check", "--", "-v"])
    assert in_cli_terms("Pass mode='forward' or chunk_size=64.") == "Pass --mode forward or --chunk-size 64."


def test_min_log_level_keeps_the_users_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    assert min_log_level(False) == 2
    assert min_log_level(True) == 0
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    assert min_log_level(False) == 1
    assert min_log_level(True) == 1


def test_command_output_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    """Within a command: batchjac's warning as one line in CLI terms, others' warnings and the
    frameworks' loggers (TensorFlow's retracing warnings) held back; all restored after."""
    import logging

    from batchjac import ForwardModeFallbackWarning
    from batchjac.cli.quiet import command_output

    tf_logger = logging.getLogger("tensorflow")
    before = tf_logger.level
    with command_output(quiet=False, verbose=False):
        warnings.warn("forward mode failed.\nPass mode='reverse' to skip the attempt.",
                      ForwardModeFallbackWarning, stacklevel=1)
        warnings.warn("a framework's deprecation", UserWarning, stacklevel=1)
        assert not tf_logger.isEnabledFor(logging.WARNING)
    err = capsys.readouterr().err
    assert err == "batchjac: warning: forward mode failed. Pass --mode reverse to skip the attempt.\n"
    assert tf_logger.level == before
    with command_output(quiet=True, verbose=False):
        warnings.warn("dropped", ForwardModeFallbackWarning, stacklevel=1)
    assert capsys.readouterr().err == ""
    with command_output(quiet=False, verbose=True):
        assert tf_logger.level == before  # -v: the frameworks' loggers as they are
        with pytest.warns(UserWarning, match="shown"):
            warnings.warn("shown", UserWarning, stacklevel=1)


_ASSERTING = """
import tensorflow as tf

W = tf.constant([[0.5, -0.2, 0.1, 0.3], [0.2, 0.1, -0.4, 0.3]] * 4)


def model(x):
    tf.debugging.assert_all_finite(x, "inputs must be finite")
    y = tf.tanh(tf.matmul(x, W))
    tf.debugging.assert_less_equal(tf.abs(y), 1.0)
    return y
"""


def test_ignoring_assert_lines_only_with_verbose(files: Path, tmp_path: Path) -> None:
    """A TensorFlow model with assertions: XLA logs "Ignoring Assert operator" for each when
    it compiles the kernel (a native warning line on descriptor 2); gone without -v."""
    (files / "asserting.py").write_text(_ASSERTING)
    args = ("compute", "asserting.py:model", "-i", "u.npy", "-k", "h.npy", "--backend",
            "tensorflow")
    res = batchjac_cli(*args, "-o", "ja.npy", cwd=files, env=_fresh_cache(tmp_path, "plain"))
    assert res.returncode == 0, res.stderr
    lines = _stderr_lines(res.stderr)
    summary = [ln for ln in lines if ln.startswith("batchjac: 300 rows -> ja.npy")]
    bar = [ln for ln in lines if ln.startswith("batchjac: ") and "%|" in ln]
    assert len(summary) == 1, res.stderr
    assert set(lines) == set(summary) | set(bar), res.stderr
    loud = batchjac_cli(*args, "-o", "ja-v.npy", "-v", cwd=files,
                        env=_fresh_cache(tmp_path, "verbose"))
    assert loud.returncode == 0, loud.stderr
    assert "Ignoring Assert operator" in loud.stderr, loud.stderr  # what the filter hides


_RETRACING = """
import numpy as np
import tensorflow as tf

import batchjac

for width in range(2, 8):  # six bound models, each tracing batchjac's forward pass once
    x = np.random.default_rng(width).normal(size=(8, width)).astype("float32")
    batchjac.jacobian(lambda z: tf.tanh(z), x, backend="tensorflow")


@tf.function
def users_own(z):
    return z * 2.0


for n in range(1, 8):  # the user's own function, retraced for every shape: their warning
    users_own(tf.zeros((n,)))


def model(x):
    return tf.tanh(x[:, :4]) * x[:, 4:5]
"""


def test_retracing_warnings_never_name_batchjac(files: Path, tmp_path: Path) -> None:
    """TensorFlow keys its retracing detector by a function's code: the forward passes of
    six bound models (one lambda's code) made it warn about
    ``TFBound.forward.<locals>.<lambda>``. batchjac's own traces no longer count; a user's
    function retraced is still reported with -v (TensorFlow's logger), and not without."""
    (files / "retracing.py").write_text(_RETRACING)
    args = ("compute", "retracing.py:model", "-i", "u.npy", "-k", "h.npy", "--backend",
            "tensorflow")
    res = batchjac_cli(*args, "-o", "jr.npy", cwd=files, env=_fresh_cache(tmp_path, "plain"))
    assert res.returncode == 0, res.stderr
    lines = _stderr_lines(res.stderr)
    summary = [ln for ln in lines if ln.startswith("batchjac: 300 rows -> jr.npy")]
    bar = [ln for ln in lines if ln.startswith("batchjac: ") and "%|" in ln]
    assert len(summary) == 1, res.stderr
    assert set(lines) == set(summary) | set(bar), res.stderr
    loud = batchjac_cli(*args, "-o", "jr-v.npy", "-v", cwd=files,
                        env=_fresh_cache(tmp_path, "verbose"))
    assert loud.returncode == 0, loud.stderr
    retracing = [ln for ln in _stderr_lines(loud.stderr) if "triggered tf.function retracing" in ln]
    assert any("users_own" in ln for ln in retracing), loud.stderr  # -v shows TensorFlow's
    assert not any("TFBound" in ln or "batchjac" in ln for ln in retracing), retracing


def test_batchjac_forward_passes_do_not_warn_in_python(caplog: pytest.LogCaptureFixture) -> None:
    """The same in the Python API, where no filter stands between TensorFlow and the user."""
    tf = pytest.importorskip("tensorflow")
    import logging

    import batchjac

    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        for width in range(2, 9):
            x = np.random.default_rng(width).normal(size=(8, width)).astype("float32")
            batchjac.jacobian(lambda z: tf.sin(z) * 2.0, x, backend="tensorflow")
    assert not [r for r in caplog.records if "retracing" in r.getMessage()], caplog.text
