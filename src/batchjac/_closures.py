"""What a plain Python function reads besides its arguments: its code, defaults, closure cells
and the globals its code (and the functions nested in it) names.

One walk for the two readers of a model's captured values: the computation fingerprint
(:mod:`batchjac._fingerprint`: what the tuning cache keys a decision by) and JAX's check of
the constants a trace baked in (:mod:`batchjac._backends.jax.staleness`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from typing import Any

#: a closure cell that holds nothing yet, a global the code names that does not exist (yet)
EMPTY = object()
MISSING = object()


def reads(fn: types.FunctionType) -> Iterator[tuple[str, Any, str, Any]]:
    """``(what, target, key, value)`` for each thing ``fn`` reads, where ``getattr(target,
    key)`` (``target[key]`` for a global: ``target`` is the function's globals) gives
    ``value`` now: its ``"code"``, ``"defaults"``, ``"kwdefaults"``, the tuple of its
    ``"closure"`` cells, each ``"cell"``'s contents (:data:`EMPTY` for an empty one) and each
    ``"global"`` its code names (:data:`MISSING` where there is none)."""
    yield "code", fn, "__code__", fn.__code__
    yield "defaults", fn, "__defaults__", fn.__defaults__
    yield "kwdefaults", fn, "__kwdefaults__", fn.__kwdefaults__
    cells = fn.__closure__
    yield "closure", fn, "__closure__", cells
    for cell in cells or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell has no contents
            value = EMPTY
        yield "cell", cell, "cell_contents", value
    glb = fn.__globals__
    for name in global_names(fn.__code__):
        yield "global", glb, name, glb.get(name, MISSING)


@functools.lru_cache(maxsize=1024)
def global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names ``code`` and the functions nested in it may look up as globals, sorted."""
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions and lambdas
        if isinstance(const, types.CodeType):
            names.update(global_names(const))
    return tuple(sorted(names))
