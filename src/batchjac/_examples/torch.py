"""The example workloads as ``torch.nn.Module`` objects (PyTorch backend).

Same weights as the Keras models of ``keras.py``: a Keras ``Dense`` kernel is ``(in, out)``
while ``torch.nn.Linear`` stores ``(out, in)``, and Keras convolutions are HWIO on NHWC images
while torch's are OIHW on NCHW. The CNN therefore takes NHWC input like the Keras one and
flattens in NHWC order, so that its dense layer uses the Keras weights unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._errors import InputError
from .weights import CNN_FILTERS, CNN_KERNEL, CNN_OUTPUTS, CNN_STRIDE, cnn_weights, mlp_weights


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in ("float32", "float64"):
        raise InputError(f"`dtype` must be 'float32' or 'float64'; got {dtype!r}.")
    return getattr(torch, dtype)


def _param(array: np.ndarray, dtype: Any) -> Any:
    import torch

    return torch.nn.Parameter(torch.tensor(np.ascontiguousarray(array), dtype=dtype))


def mlp(sizes: tuple[int, ...], seed: int = 0, dtype: str = "float32") -> Any:
    """``Linear``/``tanh`` layers of widths ``sizes`` (no activation after the last one)."""
    import torch

    dt = _torch_dtype(dtype)
    layers: list[torch.nn.Module] = []
    weights = mlp_weights(sizes, seed)
    for i, (w, b) in enumerate(weights):
        # skip_init: no random initialisation (it would draw from torch's global generator)
        linear = torch.nn.utils.skip_init(torch.nn.Linear, w.shape[0], w.shape[1], dtype=dt)
        linear.weight = _param(w.T, dt)
        linear.bias = _param(b, dt)
        layers.append(linear)
        if i < len(weights) - 1:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def cnn(seed: int = 0, dtype: str = "float32") -> Any:
    """Two 3x3 stride-2 'valid' tanh convolutions and a dense layer, on NHWC ``(N, 28, 28, 1)``."""
    return _cnn_class()(cnn_weights(seed), _torch_dtype(dtype))


@functools.cache
def _cnn_class() -> Any:
    """The CNN module class, defined on first use so that importing this module does not
    import torch. Module-level ``__getattr__`` below makes it picklable as ``CNN``."""
    import torch

    class CNN(torch.nn.Module):
        def __init__(self, wts: dict[str, np.ndarray], dt: torch.dtype) -> None:
            super().__init__()
            convs = []
            c_in = 1
            for i, c_out in enumerate(CNN_FILTERS):
                conv = torch.nn.utils.skip_init(torch.nn.Conv2d, c_in, c_out, CNN_KERNEL,
                                                stride=CNN_STRIDE, padding=0, dtype=dt)
                conv.weight = _param(wts[f"conv{i}_w"].transpose(3, 2, 0, 1), dt)  # HWIO -> OIHW
                conv.bias = _param(wts[f"conv{i}_b"], dt)
                convs.append(conv)
                c_in = c_out
            self.convs = torch.nn.ModuleList(convs)
            self.dense = torch.nn.utils.skip_init(torch.nn.Linear, wts["dense_w"].shape[0],
                                                  CNN_OUTPUTS, dtype=dt)
            self.dense.weight = _param(wts["dense_w"].T, dt)
            self.dense.bias = _param(wts["dense_b"], dt)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.permute(0, 3, 1, 2)  # NHWC -> NCHW
            for conv in self.convs:
                h = torch.tanh(conv(h))
            h = h.permute(0, 2, 3, 1)  # back to NHWC, so the flatten order is Keras'
            return self.dense(h.flatten(1))

    CNN.__module__, CNN.__qualname__ = __name__, "CNN"
    return CNN


def __getattr__(name: str) -> Any:
    if name == "CNN":
        return _cnn_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
