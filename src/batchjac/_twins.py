"""Function objects that compute the same thing are one model.

The everyday JAX idiom, ``batchjac.jacobian(lambda z: model(z), u, h)`` in a loop, passes a
new function object per call. Its code is the same object each time, and so is everything it
reads besides its arguments (the captured cells, the defaults, the globals its code names):
the function computes exactly what the one bound before computes. :func:`canonical` returns
that earlier function (the "twin"), whose bound model already holds the probes, the tuning and
the compiled kernels; the new object is neither traced nor compiled.

Same means, for each thing the function reads (:func:`batchjac._closures.reads`): the same
object; or, for an immutable array (a ``jax.Array``, a TensorFlow ``EagerTensor``: no one can
change it later), equal by shape, dtype and content; or, for a nested plain function, a twin
by the same rule. A numpy array or a torch tensor with equal content but another identity is
not the same (it can be changed in place later, and the twin watches its own), nor is any
other value of another identity. A changed captured value therefore binds, traces and
compiles anew: never a stale Jacobian. In-place changes to a captured object are seen as for
the same function object called twice (each backend's check of what its trace baked in).
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ._closures import reads

#: codes remembered, and functions per code (a loop over captured values binds one per value)
MAX_CODES = 256
MAX_PER_CODE = 8
#: immutable arrays larger than this are compared by identity only (the comparison reads
#: them whole, per call)
MAX_COMPARED_BYTES = 16 << 20
#: nested functions compared this deep
MAX_DEPTH = 3

_table: OrderedDict[types.CodeType, list[weakref.ReferenceType[Any]]] = OrderedDict()
_lock = threading.Lock()  # (threads calling with new function objects at once)


def canonical(model: Any) -> Any:
    """``model``, or the live function bound before that computes the same thing (see the
    module's docstring). Anything but a plain function (or a ``functools.partial`` of one) is
    returned as it is."""
    fn = model.func if isinstance(model, functools.partial) else model
    if not isinstance(fn, types.FunctionType):
        return model
    with _lock:
        return _canonical(model, fn.__code__)


def _canonical(model: Any, code: types.CodeType) -> Any:
    refs = _table.get(code)
    if refs is None:
        refs = _table[code] = []
        while len(_table) > MAX_CODES:
            _table.popitem(last=False)
    _table.move_to_end(code)
    refs[:] = [ref for ref in refs if ref() is not None]
    for ref in refs:
        twin = ref()
        if twin is model:
            return model
        if twin is not None and same(twin, model):
            return twin
    try:
        refs.append(weakref.ref(model))
    except TypeError:  # (a partial of a class that forbids weak references)
        return model
    del refs[:-MAX_PER_CODE]
    return model


def same(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether functions (or partials) ``a`` and ``b`` compute the same thing by the rule of
    the module's docstring."""
    if isinstance(a, functools.partial) or isinstance(b, functools.partial):
        if not (isinstance(a, functools.partial) and isinstance(b, functools.partial)):
            return False
        return (_same_value(a.func, b.func, depth)
                and len(a.args) == len(b.args)
                and all(_same_value(x, y, depth) for x, y in zip(a.args, b.args))
                and a.keywords.keys() == b.keywords.keys()
                and all(_same_value(a.keywords[k], b.keywords[k], depth) for k in a.keywords))
    if not (isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType)):
        return False
    if a.__code__ is not b.__code__ or (a.__dict__ or b.__dict__):
        return False  # (attributes set on a function: a wrapper's state; not compared)
    for (what, _, _key, x), (_, _, _, y) in zip(reads(a), reads(b)):
        if what == "closure":
            continue  # (the cells' contents follow, one by one)
        if what in ("defaults", "kwdefaults"):
            if not _same_collection(x, y, depth):
                return False
        elif not _same_value(x, y, depth):
            return False
    return True


def _same_collection(x: Any, y: Any, depth: int) -> bool:
    if x is None or y is None:
        return x is y
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and \
            all(_same_value(x[k], y[k], depth) for k in x)
    return len(x) == len(y) and all(_same_value(p, q, depth) for p, q in zip(x, y))


def _same_value(x: Any, y: Any, depth: int) -> bool:
    if x is y:
        return True
    if type(x) is not type(y):
        return False
    if isinstance(x, (types.FunctionType, functools.partial)):
        return depth < MAX_DEPTH and same(x, y, depth + 1)
    if _immutable_array(x):
        return _equal_arrays(x, y)
    return False


def _immutable_array(obj: Any) -> bool:
    """A JAX array or a TensorFlow eager tensor, known by its type's module (no framework is
    imported here): values no one can change in place."""
    cls = type(obj)
    top = (cls.__module__ or "").split(".")[0]
    return (top in ("jax", "jaxlib") and hasattr(obj, "__array__") and hasattr(obj, "shape")) or \
        (top == "tensorflow" and cls.__name__ == "EagerTensor")


def _equal_arrays(x: Any, y: Any) -> bool:
    if tuple(x.shape) != tuple(y.shape) or str(x.dtype) != str(y.dtype):
        return False
    try:
        a, b = np.asarray(x), np.asarray(y)
    except Exception:  # (a tracer, an array on a device without a host copy, ...)
        return False
    if a.nbytes > MAX_COMPARED_BYTES:
        return False
    return a.tobytes() == b.tobytes()  # bitwise: the same constant, NaNs included


def forget() -> None:
    """Drop every function remembered (tests)."""
    _table.clear()
