"""Every subcommand refuses a model file that runs code while it loads, unless --trust-model.

Two kinds of such files: a Keras file with a ``Lambda`` layer (its function is stored as
bytecode) and a ``torch.save`` pickle whose ``__reduce__`` runs code. The pickle here touches a
marker file while unpickling and then returns a real ``nn.Linear``: a subcommand that loads it
without being asked would run the code *and* succeed, so the test asserts on the marker, the
exit code and the message, and that ``--trust-model`` lets the same file through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from batchjac.cli import cli

N = 12


def invoke(*args: Any) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


class _Payload:
    """Unpickles as ``(touch MARKER, nn.Linear(IN, OUT))[1]``: code that runs while loading."""

    def __init__(self, marker: Path, n_in: int, n_out: int) -> None:
        self.marker, self.n_in, self.n_out = marker, n_in, n_out

    def __reduce__(self) -> Any:
        source = (f"(__import__('pathlib').Path({str(self.marker)!r}).touch(), "
                  f"__import__('torch').nn.Linear({self.n_in}, {self.n_out}))[1]")
        return (eval, (source,))


def _torch_pickle(tmp_path: Path) -> tuple[Path, Path]:
    torch = pytest.importorskip("torch")
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save(_Payload(marker, 8, 4), path)
    assert not marker.exists()
    return path, marker


def _keras_lambda(tmp_path: Path) -> tuple[Path, Path]:
    keras = pytest.importorskip("keras")
    marker = tmp_path / "pwned"  # a Lambda layer's code does not run at load; safe mode still refuses it
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Lambda(lambda t: t * 2.0)(keras.layers.Dense(4)(inp)))
    path = tmp_path / "lambda.keras"
    model.save(path)
    return path, marker


def _data(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(7)
    files = {"u": tmp_path / "u.npy", "k": tmp_path / "k.npy", "y": tmp_path / "y.npy"}
    np.save(files["u"], rng.normal(size=(N, 5)).astype("f4"))
    np.save(files["k"], rng.normal(size=(N, 3)).astype("f4"))
    np.save(files["y"], rng.normal(size=(N, 4)).astype("f4"))
    return files


def _command(name: str, model: Path, f: dict[str, Path], out: Path) -> list[Any]:
    if name == "compute":
        return ["compute", model, "-i", f["u"], "-k", f["k"], "-o", out / "jac.npy", "-q"]
    if name == "solve":
        return ["solve", model, "--targets", f["y"], "-k", f["k"], "--n-unknowns", 5,
                "--max-iter", 2, "-o", out / "solved", "-q"]
    if name == "check":
        return ["check", model, "--inputs", f["u"], "--known", f["k"]]
    if name == "propagate":
        return ["propagate", model, "--inputs", f["u"], "--known", f["k"], "--std", "0.1",
                "-o", out / "prop"]
    assert name == "report"
    return ["report", model, "--inputs", f["u"], "--known", f["k"], "-o", out / "report"]


SUBCOMMANDS = ["compute", "solve", "check", "propagate", "report"]


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_torch_pickle_refused_without_trust(name: str, tmp_path: Path) -> None:
    model, marker = _torch_pickle(tmp_path)
    f = _data(tmp_path)
    result = invoke(*_command(name, model, f, tmp_path))
    assert result.exit_code == 5, result.output
    assert "--trust-model" in result.output
    assert not marker.exists(), f"`batchjac {name}` ran code from the model file without --trust-model"
    trusted = invoke(*_command(name, model, f, tmp_path), "--trust-model")
    assert marker.exists()  # the flag reached the loader: the same file now loads
    assert trusted.exit_code in (0, 1), trusted.output  # check may exit 1 if it fails; it ran


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_keras_lambda_refused_without_trust(name: str, tmp_path: Path) -> None:
    model, _ = _keras_lambda(tmp_path)
    f = _data(tmp_path)
    result = invoke(*_command(name, model, f, tmp_path))
    assert result.exit_code == 5, result.output
    assert "safe mode" in result.output
    assert "--trust-model" in result.output
    trusted = invoke(*_command(name, model, f, tmp_path), "--trust-model")
    assert trusted.exit_code in (0, 1), trusted.output
    assert "safe mode" not in trusted.output
