"""Closed-form float64 forward passes and Jacobians of the example MLPs, in numpy.

An independent reference for tests and the demo: the Jacobian of
``y = W3ᵀ tanh(W2ᵀ tanh(W1ᵀ x + b1) + b2) + b3`` is ``W3ᵀ D2 W2ᵀ D1 W1ᵀ`` with
``D = diag(1 - tanh²)``, no autodiff involved.
"""

from __future__ import annotations

import numpy as np


def mlp_forward(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    h = np.asarray(x, np.float64)
    for i, (w, b) in enumerate(layers):
        h = h @ w + b
        if i < len(layers) - 1:
            h = np.tanh(h)
    return h


def mlp_jacobian(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """``(N, out, in)`` Jacobians with respect to every input column."""
    h = np.asarray(x, np.float64)
    jac = np.broadcast_to(np.eye(h.shape[1]), (h.shape[0], h.shape[1], h.shape[1]))
    for i, (w, b) in enumerate(layers):
        h = h @ w + b
        jac = np.einsum("io,nij->noj", w, jac)
        if i < len(layers) - 1:
            h = np.tanh(h)
            jac = (1 - h**2)[:, :, None] * jac
    return jac
