"""PyTorch baselines (B3): ``torch.func.vmap`` over per-instance ``jacrev`` / ``jacfwd``, and
the forward pass F. numpy in, numpy out, like batchjac."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.func import jacfwd, jacrev, vmap


def _per_instance(model: Any, with_known: bool) -> Callable[..., torch.Tensor]:
    if with_known:
        return lambda u, h: model(torch.cat([u, h], dim=-1)[None])[0]
    return lambda u: model(u[None])[0]


def vmap_jac(model: Any, which: str) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    """B3: ``vmap(jacrev(f))`` or ``vmap(jacfwd(f))`` of the per-instance function."""
    transform = jacrev if which == "jacrev" else jacfwd

    def run(unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
        with torch.no_grad():  # parameters are constants here
            u = torch.from_numpy(unknown)
            if known is None:
                return vmap(transform(_per_instance(model, False)))(u).numpy()
            h = torch.from_numpy(known)
            return vmap(transform(_per_instance(model, True), argnums=0))(u, h).numpy()

    return run


def forward(model: Any) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    def run(unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
        with torch.no_grad():
            u = torch.from_numpy(unknown)
            x = u if known is None else torch.cat([u, torch.from_numpy(known)], dim=-1)
            return model(x).numpy()

    return run
