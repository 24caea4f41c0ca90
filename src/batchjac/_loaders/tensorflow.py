"""TensorFlow SavedModels (imports TensorFlow; a framework module). Keras files: :mod:`.keras`."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

from .._errors import ModelLoadError


def load_saved_model(path: str) -> Any:
    """A callable from a SavedModel: its default serving signature (one input tensor, one
    output tensor), else the object itself if it is callable."""
    obj = tf.saved_model.load(path)
    signatures = getattr(obj, "signatures", {})
    if "serving_default" in signatures:
        fn = signatures["serving_default"]
        inputs = fn.structured_input_signature[1]
        outputs = fn.structured_outputs
        if len(inputs) != 1:
            raise ModelLoadError(
                f"The serving signature of {path!r} takes {len(inputs)} inputs {sorted(inputs)}; "
                f"`batchjac compute` feeds one input tensor. Use the Python API with a function "
                f"that calls the signature for several inputs."
            )
        if isinstance(outputs, dict) and len(outputs) != 1:
            raise ModelLoadError(
                f"The serving signature of {path!r} returns {len(outputs)} outputs "
                f"{sorted(outputs)}; batchjac differentiates one output tensor. Use the Python "
                f"API with a function that picks or concatenates them."
            )
        (in_name,) = inputs
        out_key = next(iter(outputs)) if isinstance(outputs, dict) else None

        def serving(x: Any) -> Any:
            y = fn(**{in_name: x})
            return y[out_key] if out_key is not None else y

        serving.__qualname__ = serving.__name__ = f"saved_model_{in_name}"
        # the signature does not keep the loaded object, whose variables it reads, alive
        serving.saved_model = obj  # type: ignore[attr-defined]
        return serving
    if callable(obj):
        return obj
    raise ModelLoadError(f"The SavedModel {path!r} has no serving_default signature and is not "
                         f"callable; export it with a signature (model.export(path)).")


__all__ = ["load_saved_model", "tf"]
