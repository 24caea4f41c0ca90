"""The one private Keras name batchjac reads outside the TensorFlow backend, guarded.

Keras lists every layer nested in a model through ``model._flatten_layers`` (Keras 2 and 3,
``tf_keras``). The probes (which layers a model holds, :mod:`batchjac._probes`) and the
computation fingerprint (:mod:`batchjac._fingerprint`) need that list before any backend is
chosen, and a Keras model may run on JAX or PyTorch with no TensorFlow installed, so the read
lives here, framework-free, rather than in the TensorFlow backend's compat module, which
delegates to it. Where the name is gone or its signature changed: None, and the callers fall
back to the public ``layers`` attribute (fewer layers seen: a probe more, never a wrong
result). tests/test_compat_tensorflow.py renames it.
"""

from __future__ import annotations

from typing import Any

FLATTEN_LAYERS = "_flatten_layers"


def flattened(model: Any, *, include_self: bool, name: str | None = None) -> list[Any] | None:
    """Every layer nested in a Keras model (with the model first where ``include_self``), or
    None where this Keras cannot list them (``name``: the method, :data:`FLATTEN_LAYERS`)."""
    flatten = getattr(model, FLATTEN_LAYERS if name is None else name, None)
    if not callable(flatten):
        return None
    try:
        return list(flatten(include_self=include_self, recursive=True))
    except Exception:  # another Keras, another signature
        return None
