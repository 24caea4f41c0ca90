"""Second-order workloads (BENCHMARKS-SPEC.md W6, W7): per-instance Hessians and Laplacians,
batchjac beside the native answer of each framework, steady state (through
:mod:`batchjac._bench.worker`) and first call (through :mod:`batchjac._bench.cold`).

- W6: the seed MLP (W1: 8-64-64-4, tanh), the Hessian w.r.t. the 5 unknowns, N=10,000;
- W7: a PINN-style MLP 3-128-128-128-1 (tanh), the Laplacian over its 3 inputs, N=100,000;
- W7H: the same model, its full Hessian.

Native answers, each what an expert of the framework writes for one batch: torch
``vmap(jacfwd(jacrev(f)))`` (what ``torch.func.hessian`` is); JAX
``jit(vmap(jax.hessian(f)))``; TensorFlow two nested tapes, ``batch_jacobian`` of
``batch_jacobian``, inside ``tf.function``. Not under XLA: with ``jit_compile=True`` the nested
tapes need compile-time constants (pfor's shapes of the inner Jacobian), so TensorFlow compiles
the function once per input *value* (measured here: 19 s for every new batch of W7H, N=2,000,
and a constant-folded result, 0.35 ms, when the same array is passed again), which is neither
what a user can run nor a fair timing. The Laplacian's native answer is
the trace of that Hessian (what users write: jax-ml/jax#2682, DeepXDE's ``hessian`` summed).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SecondWorkload:
    name: str
    base: str  # the workload whose model and inputs it uses (batchjac.examples.WORKLOADS)
    kind: str  # "hessian" | "laplacian"
    description: str


SECOND: dict[str, SecondWorkload] = {
    "W6": SecondWorkload("W6", "W1", "hessian", "seed MLP 8-64-64-4: Hessian w.r.t. 5 unknowns"),
    "W7": SecondWorkload("W7", "W7", "laplacian", "PINN MLP 3-128-128-128-1: Laplacian over 3 inputs"),
    "W7H": SecondWorkload("W7H", "W7", "hessian", "PINN MLP 3-128-128-128-1: full Hessian"),
}

NATIVE_NAME = {"tensorflow": "nested batch_jacobian tapes (tf.function)",
               "torch": "vmap(jacfwd(jacrev))", "jax": "jit(vmap(hessian))"}


def is_second(workload: str) -> bool:
    return workload in SECOND


def native_name(workload: str, backend: str) -> str:
    name = NATIVE_NAME[backend]
    return f"trace of {name}" if SECOND[workload].kind == "laplacian" else name


def model_and_inputs(workload: str, backend: str, n: int
                     ) -> tuple[Any, np.ndarray, np.ndarray | None]:
    from ..examples import workload_inputs, workload_model

    base = SECOND[workload].base
    unknown, known = workload_inputs(base, n)
    return workload_model(base, backend), unknown, known


def batchjac_call(workload: str, model: Any, data: tuple[np.ndarray, ...]) -> np.ndarray:
    """batchjac's answer for the workload: ``hessian`` or ``laplacian``."""
    import batchjac

    if SECOND[workload].kind == "laplacian":
        return np.asarray(batchjac.laplacian(model, *data))
    return np.asarray(batchjac.hessian(model, *data))


def native(workload: str, backend: str, model: Any
           ) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    """The framework's native answer, built (not yet called) for this model."""
    trace = SECOND[workload].kind == "laplacian"
    if backend == "torch":
        return _torch(model, trace)
    if backend == "jax":
        return _jax(model, trace)
    if backend == "tensorflow":
        return _tf(model, trace)
    raise SystemExit(f"unknown backend {backend!r}")


def _torch(model: Any, trace: bool) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    import torch
    from torch.func import jacfwd, jacrev, vmap

    def run(unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
        # torch 2.9+: jacfwd's first use imports decompositions that warn "torch.jit.script
        # is deprecated" (framework noise; the test suite turns warnings into errors)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            u = torch.from_numpy(unknown)
            if known is None:
                h = vmap(jacfwd(jacrev(lambda z: model(z[None])[0])))(u)
            else:
                def one(z: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
                    return model(torch.cat([z, k], dim=-1)[None])[0]

                h = vmap(jacfwd(jacrev(one, argnums=0), argnums=0))(u, torch.from_numpy(known))
            if trace:
                h = torch.diagonal(h, dim1=-2, dim2=-1).sum(-1)
            return h.numpy()

    return run


def _jax(model: Any, trace: bool) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    import jax
    import jax.numpy as jnp

    def one(u: Any, h: Any) -> Any:
        x = u if h is None else jnp.concatenate([u, h], axis=-1)
        return model(x[None])[0]

    def per(u: Any, h: Any) -> Any:
        out = jax.hessian(one, argnums=0)(u, h)
        return jnp.trace(out, axis1=-2, axis2=-1) if trace else out

    with_known = jax.jit(jax.vmap(per))
    alone = jax.jit(jax.vmap(lambda u: per(u, None)))

    def run(unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
        return np.asarray(alone(unknown) if known is None else with_known(unknown, known))

    return run


def _tf(model: Any, trace: bool) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    import tensorflow as tf

    def hess(u: Any, known: Any) -> Any:
        with tf.GradientTape() as outer:
            outer.watch(u)
            with tf.GradientTape() as inner:
                inner.watch(u)
                x = u if known is None else tf.concat([u, known], axis=-1)
                y = model(x, training=False)
            jac = inner.batch_jacobian(y, u)
        h = outer.batch_jacobian(jac, u)
        return tf.linalg.trace(h) if trace else h

    compiled = tf.function(hess)
    return lambda unknown, known: compiled(unknown, known).numpy()
