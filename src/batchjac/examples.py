"""Built-in example models: the benchmark workloads with seeded weights, in every framework.

>>> from batchjac.examples import workload_inputs
>>> unknown, known = workload_inputs("W1", 3)
>>> unknown.shape, known.shape
((3, 5), (3, 3))
"""

from __future__ import annotations

from typing import Any, Literal

from ._errors import InputError
from ._examples.reference import mlp_forward, mlp_jacobian
from ._examples.weights import WORKLOADS, Workload, cnn_weights, mlp_weights, workload_inputs

Framework = Literal["tensorflow", "torch", "jax"]

__all__ = ["WORKLOADS", "Workload", "cnn_weights", "mlp_forward", "mlp_jacobian",
           "mlp_weights", "seed_model", "workload_inputs", "workload_model"]


def workload_model(name: str, backend: Framework | str = "tensorflow", *, dtype: str = "float32") -> Any:
    """The model of workload ``name`` ("W1".."W4", "W7", "W10") in ``backend``, with the shared weights."""
    if name not in WORKLOADS:
        raise InputError(f"Unknown workload {name!r}; choose one of {sorted(WORKLOADS)}.")
    w = WORKLOADS[name]
    if backend == "tensorflow":
        from ._examples import keras as impl
    elif backend == "torch":
        from ._examples import torch as impl  # type: ignore[no-redef]
    elif backend == "jax":
        from ._examples import jax as impl  # type: ignore[no-redef]
    else:
        raise InputError(f"`backend` must be 'tensorflow', 'torch' or 'jax'; got {backend!r}.")
    return impl.mlp(w.sizes, dtype=dtype) if w.kind == "mlp" else impl.cnn(dtype=dtype)


def seed_model(backend: Framework = "tensorflow", *, dtype: str = "float32") -> Any:
    """The original question's model: 5 unknown + 3 known inputs -> 4 outputs (workload W1).
    It takes ``concat([unknown, known], axis=-1)``."""
    return workload_model("W1", backend, dtype=dtype)
