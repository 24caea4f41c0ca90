"""A Keras model's linear head: its first layer where that is a plain ``Dense`` layer reading the
unknowns alone (a ``Sequential``, or a functional model of one input whose input only it reads),
whose pre-activation ``z = x K + b`` is linear
in them with the same ``A = K^T`` for every instance
(:class:`batchjac._backends._base.LinearHead`; :mod:`batchjac._backends.jax.head` reads a
jaxpr for the same). ``J_z`` is the Jacobian of the rest of the model (the layer's activation,
then the later layers) with respect to ``z``: ``tape.batch_jacobian`` of it, in one traced
function. Only a ``Dense`` itself (no subclass), floating-point and not quantised, narrower than
the unknowns, on a model of one input (the unknowns alone); otherwise None, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from . import compat

if TYPE_CHECKING:
    from . import TFBound


def read(bound: TFBound, explain: Callable[..., Exception]) -> TFHead | None:
    """The Keras model's linear head, or None (see the module's docstring); ``explain`` makes
    the ModelError of a failure of the model (the backend's)."""
    sig = bound.signature
    if not bound.is_keras or sig.layout.kind != "single" or len(sig.unknown_shape) != 1:
        return None
    try:
        return _read(bound, explain)
    except Exception:  # (a model outside this reader: no head, the plain route)
        return None


def _read(bound: TFBound, explain: Callable[..., Exception]) -> TFHead | None:
    keras: Any = compat.keras_module()
    model = bound.model
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    if len(layers) < 2:
        return None
    if isinstance(model, keras.Sequential):
        first, rest = layers[0], layers[1:]
    else:  # a functional model: its one input read by one layer, the rest a model of its own
        inputs = _flat(model.inputs)
        outputs = _flat(model.outputs)
        if len(inputs) != 1 or len(outputs) != 1:
            return None
        readers = [layer for layer in layers
                   if any(t is inputs[0] for t in _flat(layer.input))]
        if len(readers) != 1:
            return None
        first = readers[0]
        rest = [keras.Model(inputs=first.output, outputs=outputs[0])]
    k = int(bound.signature.unknown_shape[0])
    if type(first) is not keras.layers.Dense or getattr(first, "quantization_mode", None) or \
            getattr(first, "lora_enabled", False) or \
            not tf.as_dtype(first.kernel.dtype).is_floating or \
            tuple(first.kernel.shape) != (k, first.units) or first.units >= k:
        return None
    return TFHead(bound, first, rest, explain)


def _flat(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return list(x.values())
    return list(x) if isinstance(x, (list, tuple)) else [x]


class TFHead:
    """:class:`batchjac._backends._base.LinearHead` of a Keras ``Sequential`` whose first layer
    is a ``Dense``: ``A`` its kernel's transpose, ``J_z`` by one ``tf.function``."""

    def __init__(self, bound: TFBound, dense: Any, rest: list[Any],
                 explain: Callable[..., Exception]) -> None:
        self.bound, self.dense, self.rest, self.explain = bound, dense, rest, explain
        self.width = int(dense.units)
        self._fn: Any = None

    def matrix(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        """``A = K^T`` (``w x k``, float64), read from the layer now (its current weights)."""
        return np.asarray(self.dense.kernel, np.float64).T

    def jacobians(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        """``(y, J_z)`` of a block of rows: ``J_z`` is ``(rows, m, w)``."""
        bound = self.bound
        if self._fn is None:
            dense, rest, dtype = self.dense, self.rest, bound.tf_dtype

            def tail(z: tf.Tensor) -> tf.Tensor:
                h = dense.activation(z)
                for layer in rest:
                    h = layer(h, training=False)
                return tf.cast(h, dtype)

            @tf.function(autograph=False, reduce_retracing=True)
            def run(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
                z = tf.matmul(x, tf.cast(dense.kernel, dtype))
                if dense.use_bias:
                    z = z + tf.cast(dense.bias, dtype)
                with tf.GradientTape() as tape:
                    tape.watch(z)
                    y = tail(z)
                    flat = tf.reshape(y, (tf.shape(y)[0], -1))
                return y, tape.batch_jacobian(flat, z, unconnected_gradients="zero")

            self._fn = run
        try:
            y, jz = self._fn(tf.convert_to_tensor(u, bound.tf_dtype))
        except Exception as e:
            from ..._errors import BatchJacError

            if isinstance(e, BatchJacError):
                raise
            raise self.explain(e, bound.signature) from e
        y, jz = y.numpy(), jz.numpy()
        return y, jz.reshape(u.shape[0], math.prod(y.shape[1:]), self.width)
