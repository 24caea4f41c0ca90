"""Fingerprints: a stable hash of what a model computes, and of files, for resumable stores.

A store may only be resumed by the same job, so it records a fingerprint of the model. For
models loaded from a file the command line uses the hash of the file's bytes. For model
objects :func:`model_fingerprint` hashes what determines their output, recognising objects by
duck typing (nothing here imports a framework):

- Keras models and layers: the architecture (``get_config()``, with layer names replaced by
  their position, since Keras numbers auto-named layers per process) and the weights;
- ``torch.nn.Module``: every submodule's class and code (TorchScript/FX code, or the bytecode of
  ``forward``), ``extra_repr()``, and the ``state_dict()`` (parameters and buffers);
- Python functions: bytecode, constants, defaults, closure cells and the globals they use,
  followed into ``functools.partial``, bound methods and ``__wrapped__`` (``jax.jit``,
  ``tf.function``); arrays anywhere (numpy, or tensors of any framework) by dtype, shape and
  bytes;
- other objects: their class and attributes.

:func:`computation_fingerprint` walks the same objects with the same rules, except that arrays
and tensors contribute their dtype and shape only: it identifies *what is computed* (the
architecture, dtypes, code), not the weights, so the tuning cache (:mod:`batchjac._tune.cache`)
can reuse a decision timed on a model for the same model retrained, reloaded, or rebuilt around
new parameters of the same shapes. The running time of a kernel depends on those, not on the
values of the weights. It also keys the probes' verdict (rows that do not interact), which a
later process trusts without probing: so it sees everything the forward pass reads, beyond what
:func:`model_fingerprint` hashes: every torch submodule's plain attributes (``self.mode``, the
``training`` flag, hooks by their functions and order, not their per-process handle ids) and
the global module hooks; for Keras layers of the user's classes their ``call`` code and the
attributes it names, and the config of the library's layers inside them.
:func:`model_fingerprint` is left as it was: stores on disk record it, and they also check the
model's outputs on probe inputs.

The hash is stable across processes (no ``id()``, no memory addresses). What it cannot see into
(compiled extension objects) it records by type only; the store also records the model's
outputs on fixed probe inputs, which catches a changed model even then.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import types
from typing import Any

import numpy as np

from ._closures import EMPTY, MISSING, global_names, reads
from ._keras_compat import config as keras_config, flattened

#: objects from these packages are referred to by name only (their code is not the user's model)
_LIBRARIES = ("numpy", "builtins", "jax", "jaxlib", "torch", "tensorflow", "keras", "tf_keras",
              "scipy", "math", "functools", "typing", "collections", "abc", "equinox", "flax",
              "haiku", "optax")
_MAX_DEPTH = 8


def model_fingerprint(model: Any) -> str:
    h = _Hasher()
    h.feed(model, 0)
    return "sha256:" + h.sha.hexdigest()


def computation_fingerprint(model: Any) -> str:
    """A hash of what ``model`` computes, blind to the values of its arrays (weights).

    Equal for the same architecture with other weights of the same shapes and dtypes; different
    when the architecture, a layer's size or activation, a dtype, or the Python code changes.
    Python scalars (a closed-over ``scale = 2.0``) still count by value: they are
    hyper-parameters more often than weights. No array is copied or moved off its device.

    >>> import numpy as np
    >>> def make(w):
    ...     return lambda x: np.tanh(x @ w)
    >>> computation_fingerprint(make(np.zeros((3, 2)))) == computation_fingerprint(make(np.ones((3, 2))))
    True
    >>> computation_fingerprint(make(np.zeros((3, 2)))) == computation_fingerprint(make(np.zeros((3, 4))))
    False
    """
    h = _Hasher(values=False)
    h.tag("computation")  # never equal to a model_fingerprint, even of an object without arrays
    h.feed(model, 0)
    return "sha256:" + h.sha.hexdigest()


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, or of a directory's files (relative paths and bytes, sorted)."""
    sha = hashlib.sha256()
    path = os.fspath(path)
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                sha.update(os.path.relpath(full, path).encode() + b"\0")
                _hash_file(sha, full)
    else:
        _hash_file(sha, path)
    return "sha256:" + sha.hexdigest()


def _hash_file(sha: Any, path: str) -> None:
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            sha.update(block)
    sha.update(b"\0")


def _top_module(obj: Any) -> str:
    return (getattr(type(obj), "__module__", "") or "").split(".", 1)[0]


def _in_mro(obj: Any, module_prefixes: tuple[str, ...], name: str | None = None) -> bool:
    for cls in type(obj).__mro__:
        mod = (cls.__module__ or "").split(".", 1)[0]
        if mod in module_prefixes and (name is None or cls.__name__ == name):
            return True
    return False


def as_array(obj: Any) -> np.ndarray | None:
    """numpy for numpy arrays and framework tensors/variables (by their methods), else None."""
    if isinstance(obj, (np.ndarray, np.generic)):
        return np.asarray(obj)
    if not (hasattr(obj, "shape") and hasattr(obj, "dtype")):
        return None
    try:
        if hasattr(obj, "detach") and hasattr(obj, "cpu"):  # torch
            return np.asarray(obj.detach().cpu().numpy())
        if hasattr(obj, "numpy") and callable(obj.numpy):  # tf.Tensor/Variable, keras.Variable
            return np.asarray(obj.numpy())
        if hasattr(obj, "__array__"):  # jax.Array and friends
            return np.asarray(obj)
    except Exception:
        return None
    return None


def _is_array_like(obj: Any) -> bool:
    """What :func:`as_array` would try to convert, decided without converting."""
    if isinstance(obj, (np.ndarray, np.generic)):
        return True
    if not (hasattr(obj, "shape") and hasattr(obj, "dtype")):
        return False
    return ((hasattr(obj, "detach") and hasattr(obj, "cpu"))
            or (hasattr(obj, "numpy") and callable(obj.numpy)) or hasattr(obj, "__array__"))


def _array_meta(obj: Any) -> tuple[str, tuple[int | None, ...] | None]:
    """(dtype, shape) of an array or tensor of any framework, read from its attributes.

    Unknown dimensions (symbolic TensorFlow shapes) are None; a shape of unknown rank is None.
    """
    shape: list[int | None] = []
    try:
        for dim in obj.shape:
            dim = getattr(dim, "value", dim)  # a TensorFlow 1-style Dimension
            shape.append(None if dim is None else int(dim))
    except (TypeError, ValueError):  # a TensorFlow shape of unknown rank
        return _dtype_text(obj.dtype), None
    return _dtype_text(obj.dtype), tuple(shape)


def _dtype_text(dtype: Any) -> str:
    """A dtype spelled as numpy spells it (``"<f4"``) when numpy knows it, so that
    ``torch.float32``, ``tf.float32`` and a Keras variable's ``"float32"`` read alike; other
    dtypes by name. Extension dtypes (``bfloat16`` of ml_dtypes, which numpy calls ``"<V2"``)
    by name too, so that the text does not depend on whether ml_dtypes is imported."""
    if not isinstance(dtype, np.dtype):
        name = getattr(dtype, "name", None)
        name = (name if isinstance(name, str) else str(dtype)).removeprefix("torch.")
        try:
            dtype = np.dtype(name)
        except (TypeError, ValueError):
            return name
    return dtype.name if dtype.kind == "V" else dtype.str


class _Hasher:
    """Feeds an object graph into a sha256, by the rules of the module docstring.

    ``values=False`` makes arrays and tensors feed their dtype and shape only (see
    :func:`computation_fingerprint`); everything else is walked the same way.
    """

    def __init__(self, *, values: bool = True) -> None:
        self.values = values
        self.sha = hashlib.sha256()
        self.seen: dict[int, int] = {}
        self._keep: list[Any] = []  # keeps visited objects alive, so their ids stay unique

    def tag(self, *parts: Any) -> None:
        for p in parts:
            self.sha.update(str(p).encode())
            self.sha.update(b"\x1f")

    def feed(self, obj: Any, depth: int) -> None:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            self.tag(type(obj).__name__, repr(obj))
            return
        if not self.values:
            if _is_array_like(obj):
                self.tag("array", *_array_meta(obj))
                return
            arr = None
        else:
            arr = as_array(obj)
        if arr is not None:
            arr = np.ascontiguousarray(arr)
            self.tag("array", arr.dtype.str, arr.shape)
            self.sha.update(arr.view(np.uint8).reshape(-1).data if arr.size else b"")
            return
        if depth > _MAX_DEPTH:
            self.tag("deep", _qualname(type(obj)))
            return
        if id(obj) in self.seen:  # cycles and shared objects: refer to the first visit
            self.tag("ref", self.seen[id(obj)])
            return
        self.seen[id(obj)] = len(self.seen)
        self._keep.append(obj)
        if isinstance(obj, types.ModuleType):
            self.tag("module", obj.__name__)
        elif isinstance(obj, type):
            self.tag("class", _qualname(obj))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
            self.tag(type(obj).__name__, len(items))
            for item in items:
                self.feed(item, depth + 1)
        elif isinstance(obj, dict):
            self.tag("dict", len(obj))
            for key in sorted(obj, key=repr):
                self.feed(key, depth + 1)
                self.feed(obj[key], depth + 1)
        elif _in_mro(obj, ("keras", "tf_keras")) and hasattr(obj, "get_weights"):
            self._keras(obj, depth)
        elif _in_mro(obj, ("torch",), "Module") and hasattr(obj, "state_dict"):
            self._torch(obj, depth)
        elif isinstance(obj, types.CodeType):
            self._code(obj, depth)
        elif isinstance(obj, (types.FunctionType, types.LambdaType)):
            self._function(obj, depth)
        elif isinstance(obj, types.MethodType):
            self.tag("method")
            self.feed(obj.__func__, depth + 1)
            self.feed(obj.__self__, depth + 1)
        elif isinstance(obj, functools.partial):
            self.tag("partial")
            self.feed(obj.func, depth + 1)
            self.feed(obj.args, depth + 1)
            self.feed(obj.keywords, depth + 1)
        elif hasattr(obj, "python_function") and callable(obj.python_function):  # tf.function
            self.tag("tf.function")
            self.feed(obj.python_function, depth + 1)
        elif getattr(obj, "__wrapped__", None) is not None and not isinstance(obj.__wrapped__, type):
            self.tag("wrapper", _qualname(type(obj)))  # jax.jit, functools.wraps
            self.feed(obj.__wrapped__, depth + 1)
        elif _top_module(obj) in _LIBRARIES and not callable(obj):
            self.tag("object", _qualname(type(obj)), _safe_repr(obj))
        else:
            self._object(obj, depth)

    # -- kinds -----------------------------------------------------------------------------
    def _keras(self, model: Any, depth: int) -> None:
        self.tag("keras", _qualname(type(model)))
        configured = False
        try:
            config = keras_config(model)
            names = _canonical_names(config, skip_policies=not self.values)
            text = json.dumps(names, sort_keys=True, default=_type_only)
            self.tag("config", text)
            configured = True
        except Exception:  # subclassed models without get_config: their code instead
            call = getattr(type(model), "call", None)
            if call is not None:
                self.feed(call, depth + 1)
        if not self.values:
            self._keras_layers(model, depth, whole=configured and _is_library_class(type(model)))
        if self.values:
            for w in model.get_weights():
                self.feed(np.asarray(w), depth + 1)
        else:  # the variables themselves: no copy of their values
            for w in getattr(model, "weights", None) or model.get_weights():
                self.feed(w, depth + 1)

    def _torch(self, module: Any, depth: int) -> None:
        self.tag("torch", _qualname(type(module)))
        for name, sub in module.named_modules():
            self.tag("submodule", name, _qualname(type(sub)))
            code = getattr(sub, "code", None)  # TorchScript and torch.fx GraphModule
            if isinstance(code, str):
                self.tag("code", code)
            else:
                forward = getattr(type(sub), "forward", None)
                if isinstance(forward, types.FunctionType) and not _is_library(forward):
                    self.feed(forward, depth + 1)
            with contextlib.suppress(Exception):
                self.tag("extra", sub.extra_repr())
            if not self.values:
                self._torch_attributes(sub, depth)
        if not self.values:
            hooks = getattr(sys.modules.get("torch.nn.modules.module"), "__dict__", {})
            self.tag("global hooks")
            self.feed(_hook_state({k: v for k, v in hooks.items() if k.startswith("_global_")
                                   and "hook" in k and isinstance(v, dict)}), depth + 1)
        state = module.state_dict()
        for key in sorted(state):
            self.tag("state", key)
            self.feed(state[key], depth + 1)

    def _keras_layers(self, model: Any, depth: int, *, whole: bool) -> None:
        """What a Keras model's config may not show: for every layer of a class of the user's
        (the model itself included) its ``call`` code and the attributes its code names
        (``self.mode``); for the library's layers their config, unless ``whole`` (a Sequential
        or functional model's config covers its layers). Keras's own attributes (auto names,
        build state, trackers) are left out: they differ between processes."""
        layers = flattened(model, include_self=True) or [model]
        position = {id(layer): i for i, layer in enumerate(layers)}
        for layer in layers:
            cls = type(layer)
            if _is_library_class(cls):
                if not whole:
                    with contextlib.suppress(Exception):
                        names = _canonical_names(keras_config(layer), skip_policies=True)
                        self.tag("layer", _qualname(cls),
                                 json.dumps(names, sort_keys=True, default=_type_only))
                continue
            self.tag("user layer", _qualname(cls))
            call = getattr(cls, "call", None)
            if isinstance(call, types.FunctionType) and not _is_library(call):
                self.feed(call, depth + 1)
            attributes = vars(layer) if hasattr(layer, "__dict__") else {}
            for name in _names_in_code(cls):
                if name in attributes:
                    value = attributes[name]
                    self.tag("attribute", name)
                    if id(value) in position:  # another layer of the walk: by its place
                        self.tag("layer at", position[id(value)])
                    else:
                        self.feed(value, depth + 1)

    def _torch_attributes(self, sub: Any, depth: int) -> None:
        """A submodule's plain attributes (``self.mode = "center"``, ``training``, hooks): its
        forward reads them. Parameters, buffers and submodules are hashed already."""
        state = {k: v for k, v in vars(sub).items() if k not in _TORCH_CONTAINERS}
        self.tag("attributes")
        self.feed(_hook_state(state), depth + 1)

    def _function(self, fn: Any, depth: int) -> None:
        self.tag("function", fn.__module__, fn.__qualname__)
        if _is_library(fn):
            return
        for what, _, key, value in reads(fn):
            if what == "code":
                self._code(value, depth)
            elif what == "cell":
                self.feed(None if value is EMPTY else value, depth + 1)
            elif what == "global":
                if value is not MISSING:
                    self.tag("global", key)
                    self.feed(value, depth + 1)
            elif what != "closure":  # (the defaults)
                self.feed(value, depth + 1)

    def _code(self, code: types.CodeType, depth: int) -> None:
        self.tag("code", code.co_name, code.co_argcount, code.co_kwonlyargcount)
        self.sha.update(code.co_code)
        self.tag(code.co_names, code.co_varnames)
        for const in code.co_consts:
            self.feed(const, depth + 1)

    def _object(self, obj: Any, depth: int) -> None:
        cls = type(obj)
        self.tag("object", _qualname(cls))
        call = vars(cls).get("__call__") or next(
            (vars(c)["__call__"] for c in cls.__mro__ if "__call__" in vars(c)), None)
        if isinstance(call, types.FunctionType) and not _is_library(call):
            self.feed(call, depth + 1)
        state: dict[str, Any] = {}
        if hasattr(obj, "__dict__"):
            state.update(vars(obj))
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                state[slot] = getattr(obj, slot)
        if state:
            self.feed(state, depth + 1)


#: a torch module's own containers, hashed by :meth:`_Hasher._torch` through state_dict() and
#: named_modules()
_TORCH_CONTAINERS = frozenset({"_parameters", "_buffers", "_modules", "_torchdynamo_wrapper_id"})


def _hook_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with torch's hook dicts (``_forward_hooks``, ``_forward_hooks_with_kwargs``,
    ...: keyed by handle ids, a per-process counter) keyed by each id's rank among the hook ids
    of ``state`` instead, so the same hooks registered in the same order hash alike in every
    process, and a flag dict still names the hook it flags."""
    hook_dicts = [k for k, v in state.items() if "hook" in k and isinstance(v, dict) and v
                  and all(isinstance(i, int) and not isinstance(i, bool) for i in v)]
    ranks = {i: r for r, i in enumerate(sorted({i for k in hook_dicts for i in state[k]}))}
    return {**state, **{k: [(ranks[i], v) for i, v in state[k].items()] for k in hook_dicts}}


def _is_library_class(cls: type) -> bool:
    return (cls.__module__ or "").split(".", 1)[0] in _LIBRARIES


def _names_in_code(cls: type) -> list[str]:
    """Every name the code of ``cls``'s own classes (those of its MRO outside the libraries)
    refers to: the attributes its methods and properties may read."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if _is_library_class(klass):
            continue
        for member in vars(klass).values():
            for fn in ((member.fget, member.fset) if isinstance(member, property)
                       else (getattr(member, "__func__", member),)):
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType):
                    names.update(global_names(code))
    return sorted(names)


def _is_library(fn: Any) -> bool:
    return (getattr(fn, "__module__", "") or "").split(".", 1)[0] in _LIBRARIES


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _type_only(obj: Any) -> str:
    return f"<{_qualname(type(obj))}>"


def _safe_repr(obj: Any) -> str:
    text = repr(obj)
    return "" if " at 0x" in text else text[:200]


def _canonical_names(config: Any, *, skip_policies: bool = False) -> Any:
    """A Keras config with the names of its layers replaced by their order of appearance.

    A dtype policy is a ``{"class_name": "DTypePolicy", "config": {"name": "float32"}}`` node:
    its "name" is a dtype, not a layer's name. Taken for a layer's name, it becomes
    ``"<layer N>"``, and so does every string equal to it, such as an ``InputLayer``'s dtype:
    ``"float32"``, ``"float64"`` and ``"mixed_float16"`` then read alike. ``skip_policies=True``
    leaves policies out of the names; :func:`computation_fingerprint` passes it, since a dtype is
    all it sees of the weights. :func:`model_fingerprint` keeps the old reading, so that the
    fingerprints recorded in existing stores stay valid (it sees the dtype in the weights'
    bytes and the store checks outputs on probe inputs).
    """
    names: dict[str, str] = {}

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            is_policy = str(node.get("class_name", "")).endswith(("Policy", "PolicyMap"))
            if ("class_name" in node and isinstance(node.get("config"), dict)
                    and not (skip_policies and is_policy)):
                for name in (node["config"].get("name"), node.get("name")):
                    if isinstance(name, str) and name not in names:
                        names[name] = f"<layer {len(names)}>"
            for value in node.values():
                collect(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                collect(value)

    def replace(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: replace(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [replace(v) for v in node]
        if isinstance(node, str):
            return names.get(node, node)
        return node

    if isinstance(config, dict) and isinstance(config.get("name"), str):
        names[config["name"]] = "<model>"
    collect(config)
    return replace(config)
