"""The private Keras names batchjac reads outside the TensorFlow backend, guarded.

Keras lists every layer nested in a model through ``model._flatten_layers`` (Keras 2 and 3,
``tf_keras``). The probes (which layers a model holds, :mod:`batchjac._probes`) and the
computation fingerprint (:mod:`batchjac._fingerprint`) need that list before any backend is
chosen, and a Keras model may run on JAX or PyTorch with no TensorFlow installed, so the read
lives here, framework-free, rather than in the TensorFlow backend's compat module, which
delegates to it. Where the name is gone or its signature changed: None, and the callers fall
back to the public ``layers`` attribute (fewer layers seen: a probe more, never a wrong
result). tests/test_compat_tensorflow.py renames it.

:func:`config` reads a model's config (the computation fingerprint's view of it) without
importing TensorFlow where it is not imported: a Keras model on the JAX or PyTorch backend
paid seconds for it in its first call (:data:`LAZY_TENSORFLOW`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._errors import InputError

FLATTEN_LAYERS = "_flatten_layers"


def is_keras(model: Any) -> bool:
    """Whether ``model`` is a Keras (or tf_keras) object, by its classes' modules: nothing
    imported, whatever backend Keras runs on."""
    return any((c.__module__ or "").split(".")[0] in ("keras", "tf_keras")
               for c in type(model).__mro__)


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


#: Keras's lazy handle on TensorFlow (module, attribute) and the handle's memo of whether
#: TensorFlow can be imported (None: not asked yet). Keras's serialiser asks it for every
#: object of a config, to test whether the object is a TensorFlow one, and asking imports
#: TensorFlow: 3.4 s of a 3.6 s first call of a Keras model on the JAX backend here
LAZY_TENSORFLOW = ("keras.src.utils.module_utils", "tensorflow")
LAZY_MEMO = "_available"
_LOCK = threading.Lock()


def config(model: Any) -> Any:
    """``model.get_config()``, without importing TensorFlow where it is not imported yet: no
    object can be a TensorFlow one then, so Keras's handle answers "not available" for the
    read (its memo restored after). Where this Keras has no such handle, or TensorFlow is
    imported or was asked for already: the plain call."""
    lazy = getattr(sys.modules.get(LAZY_TENSORFLOW[0]), LAZY_TENSORFLOW[1], None) \
        if "tensorflow" not in sys.modules else None
    memo = vars(lazy) if lazy is not None and hasattr(lazy, "__dict__") else {}
    if memo.get(LAZY_MEMO, False) is not None:  # (another Keras, or asked already)
        return model.get_config()
    with _LOCK:
        memo[LAZY_MEMO] = False
        try:
            return model.get_config()
        finally:
            memo[LAZY_MEMO] = None


# -- the widened clone of a Keras model (float64, or float32 for a half-precision model; the
# TensorFlow backend's and the JAX backend's) ------------------------------------------------

#: Keras's half-precision compute dtypes (a layer's ``compute_dtype``, e.g. under the
#: "mixed_bfloat16" policy): such a model is differentiated through a float32 clone
HALF = ("float16", "bfloat16")


def computes_in_half(model: Any) -> bool:
    """Whether a layer of the Keras ``model`` computes in half precision (its policy)."""
    layers = flattened(model, include_self=True) or [model, *getattr(model, "layers", [])]
    return any(str(getattr(layer, "compute_dtype", "")) in HALF for layer in layers)


def clone_needed(model: Any, dtype: str) -> bool:
    """Whether the Keras ``model`` computes in ``dtype`` only as a clone (its widened copy):
    float64 asked of a model with weights of another float dtype, or any dtype asked of a
    model whose layers compute in half precision."""
    if computes_in_half(model):
        return True
    return dtype == "float64" and not all(
        str(w.dtype) == "float64" for w in model.weights if "float" in str(w.dtype))


def widen_config(cfg: Any, dtype: str = "float64") -> Any:
    """A Keras config with every dtype (layers' policies, Input layers, tensors) set to
    ``dtype``: Keras 2 and 3 name it ``dtype``, as a string or a serialised policy."""
    if isinstance(cfg, dict):
        out = {k: widen_config(v, dtype) for k, v in cfg.items()}
        if isinstance(out.get("dtype"), (str, dict)):
            out["dtype"] = dtype
        return out
    if isinstance(cfg, list):
        return [widen_config(v, dtype) for v in cfg]
    return cfg


def clone_from_config(keras: Any, model: Any, dtype: str = "float64") -> Any:
    """A new model from ``model``'s config, every dtype set to ``dtype``: Keras's
    serialisation where it has one that round-trips the model, else the class's
    ``from_config``."""
    saving: Any = getattr(keras, "saving", None)
    try:
        return saving.deserialize_keras_object(
            widen_config(saving.serialize_keras_object(model), dtype))
    except Exception:  # (no such serialisation, or one that does not round-trip this model)
        return type(model).from_config(widen_config(model.get_config(), dtype))


def _policy_api(keras: Any) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    for home, get, put in (("config", "dtype_policy", "set_dtype_policy"),
                           ("mixed_precision", "global_policy", "set_global_policy")):
        where = getattr(keras, home, None)
        getter, setter = getattr(where, get, None), getattr(where, put, None)
        if callable(getter) and callable(setter):
            return getter, setter
    return None


@contextlib.contextmanager
def dtype_policy(keras: Any, name: str) -> Iterator[None]:
    """Keras's global dtype policy set to ``name`` (what sublayers made in a subclass's
    ``__init__`` take): ``keras.config.set_dtype_policy``, or Keras 2's
    ``mixed_precision.set_global_policy``; nothing where neither exists (layers keep their
    own dtype, and the clone's weights are checked)."""
    api = _policy_api(keras)
    if api is None:
        yield
        return
    getter, setter = api
    old = getter()
    setter(name)
    try:
        yield
    finally:
        setter(old)


def float64_clone(keras: Any, model: Any, build: Callable[[Any], None], versions: str,
                  dtype: str = "float64") -> Any:
    """A clone of a Keras model in ``dtype`` (float64; float32 for a model that computes in
    half precision) with the same weights, or raise InputError.

    Rebuilt from its config with every dtype widened, so Input layers are widened too (a
    narrower Input would round the inputs before the first layer). ``build`` calls the clone
    once on a sample, which builds subclassed models. ``versions`` names the framework
    versions in the errors. Its weights are set from the model's once; a caller that reads
    the model's weights at each call (the JAX backend) gives them itself.
    """
    asked = (f"{dtype} was asked for (dtype='float64' or float64 inputs)" if dtype == "float64"
             else f"this Keras model computes in half precision (its dtype policy), and batchjac "
                  f"differentiates it in {dtype}")
    with dtype_policy(keras, dtype):  # sublayers made in a subclass's __init__
        try:
            clone = clone_from_config(keras, model, dtype)
            build(clone)
            clone.set_weights([np.asarray(w, dtype) if np.asarray(w).dtype.kind == "f" else w
                               for w in model.get_weights()])
        except Exception as e:
            raise InputError(
                f"{asked}, but this Keras model ({type(model).__name__}) could not be cloned in "
                f"{dtype} ({versions}): {type(e).__name__}: {e}. Build the model with "
                f"dtype='{dtype}', make it serialisable (get_config/from_config)"
                + (", or compute in float32 with dtype='float32'." if dtype == "float64" else ".")
            ) from e
    if any(str(w.dtype).startswith("float") and w.dtype != dtype for w in clone.weights):
        raise InputError(
            f"{asked}, but the {dtype} clone of {type(model).__name__} still has weights of "
            f"another float dtype (its layers pin their dtype; {versions}). "
            f"Build it with dtype='{dtype}'" + (" or use dtype='float32'." if dtype == "float64"
                                                 else ".")
        )
    narrow = [d for d in _input_dtypes(clone) if "float" in d and d != dtype]
    if narrow:  # (its Input layers would round the inputs before the first layer)
        raise InputError(
            f"{asked}, but the {dtype} clone of {type(model).__name__} still takes "
            f"{narrow[0]} inputs: this Keras's config of its Input layers was not widened "
            f"({versions}). Build it with dtype='{dtype}'"
            + (" or use dtype='float32'." if dtype == "float64" else ".")
        )
    return clone


def stateless_clone(keras: Any, model: Any, build: Callable[[Any], None], versions: str,
                    dtype: str) -> Any:
    """:func:`float64_clone` for a caller that runs the clone on the model's own variable
    values (``stateless_call`` with the model's values, read at each call: the JAX and
    PyTorch backends): the clone must hold variables of the same shapes, in the same order."""
    clone = float64_clone(keras, model, build, versions, dtype)
    shapes = [[tuple(v.shape) for v in m.trainable_variables] +
              [tuple(v.shape) for v in m.non_trainable_variables] for m in (model, clone)]
    if shapes[0] != shapes[1]:
        raise InputError(
            f"batchjac differentiates this Keras model in {dtype}, but the {dtype} clone of "
            f"{type(model).__name__} holds other variables than the model ({versions}). "
            f"Build the model with dtype='{dtype}'.")
    return clone


def _input_dtypes(model: Any) -> list[str]:
    """The dtypes of a Keras model's declared inputs (none for a subclassed model)."""
    try:
        inputs = list(getattr(model, "inputs", None) or [])
    except Exception:
        return []
    return [str(getattr(dtype, "name", dtype)) for dtype in
            (getattr(t, "dtype", None) for t in inputs) if dtype is not None]
