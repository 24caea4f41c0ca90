"""Seeded numpy weights for the workloads of BENCHMARKS-SPEC.md (framework-free)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "mlp" or "cnn"
    sizes: tuple[int, ...]  # mlp layer widths, input first
    n_unknown: int  # leading input columns that are unknown (all of them for W2/W4)
    description: str


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", "mlp", (8, 64, 64, 4), 5, "seed: MLP 8-64-64-4, 5 unknown + 3 known"),
    "W2": Workload("W2", "mlp", (784, 256, 256, 10), 784, "wide-in: MLP 784-256-256-10"),
    "W3": Workload("W3", "mlp", (8, 256, 256, 512), 4, "wide-out: MLP 8-256-256-512, 4 + 4"),
    "W4": Workload("W4", "cnn", (28, 28, 1), 784, "conv: 28x28x1, conv16, conv32, dense 10"),
    # the second-order workloads' own model (W6 uses W1's): a PINN-style MLP, every input unknown
    "W7": Workload("W7", "mlp", (3, 128, 128, 128, 1), 3, "PINN: MLP 3-128-128-128-1"),
    # a physics-informed training step (differentiable=True): every input unknown
    "W9": Workload("W9", "mlp", (512, 256, 16, 256, 512), 512,
                   "bottleneck: MLP 512-256-16-256-512"),
    "W10": Workload("W10", "mlp", (2, 64, 64, 64, 1), 2, "PINN step: MLP 2-64-64-64-1"),
}

#: CNN layout shared by every framework: 3x3 'valid' convolutions with stride 2, tanh.
CNN_FILTERS = (16, 32)
CNN_KERNEL = 3
CNN_STRIDE = 2
CNN_OUTPUTS = 10


def mlp_weights(sizes: tuple[int, ...], seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Dense layers as ``(W (in, out), b (out,))`` float64, Glorot-scaled so tanh stays in its
    curved range (Jacobians then vary from instance to instance)."""
    rng = np.random.default_rng(seed)
    layers = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        scale = np.sqrt(2.0 / (fan_in + fan_out)) * 1.5
        layers.append((rng.normal(0, scale, (fan_in, fan_out)), rng.normal(0, 0.1, fan_out)))
    return layers


def cnn_out_hw(hw: int) -> int:
    for _ in CNN_FILTERS:
        hw = (hw - CNN_KERNEL) // CNN_STRIDE + 1
    return hw


def cnn_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Conv kernels in HWIO layout (TensorFlow's), dense weights for the NHWC flatten order."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    c_in = 1
    for i, c_out in enumerate(CNN_FILTERS):
        fan = CNN_KERNEL * CNN_KERNEL * c_in
        out[f"conv{i}_w"] = rng.normal(0, np.sqrt(1.0 / fan), (CNN_KERNEL, CNN_KERNEL, c_in, c_out))
        out[f"conv{i}_b"] = rng.normal(0, 0.05, c_out)
        c_in = c_out
    hw = cnn_out_hw(28)
    flat = hw * hw * c_in
    out["dense_w"] = rng.normal(0, np.sqrt(1.0 / flat), (flat, CNN_OUTPUTS))
    out["dense_b"] = rng.normal(0, 0.05, CNN_OUTPUTS)
    return out


def workload_inputs(name: str, n: int, seed: int = 1, dtype: Any = np.float32
                    ) -> tuple[np.ndarray, np.ndarray | None]:
    """``(unknown, known)`` rows for a workload; ``known`` is None when every input is unknown."""
    w = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    if w.kind == "cnn":
        return rng.random((n, *w.sizes), dtype=dtype), None
    # drawn in the target dtype: no float64 temporary (W2 at N=100,000 would double its peak)
    x: np.ndarray = rng.standard_normal((n, w.sizes[0]), dtype=dtype)
    if w.n_unknown == w.sizes[0]:
        return x, None
    return x[:, : w.n_unknown].copy(), x[:, w.n_unknown:].copy()
