"""A cache for repeated calls with the same model, shapes and options.

The second and later ``jacobian`` calls on numpy arrays of the same shapes skip validation
of the call form, backend detection, binding and planning (about 100 us together, a tenth of
a 1,000-row seed workload): they check the inputs for NaN/Inf, cut the chunks and call the
already compiled kernel. Anything unusual (files, Dask, ``out=``, progress, explain, backend
options, non-numpy inputs) takes the full path.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._backends import BoundModel
from .._plan import Plan
from .._spec import BatchSpec

_MAX_ENTRIES = 64


@dataclass
class Entry:
    model: weakref.ReferenceType[Any] | None  # None when the model cannot be weakly referenced
    strong: Any
    bound: BoundModel
    plan: Plan
    template: BatchSpec
    backend: str
    #: the arrays are the kernel's arguments as they are: ``(unknown, known)`` in the concat
    #: layout (or ``x`` alone, all unknown), C-contiguous, in the compute dtype, and exactly
    #: one chunk of rows. Then a call skips cutting chunks, and the kernel gets them directly.
    direct: bool = False


_entries: OrderedDict[tuple[Any, ...], Entry] = OrderedDict()


def key(model: Any, inputs: tuple[Any, ...], options: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A hashable key for a plain call (one or two numpy arrays), else None."""
    if not 1 <= len(inputs) <= 2:
        return None
    shapes = []
    for a in inputs:
        if type(a) is not np.ndarray:
            return None
        shapes.append((a.shape, a.dtype.str))
    try:
        hash(options)
    except TypeError:
        return None
    return (id(model), type(model), tuple(shapes), options)


def lookup(k: tuple[Any, ...], model: Any) -> Entry | None:
    entry = _entries.get(k)
    if entry is None:
        return None
    alive = entry.model() if entry.model is not None else entry.strong
    if alive is not model:  # the id was reused by another object
        del _entries[k]
        return None
    return entry


def remember(k: tuple[Any, ...], model: Any, bound: BoundModel, plan: Plan, spec: BatchSpec,
             backend: str) -> None:
    try:
        ref: weakref.ReferenceType[Any] | None = weakref.ref(model)
        strong = None
    except TypeError:
        ref, strong = None, model
    lay = spec.layout
    direct = (plan.n_chunks == 1 and plan.chunk_size == spec.n
              and (lay.kind == "concat" or (lay.kind == "single" and lay.columns is None))
              and all(type(a) is np.ndarray and a.dtype == spec.dtype and a.flags.c_contiguous
                      for a in spec.arrays))
    _entries[k] = Entry(ref, strong, bound, plan, spec, backend, direct)
    _entries.move_to_end(k)
    while len(_entries) > _MAX_ENTRIES:
        _entries.popitem(last=False)


def forget(k: tuple[Any, ...] | None) -> None:
    if k is not None:
        _entries.pop(k, None)


def finite(inputs: tuple[np.ndarray, ...]) -> bool:
    """No NaN/Inf. ``isfinite().all()`` (vectorised in numpy 2) is exact and beat a float64
    sum at every size measured here: 5,000 float32 2.3 against 4.2 us, 2^20 79 against
    378 us, 2^23 float64 2.4 against 3.3 ms."""
    return all(a.dtype.kind != "f" or bool(np.isfinite(a).all()) for a in inputs)


def same_layout(entry: Entry, inputs: tuple[np.ndarray, ...]) -> bool:
    """For a ``direct`` entry: the arrays can be the kernel's ``(u, ctx)`` as they are (the
    key already matched shapes and dtypes; contiguity is not in it)."""
    return all(a.flags.c_contiguous for a in inputs)


def spec_for(entry: Entry, inputs: tuple[np.ndarray, ...]) -> BatchSpec | None:
    """The cached spec with these arrays, or None if a NaN/Inf check fails (the full path then
    raises the detailed error)."""
    t = entry.template
    if not finite(inputs):
        return None
    return BatchSpec(arrays=list(inputs), layout=t.layout, dtype=t.dtype, n=t.n,
                     unknown_shape=t.unknown_shape, names=t.names)
