"""The example workloads as JAX batch functions ``f(x)`` (JAX backend).

Same weights and layouts as ``keras.py``: Dense kernels ``(in, out)``; the CNN takes NHWC
images ``(N, 28, 28, 1)``, with HWIO kernels, 'VALID' padding, stride 2, tanh, and flattens
in NHWC order before the dense layer. The weights are closed over as JAX arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .weights import CNN_FILTERS, CNN_STRIDE, cnn_weights, mlp_weights


def _as_jax(arrays: list[Any], dtype: str) -> list[Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    if np.dtype(dtype) == np.float64 and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        from .._errors import InputError

        raise InputError(
            "A float64 JAX example model needs JAX's x64 mode: call "
            'jax.config.update("jax_enable_x64", True) at the start of the program, or use '
            "dtype='float32'."
        )
    return [jnp.asarray(np.asarray(a, dtype=dtype)) for a in arrays]


def mlp(sizes: tuple[int, ...], seed: int = 0, dtype: str = "float32") -> Callable[[Any], Any]:
    import jax.numpy as jnp

    flat = _as_jax([a for layer in mlp_weights(sizes, seed) for a in layer], dtype)
    layers = list(zip(flat[::2], flat[1::2]))

    def f(x: Any) -> Any:
        h = x
        for i, (w, b) in enumerate(layers):
            h = h @ w + b
            if i < len(layers) - 1:
                h = jnp.tanh(h)
        return h

    f.__name__ = f.__qualname__ = f"mlp_{'_'.join(map(str, sizes))}"
    return f


def cnn(seed: int = 0, dtype: str = "float32") -> Callable[[Any], Any]:
    import jax.numpy as jnp
    from jax import lax

    wts = cnn_weights(seed)
    names = [f"conv{i}_{p}" for i in range(len(CNN_FILTERS)) for p in "wb"] + ["dense_w",
                                                                               "dense_b"]
    arrays = dict(zip(names, _as_jax([wts[n] for n in names], dtype)))
    convs = [(arrays[f"conv{i}_w"], arrays[f"conv{i}_b"]) for i in range(len(CNN_FILTERS))]
    dense_w, dense_b = arrays["dense_w"], arrays["dense_b"]

    def f(x: Any) -> Any:
        h = x
        for w, b in convs:
            h = lax.conv_general_dilated(h, w, window_strides=(CNN_STRIDE, CNN_STRIDE),
                                         padding="VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            h = jnp.tanh(h + b)
        return h.reshape(h.shape[0], -1) @ dense_w + dense_b

    f.__name__ = f.__qualname__ = "cnn"
    return f
