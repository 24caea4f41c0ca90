"""How batchjac differentiates ONNX models, measured: ``python scripts/onnx_route.py``.

1. Operator coverage on the test models (tests/test_onnx.py's MLP, CNN and two-input concat
   model, from both torch.onnx exporters): plain onnx2torch, onnx2torch as batchjac extends it
   (batchjac._loaders.onnx), and jaxonnxruntime (a JAX interpreter of ONNX graphs) if it is
   importable (``pip install --target DIR --no-deps jaxonnxruntime`` and ``PYTHONPATH=DIR``).
2. Speed: batchjac's Jacobians of the ONNX file beside those of the source torch module, in one
   process, alternating, median of 7 repeats (N=1000, an 8-256-256-64 tanh MLP and the CNN,
   from each exporter).
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

import batchjac
from batchjac._loaders import as_model


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                       torch.nn.Tanh(), torch.nn.Linear(256, 64))

    def forward(self, x: Any) -> Any:
        return self.net(x)


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.dense = torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: Any) -> Any:
        return self.dense(torch.nn.functional.softplus(self.conv(x.reshape(-1, 1, 6, 6))).flatten(1))


class Concat(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))

    def forward(self, u: Any, h: Any) -> Any:
        return self.net(torch.cat([u, h], dim=-1))


def export(module: Any, args: tuple[Any, ...], path: Path, dynamo: bool) -> Path:
    names = ["u", "h"] if len(args) == 2 else ["x"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            n = torch.export.Dim("n")
            torch.onnx.export(module, args, str(path), dynamo=True, input_names=names,
                              dynamic_shapes=tuple({0: n} for _ in args), verbose=False)
        else:
            torch.onnx.export(module, args, str(path), dynamo=False, input_names=names,
                              dynamic_axes={k: {0: "n"} for k in names})
    return path


def plain_onnx2torch(path: Path) -> str:
    """onnx2torch.convert as released, on a fresh registry (a subprocess)."""
    import subprocess
    import sys

    code = ("import sys, onnx\nfrom batchjac._loaders.onnx import _import_onnx2torch\n"
            "convert = _import_onnx2torch()\n"  # the torchvision stand-in only, no extensions
            "try:\n    convert(onnx.load(sys.argv[1])); print('ok')\n"
            "except Exception as e:\n    print(str(e).splitlines()[0][:90])\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    return (out.stdout.strip() or out.stderr.strip().splitlines()[-1])[:90]


def jax_interpreter(path: Path, inputs: list[np.ndarray]) -> str:
    try:
        from jaxonnxruntime import backend
    except ImportError:
        return "not installed"
    try:
        backend.run_model(onnx.load(str(path)), inputs)
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"


def timed_pair(a: Any, b: Any, repeats: int = 7) -> tuple[float, float]:
    """Median seconds of ``a()`` and ``b()``, after a first call of each, run alternately."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    folder = Path(tempfile.mkdtemp(prefix="onnx-route-"))
    models = {"mlp": (MLP().eval(), (torch.randn(4, 8),)), "cnn": (CNN().eval(), (torch.randn(4, 36),)),
              "concat": (Concat().eval(), (torch.randn(4, 5), torch.randn(4, 3)))}
    print("| model | exporter | operators | onnx2torch 1.5.15 | batchjac (extended onnx2torch) "
          "| jaxonnxruntime |")
    print("| --- | --- | --- | --- | --- | --- |")
    files = {}
    for name, (module, args) in models.items():
        for dynamo in (False, True):
            path = export(module, args, folder / f"{name}-{dynamo}.onnx", dynamo)
            files[(name, dynamo)] = path
            ops = sorted({n.op_type for n in onnx.load(str(path)).graph.node})
            try:
                as_model(str(path))
                ours = "ok"
            except batchjac.ModelLoadError as e:
                ours = str(e)[:90]
            inputs = [a.numpy() for a in args]
            print(f"| {name} | {'dynamo' if dynamo else 'torchscript'} | {', '.join(ops)} | "
                  f"{plain_onnx2torch(path)} | {ours} | {jax_interpreter(path, inputs)} |")
    print()
    print("| model | exporter | N | source torch module | its ONNX file | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, width in (("mlp", 8), ("cnn", 36)):
        module = models[name][0]
        x = rng.normal(size=(1000, width)).astype("float32")
        for dynamo in (False, True):
            path = str(files[(name, dynamo)])
            np.testing.assert_allclose(batchjac.jacobian(path, x), batchjac.jacobian(module, x),
                                       rtol=1e-4, atol=1e-6)
            source, translated = timed_pair(lambda module=module, x=x: batchjac.jacobian(module, x),
                                            lambda path=path, x=x: batchjac.jacobian(path, x))
            print(f"| {name} | {'dynamo' if dynamo else 'torchscript'} | 1000 | {source * 1e3:.1f} ms | "
                  f"{translated * 1e3:.1f} ms | {translated / source:.2f} |")


if __name__ == "__main__":
    main()
