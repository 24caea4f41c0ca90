"""Keras files (``.keras``, ``.h5``), loaded by Keras alone: the model computes on whichever
backend Keras is configured for (``KERAS_BACKEND``: TensorFlow, JAX or PyTorch), and batchjac
detects it from the loaded model. TensorFlow is imported only where Keras runs on it."""

from __future__ import annotations

import os
from typing import Any

from .._errors import ModelLoadError

# (as the TensorFlow backend does: Keras on TensorFlow imports it with the file's load)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def load_keras(path: str, *, trust: bool) -> Any:
    """A ``.keras``/``.h5`` model, with Keras' safe mode on unless ``trust``: a file that would
    run code while loading (e.g. a ``Lambda`` layer's pickled function) is refused."""
    import keras

    try:
        return keras.saving.load_model(path, compile=False, safe_mode=not trust)
    except ValueError as e:
        text = str(e)
        if not trust and ("safe_mode" in text or "unsafe" in text.lower() or "Lambda" in text):
            raise ModelLoadError(
                f"Keras refused to load {path!r} in safe mode: it contains code that would run "
                f"while loading (a Lambda layer or a custom object). If you trust the file, pass "
                f"--trust-model."
            ) from e
        raise
