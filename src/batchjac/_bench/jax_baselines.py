"""JAX baselines (B4): ``jax.jit(jax.vmap(jax.jacrev|jacfwd))`` of the per-instance function,
and the forward pass F. numpy in, numpy out, like batchjac."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def vmap_jac(model: Any, which: str) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    transform = jax.jacrev if which == "jacrev" else jax.jacfwd

    def one(u: jax.Array, h: jax.Array | None) -> jax.Array:
        x = u if h is None else jnp.concatenate([u, h], axis=-1)
        return model(x[None])[0]

    with_known = jax.jit(jax.vmap(transform(one, argnums=0)))
    alone = jax.jit(jax.vmap(transform(lambda u: one(u, None))))

    def run(unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
        out = alone(unknown) if known is None else with_known(unknown, known)
        return np.asarray(out)

    return run


def stateless_jac(model: Any, which: str) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    """The native code for a Keras 3 model on JAX: ``jit(vmap(jacrev|jacfwd))`` of its
    stateless function ``(trainable, non_trainable, x) -> y``, the variables' values (read
    once, here) its arguments, not vmapped."""
    transform = jax.jacrev if which == "jacrev" else jax.jacfwd
    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]

    def one(tv: Any, ntv: Any, u: jax.Array, h: jax.Array | None) -> jax.Array:
        x = u if h is None else jnp.concatenate([u, h], axis=-1)
        return model.stateless_call(tv, ntv, x[None], training=False)[0][0]

    with_known = jax.jit(jax.vmap(transform(one, argnums=2), in_axes=(None, None, 0, 0)))
    alone = jax.jit(jax.vmap(transform(lambda tv, ntv, u: one(tv, ntv, u, None), argnums=2),
                             in_axes=(None, None, 0)))

    def run(unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
        out = alone(trainable, fixed, unknown) if known is None else \
            with_known(trainable, fixed, unknown, known)
        return np.asarray(out)

    return run


def forward(model: Any) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    fwd = jax.jit(lambda u, h: model(u if h is None else jnp.concatenate([u, h], axis=-1)))

    def run(unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
        return np.asarray(fwd(unknown, known))

    return run
