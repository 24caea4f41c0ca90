"""Keras models: whether one keeps its rows apart, read from its layers (no call, no trace),
and its float64 clone.

The probes (:mod:`batchjac._probes`) call a TensorFlow model three times in a traced graph and
once more under a gradient tape; for a Keras model those traces are most of what they cost,
a large share of a small model's first call (measured: docs/thresholds.md). A Sequential or
functional model built only of Keras's own layers that act row by row (dense, convolution,
pooling, reshapes of the per-row axes, element-wise merges, Keras's own activations) in
inference mode (batchjac calls with ``training=False``: dropout is the identity) is
deterministic, maps each row to its own output row, and, having one input that every output
is computed from, is connected to it: the probes then need no call. Anything else, a
subclassed model, a ``Lambda`` or custom layer, a custom activation, a normalisation or a
concatenation that could reach the batch axis, answers "cannot tell", and the probes run
with values as before. A layer counts as Keras's own only if its class is the class Keras
exports under that name (:func:`.compat.is_keras_class`): a renamed or unknown class means
"call the model", never "skip the probes".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import _keras_compat
from . import compat

#: Keras layers that act on each row alone, whatever their settings
ROWWISE = frozenset({
    "InputLayer", "Dense", "Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2D", "SeparableConv2D",
    "Flatten", "Reshape", "Activation", "ReLU", "ELU", "LeakyReLU", "Dropout",
    "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D",
    "AveragePooling3D", "GlobalAveragePooling1D", "GlobalAveragePooling2D",
    "GlobalMaxPooling1D", "GlobalMaxPooling2D", "Add", "Subtract", "Multiply", "Average",
    "Maximum", "Minimum", "ZeroPadding1D", "ZeroPadding2D", "Cropping1D", "Cropping2D",
})
#: ... and those that do unless told to work along the batch axis
WITH_AXIS = frozenset({"Concatenate", "Softmax"})
MODELS = frozenset({"Sequential", "Functional"})
_ROW_BY_ROW = MODELS | ROWWISE
_KERAS = ("keras.", "tf_keras.")


def _ours(obj: Any) -> bool:
    return (getattr(type(obj), "__module__", "") or "").startswith(_KERAS)


def _named(obj: Any, names: frozenset[str]) -> bool:
    """Whether ``obj`` is of the Keras class of one of ``names``, exactly."""
    name = type(obj).__name__
    return name in names and compat.is_keras_class(obj, name)


def _activation_ours(layer: Any) -> bool:
    fn = getattr(layer, "activation", None)
    return fn is None or (getattr(fn, "__module__", "") or "").startswith(_KERAS)


def output_shape(model: Any, row: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """The per-row output shape of a Keras model proven to keep its rows apart (and, given
    ``row``, declaring that per-row input shape), or None when that cannot be told."""
    if not _named(model, MODELS) or not _ours(model):
        return None
    layers = compat.keras_layers(model)
    if layers is None:  # another Keras: call it
        return None
    try:
        inputs, shape = model.inputs, model.output_shape
    except Exception:  # not built, or several outputs: call it
        return None
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(shape, tuple) \
            or not shape or not all(isinstance(d, int) for d in shape[1:]):
        return None
    declared = tuple(getattr(inputs[0], "shape", ()))[1:]
    if row is not None and (len(declared) != len(row) or
                            any(d is not None and d != r for d, r in zip(declared, row))):
        return None
    for layer in layers:
        if not _ours(layer) or not _activation_ours(layer):
            return None
        if _named(layer, _ROW_BY_ROW):
            continue
        axis = getattr(layer, "axis", 0)
        if not _named(layer, WITH_AXIS) or not isinstance(axis, int) or not (axis > 0 or axis == -1):
            return None
    return tuple(int(d) for d in shape[1:])


# -- the float64 clone -------------------------------------------------------------------------

def float64_copy(model: Any, build: Callable[[Any], None], dtype: str = "float64") -> Any:
    """A clone of a Keras model in ``dtype`` with the same weights (the model itself where
    none is needed: float64 weights asked for float64, or a float32 model computing in float32),
    or raise InputError (:func:`batchjac._keras_compat.float64_clone`)."""
    keras = compat.keras_module()
    assert keras is not None
    if not _keras_compat.clone_needed(model, dtype):
        return model
    return _keras_compat.float64_clone(keras, model, build, compat.framework_versions(), dtype)
