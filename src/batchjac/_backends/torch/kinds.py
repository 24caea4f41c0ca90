"""Model kinds the torch engine computes through something other than their own call.

A Keras 3 model on the PyTorch backend whose layers compute in half precision (a
``mixed_bfloat16`` or ``bfloat16`` dtype policy) is differentiated through a float32 clone of
it, as on TensorFlow and JAX: :class:`KerasWidened` calls the clone's ``stateless_call`` with the
model's own variable values, read at each call, so a weight assigned or trained in the model is
seen, and nothing is copied while the weights stay put.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ... import _keras_compat
from ..._spec import sample_inputs


class KerasWidened:
    """The Keras ``model`` computed by ``clone`` (its float32 copy): a call is the clone's
    ``stateless_call`` on the model's current variable values (Keras casts them to the clone's
    variables' dtype), in inference mode."""

    def __init__(self, model: Any, clone: Any) -> None:
        self.model = model
        self.clone = clone

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        y, _ = self.clone.stateless_call([v.value for v in model.trainable_variables],
                                         [v.value for v in model.non_trainable_variables],
                                         *args, training=False, **kwargs)
        return y


def keras_runner(model: Any, signature: Any) -> Any:
    """What computes the Keras ``model`` in the bound ``signature``'s dtype: the model itself,
    or a :class:`KerasWidened` where its layers compute in half precision and float32 is
    asked (float64 asked of it is refused when its output comes back narrower, as for any
    Keras model on PyTorch)."""
    if str(signature.dtype) != "float32" or not _keras_compat.computes_in_half(model):
        return model
    keras = sys.modules["keras"]
    versions = f"Keras {getattr(keras, '__version__', '?')}, PyTorch {torch.__version__}"
    args, named = sample_inputs(signature)

    def build(clone: Any) -> None:
        sample = named if named else (list(args) if len(args) > 1 else args[0])
        clone(sample, training=False)

    return KerasWidened(model, _keras_compat.stateless_clone(keras, model, build, versions,
                                                             "float32"))
