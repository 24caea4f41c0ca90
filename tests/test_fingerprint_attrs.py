"""The computation fingerprint keys the probes' verdict (connectivity, rows that do not
interact) in the tuning cache, read by later processes: it must see everything the forward pass
reads, a module's plain attributes included, or a verdict proven for one model is reused for
another whose rows interact (issue 33, item 2)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac._fingerprint import computation_fingerprint, model_fingerprint

SRC = str(Path(batchjac.__file__).resolve().parents[1])

#: a module whose forward reads a plain attribute: "center" makes every row depend on the batch
TORCH_MODEL = """
import torch

class M(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        if self.mode == "center":
            x = x - x.mean(0, keepdim=True)
        return self.lin(x)
"""


def _torch_model_class() -> Any:
    pytest.importorskip("torch")
    space: dict[str, Any] = {}
    exec(compile(TORCH_MODEL, "<torch model>", "exec"), space)
    return space["M"]


def test_torch_plain_attributes_count() -> None:
    torch = pytest.importorskip("torch")
    M = _torch_model_class()
    assert computation_fingerprint(M("plain")) != computation_fingerprint(M("center"))
    assert computation_fingerprint(M("plain")) == computation_fingerprint(M("plain"))
    inner = M("plain")
    inner.lin.scale = 2.0  # a submodule's attribute counts too
    assert computation_fingerprint(inner) != computation_fingerprint(M("plain"))
    assert computation_fingerprint(M("plain").eval()) != computation_fingerprint(M("plain"))

    def double(module: Any, args: Any, out: Any) -> Any:
        return out * 2

    def triple(module: Any, args: Any, out: Any) -> Any:
        return out * 3

    first = M("plain")
    first.lin.register_forward_hook(double)
    for _ in range(3):  # handle ids are a per-process counter: later hooks get other ids
        torch.nn.Linear(1, 1).register_forward_hook(double)
    second = M("plain")
    second.lin.register_forward_hook(double)
    assert computation_fingerprint(first) == computation_fingerprint(second)
    assert computation_fingerprint(first) != computation_fingerprint(M("plain"))
    other = M("plain")
    other.lin.register_forward_hook(triple)
    assert computation_fingerprint(other) != computation_fingerprint(first)
    with_kwargs = M("plain")
    with_kwargs.lin.register_forward_hook(lambda m, a, k, o: o, with_kwargs=True)
    without = M("plain")
    without.lin.register_forward_hook(lambda m, a, k, o: o)
    assert computation_fingerprint(with_kwargs) != computation_fingerprint(without)


def test_torch_model_fingerprint_is_unchanged() -> None:
    """``model_fingerprint`` is recorded in stores on disk: it must not change, or every
    existing store's resume would be refused. (A store also checks the model's outputs on fixed
    probe inputs, which tells ``M("plain")`` from ``M("center")``.) The value is the one of the
    code before plain attributes entered the computation fingerprint."""
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())
    with torch.no_grad():
        net[0].weight.copy_(torch.arange(6.0).reshape(2, 3))
        net[0].bias.copy_(torch.tensor([0.5, -0.5]))
    net.mode = "center"
    assert model_fingerprint(net) == \
        "sha256:03c62f40a8cfee3661efc3c66eced5970c0f5f809607fa34df373a82ee9f2ee9"


def test_torch_fingerprint_is_the_same_in_every_process() -> None:
    """Plain attributes bring in nothing per-process (handle ids, TorchDynamo's wrapper id)."""
    pytest.importorskip("torch")
    code = TORCH_MODEL + textwrap.dedent("""
        from batchjac._fingerprint import computation_fingerprint
        torch.nn.Linear(1, 1).register_forward_hook(lambda m, a, o: o)  # shifts handle ids
        m = M("center")
        m.lin.register_forward_hook(lambda m, a, o: o * 2)
        m.register_forward_pre_hook(lambda m, a: a)
        print(computation_fingerprint(m))
        print(computation_fingerprint(torch.compile(M("plain"))))
    """)
    runs = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC},
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert runs[0].stdout.split() == runs[1].stdout.split()


def test_keras_subclassed_attributes_count() -> None:
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")

    class Block(keras.layers.Layer):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.scale = scale
            self.dense = keras.layers.Dense(2)

        def call(self, x: Any) -> Any:
            return self.dense(x) * self.scale

    class K(keras.Model):
        def __init__(self, block: Block) -> None:  # an argument get_config cannot serialise
            super().__init__()
            self.mode = "plain"
            self.block = block

        def call(self, x: Any) -> Any:
            if self.mode == "center":
                x = x - keras.ops.mean(x, axis=0, keepdims=True)
            return self.block(x)

    def built(scale: float = 1.0, mode: str = "plain", activation: str | None = None) -> Any:
        model = K(Block(scale))
        model.mode = mode
        if activation is not None:
            model.block.dense.activation = keras.activations.get(activation)
        model(np.zeros((4, 3), "float32"))
        return model

    base = computation_fingerprint(built())
    assert computation_fingerprint(built()) == base
    assert computation_fingerprint(built(mode="center")) != base
    assert computation_fingerprint(built(scale=2.0)) != base
    assert computation_fingerprint(built(activation="tanh")) != base  # a library layer's config


def test_plain_objects_and_dataclasses_count_their_attributes() -> None:
    class Plain:
        def __init__(self, mode: str) -> None:
            self.mode = mode

        def __call__(self, x: np.ndarray) -> np.ndarray:
            return x - x.mean(0) if self.mode == "center" else x

    @dataclasses.dataclass(frozen=True, slots=True)
    class Frozen:
        mode: str

        def __call__(self, x: np.ndarray) -> np.ndarray:
            return x - x.mean(0) if self.mode == "center" else x

    for cls in (Plain, Frozen):
        assert computation_fingerprint(cls("plain")) != computation_fingerprint(cls("center"))
        assert computation_fingerprint(cls("plain")) == computation_fingerprint(cls("plain"))


def test_equinox_static_fields_count() -> None:
    jax = pytest.importorskip("jax")
    eqx = pytest.importorskip("equinox")

    class E(eqx.Module):  # type: ignore[misc]
        lin: Any
        mode: str = eqx.field(static=True)

        def __call__(self, x: Any) -> Any:
            if self.mode == "center":
                x = x - x.mean(0)
            return self.lin(x)

    key = jax.random.PRNGKey(0)
    plain = E(eqx.nn.Linear(3, 2, key=key), "plain")
    center = E(eqx.nn.Linear(3, 2, key=key), "center")
    assert computation_fingerprint(plain) != computation_fingerprint(center)


def _run(code: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC, "BATCHJAC_CACHE_DIR": str(cache)}
    env.pop("BATCHJAC_CACHE", None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_verdict_is_not_reused_for_a_module_whose_attributes_differ(tmp_path: Path) -> None:
    """The issue's case: a first process proves ``M("plain")``'s rows independent and remembers
    it; a second process with ``M("center")`` (rows interact through the batch mean) must not
    reuse that verdict."""
    pytest.importorskip("torch")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    code = TORCH_MODEL + textwrap.dedent("""
        import sys
        import numpy as np
        import batchjac

        torch.manual_seed(0)
        x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
        try:
            jac = batchjac.jacobian(M(sys.argv[1]), x)
        except batchjac.RowInteractionError:
            print("RowInteractionError")
        else:
            print("jacobians", np.asarray(jac).shape)
    """)
    first = _run(code.replace("sys.argv[1]", "'plain'"), cache)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.split() == ["jacobians", "(8,", "2,", "3)"]
    assert [p for p in cache.rglob("*") if p.is_file()], "the first process remembered nothing"
    second = _run(code.replace("sys.argv[1]", "'center'"), cache)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.split() == ["RowInteractionError"]
