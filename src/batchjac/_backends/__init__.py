"""Backend registry: framework name → module path, and the hint shown when it is missing.

Backends are imported only when a model needs them (einops' rule: "backends are not imported
unless those are actually needed"), so ``import batchjac`` works with no framework installed.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
import weakref
from typing import Any

from .. import _twins
from .._errors import BackendNotAvailableError, InputError
from ._base import (
    FIRST_VARIANT,
    UNTUNED,
    Backend,
    BoundModel,
    CallBudget,
    Kernel,
    LinearHead,
    Mode,
    Signature,
    asking,
    under,
)

__all__ = ["FIRST_VARIANT", "UNTUNED", "Backend", "BoundModel", "CallBudget", "Kernel",
           "LinearHead", "Mode", "Signature", "array_framework", "array_ops", "asking", "bind",
           "detect", "get_backend", "under"]

# name -> (module implementing it, framework module it needs, install hint)
REGISTRY: dict[str, tuple[str, str, str]] = {
    "tensorflow": ("batchjac._backends.tensorflow", "tensorflow",
                   "TensorFlow/Keras models need `pip install batchjac[tensorflow]`."),
    "torch": ("batchjac._backends.torch", "torch",
              "PyTorch models need `pip install batchjac[torch]`."),
    "jax": ("batchjac._backends.jax", "jax", "JAX functions need `pip install batchjac[jax]`."),
    # closed-form models in numpy (batchjac.ClosedForm): tests, and analytic models
    "numpy": ("batchjac._backends.numpy", "numpy", "numpy is always installed."),
}

# Module prefixes that identify a framework from a model's class hierarchy or globals.
_PREFIXES: dict[str, tuple[str, ...]] = {
    "tensorflow": ("tensorflow", "keras", "tf_keras"),
    "torch": ("torch",),
    "jax": ("jax", "jaxlib", "equinox", "flax", "haiku"),
}

_instances: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    if name not in REGISTRY:
        raise InputError(f"`backend` must be one of {sorted(REGISTRY)}; got {name!r}.")
    if name not in _instances:
        module, framework, hint = REGISTRY[name]
        try:
            importlib.import_module(framework)
        except ImportError as e:
            raise BackendNotAvailableError(f"{hint} (import {framework!r} failed: {e})") from None
        _instances[name] = importlib.import_module(module).BACKEND
    return _instances[name]


def array_ops(name: str) -> Any:
    """The array namespace (:class:`batchjac._xp.ArrayOps`) of backend ``name``'s arrays; its
    module is imported (and the framework with it) on first use."""
    if name == "numpy":
        from .._xp import NUMPY

        return NUMPY
    get_backend(name)  # the install hint when the framework is missing
    return importlib.import_module(REGISTRY[name][0]).OPS


#: the attribute by which TensorFlow's AutoGraph knows its own artifacts, which it calls as
#: they are instead of converting them (its ``is_autograph_artifact``): batchjac's verbs carry
#: it, so that a differentiable call inside the caller's ``tf.function`` runs batchjac's Python
#: unconverted, whichever of batchjac and TensorFlow was imported first (unconverted, then
#: converted anew on each first trace: seconds). Only a name, read by TensorFlow: nothing is
#: imported. (The backend, once loaded, also lists batchjac among the libraries AutoGraph does
#: not convert: tensorflow/compat.py, 13.)
AUTOGRAPH_ARTIFACT = "autograph_info__"


def not_converted(*functions: Any) -> None:
    """Mark batchjac's public ``functions`` as AutoGraph leaves them (see above)."""
    for fn in functions:
        setattr(fn, AUTOGRAPH_ARTIFACT, frozenset())


def graph_ops(name: str) -> Any:
    """The array namespace of a differentiable call (:mod:`batchjac._differentiable`): backend
    ``name``'s ``GRAPH_OPS`` where its :func:`array_ops` would cut the caller's graph (torch's
    detach), else those."""
    ops = array_ops(name)
    return getattr(importlib.import_module(REGISTRY[name][0]), "GRAPH_OPS", ops) \
        if name != "numpy" else ops


def array_framework(a: Any) -> str | None:
    """The framework whose array ``a`` is (by its type's module; imports nothing), or None."""
    return _framework_of_module(type(a).__module__ or "")


def _keras_backend() -> str | None:
    """The backend Keras 3 runs on, where it is loaded and says so ("jax", "torch" or
    "tensorflow"; a Keras model computes in that framework): read from the loaded module,
    nothing imported."""
    keras = sys.modules.get("keras")
    config = getattr(keras, "config", None)
    try:
        name = config.backend() if config is not None else None
    except Exception:  # (an old Keras without keras.config.backend: TensorFlow's)
        return None
    return name if name in ("jax", "torch", "tensorflow") else None


def _framework_of_module(modname: str) -> str | None:
    top = modname.split(".", 1)[0]
    for name, prefixes in _PREFIXES.items():
        if top in prefixes:
            return name
    return None


def detect(model: Any) -> str:
    """Name the backend for ``model`` from its type; for plain Python functions, from the
    framework modules and objects its code refers to. Imports nothing."""
    declared = getattr(type(model), "__batchjac_backend__", None)  # e.g. batchjac.ClosedForm
    if isinstance(declared, str) and declared in REGISTRY:
        return declared
    for cls in type(model).__mro__:
        found = _framework_of_module(cls.__module__ or "")
        if found:
            return _keras_backend() or found if cls.__module__.startswith("keras") else found
    found_set = _frameworks_referenced(model)
    if len(found_set) == 1:
        return found_set.pop()
    what = f"refers to {sorted(found_set)}" if found_set else "refers to no known framework"
    raise InputError(
        f"Cannot tell which framework {_describe(model)} uses (it {what}). Pass "
        f"backend='tensorflow', 'torch' or 'jax'."
    )


def _frameworks_referenced(fn: Any, depth: int = 0) -> set[str]:
    found: set[str] = set()
    target = getattr(fn, "__wrapped__", fn)
    if isinstance(target, types.MethodType):
        found |= _frameworks_referenced(target.__self__, depth + 1) if depth < 2 else set()
        target = target.__func__
    if hasattr(target, "func") and callable(target.func):  # functools.partial
        found |= _frameworks_referenced(target.func, depth + 1) if depth < 2 else set()
        for arg in (*getattr(target, "args", ()), *getattr(target, "keywords", {}).values()):
            found |= _frameworks_of_value(arg)
    code = getattr(target, "__code__", None)
    if code is None:
        return found | _frameworks_of_value(target)
    home = _framework_of_module(getattr(target, "__module__", None) or "")
    if home:  # a framework's own function (a Haiku apply, a jax.numpy function)
        return found | {home}
    glb = getattr(target, "__globals__", {})
    referenced = [glb[name] for name in code.co_names if name in glb]
    for cell in getattr(target, "__closure__", None) or ():
        try:
            referenced.append(cell.cell_contents)
        except ValueError:
            continue
    for value in referenced:  # (a global, as in a script's or a notebook's top level, or a cell)
        found |= _frameworks_of_value(value)
        if callable(value) and depth < 2 and not isinstance(value, (type, types.ModuleType)):
            found |= _frameworks_referenced(value, depth + 1)
    return found


def _frameworks_of_value(value: Any) -> set[str]:
    if isinstance(value, types.ModuleType):
        mod = value.__name__
    elif isinstance(value, (list, tuple, dict)):
        items = value.values() if isinstance(value, dict) else value
        out: set[str] = set()
        for v in list(items)[:16]:
            out |= _frameworks_of_value(v)
        return out
    else:
        mod = getattr(type(value), "__module__", "") or ""
        if mod == "builtins" or mod.startswith("numpy"):
            return set()
        if isinstance(value, types.FunctionType):
            mod = value.__module__ or ""
    found = _framework_of_module(mod)
    return {found} if found else set()


def _describe(model: Any) -> str:
    name = getattr(model, "__qualname__", None) or type(model).__qualname__
    return f"the model {name!r}"


# Bound models are cached per model object and signature, so probes and compilation happen
# once. Weak keys: the cache never keeps a model alive.
_bound: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], BoundModel]] = (
    weakref.WeakKeyDictionary()
)
_bound_strong: dict[int, tuple[Any, dict[tuple[Any, ...], BoundModel]]] = {}
#: threads binding one model at once must get one bound model: without the lock each built its
#: own (20 threads, one JAX function: each probed and compiled again, and the copies counted as
#: "new function objects with the same code", a false RebindWarning)
_bind_lock = threading.RLock()


#: function objects that share a twin's bound models now (see :func:`canonical`)
_sharing: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def canonical(model: Any) -> Any:
    """``model``, or the function bound before that computes the same (:mod:`batchjac._twins`),
    whose bound models ``model`` then shares. Asked at every call: a function that no longer
    computes what its twin does (its own captured variable rebound since) stops sharing, and
    is bound as itself."""
    twin = _twins.canonical(model)
    with _bind_lock:
        if twin is not model:
            _bound[model] = _bound.setdefault(twin, {})
            _sharing[model] = True
        else:
            try:
                shared = _sharing.pop(model, False)
            except TypeError:  # (not weak-referenceable: never shared)
                shared = False
            if shared:
                _bound.pop(model, None)
    return twin


def bind(backend: Backend, model: Any, signature: Signature, **options: Any) -> BoundModel:
    with _bind_lock:
        return _bind(backend, model, signature, **options)


def bind_differentiable(backend: Backend, model: Any, signature: Signature,
                        options: dict[str, Any]) -> BoundModel:
    """The bound model of a differentiable call (:mod:`batchjac._differentiable`): the cached
    one with its state refreshed, or a new one where the backend's may hold a trace's values
    (:attr:`Backend.caches_differentiable_binds`)."""
    if not backend.caches_differentiable_binds:
        return backend.bind(model, signature, **options)
    bound = bind(backend, model, signature, **options)
    bound.refresh()
    return bound


def _bind(backend: Backend, model: Any, signature: Signature, **options: Any) -> BoundModel:
    model = canonical(model)
    key = (backend.name, signature, backend.options_key(options))
    try:
        per_model = _bound.setdefault(model, {})
    except TypeError:  # not weak-referenceable: keep a bounded strong cache
        if id(model) not in _bound_strong:
            if len(_bound_strong) > 32:
                _bound_strong.pop(next(iter(_bound_strong)))
            _bound_strong[id(model)] = (model, {})
        per_model = _bound_strong[id(model)][1]
    if key not in per_model:
        per_model[key] = backend.bind(model, signature, **options)
    else:
        per_model[key].update(**options)
    return per_model[key]


