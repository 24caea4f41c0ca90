"""The values a traced JAX function bakes in, and whether they changed since.

``jax.jit`` bakes the arrays a plain function closes over into its trace as constants.
:func:`_captured_values` finds them (closure cells, referenced globals, defaults, partial
arguments, callable objects' attributes) and :class:`_Sites` remembers where each was read,
so that :meth:`batchjac._backends.jax.JaxBound.refresh` can tell, in a few microseconds, that
none was rebound or (numpy arrays) changed in place, or else trace the kernels again.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import numpy as np

from ..._closures import EMPTY, MISSING, reads

_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_MAX_VISITS = 2000
#: items of one dict, list or tuple the walk reads (the first ones)
_MAX_ITEMS = 256
#: hops through functions and objects (closure cells, globals, attributes) the walk of
#: :func:`_captured_values` follows; dicts, lists and tuples cost none
_MAX_HOPS = 4
#: nested containers and hops together, at most (Python's recursion stays bounded)
_MAX_NESTING = 64


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


class _Sites:
    """Where :func:`_captured_values` found each value: (container, key, value) triples and
    container sizes. Re-reading them (:meth:`unchanged`, a few microseconds) tells whether a
    new walk could find anything else: the walk follows the same keys, so if every key holds
    the same object and no walked container changed size, it would find the same values.
    A numpy array is the same object after an in-place change (``W *= 0.9``), which jax.jit,
    having baked its old values in, would not see: each writeable one found is kept with a
    checksum of its contents (:func:`_contents`, CRC-32: ~1 ms a MB), compared too."""

    _MISSING = MISSING

    def __init__(self) -> None:
        self.reads: list[tuple[Any, Any, Any]] = []  # (getter target, key, value)
        self.sizes: list[tuple[Any, int]] = []
        self.arrays: list[tuple[np.ndarray, int]] = []  # (a writeable numpy array, checksum)
        #: what the walk left unread at one of its limits (the first such place), or ""
        self.cut = ""

    def cut_at(self, what: str) -> None:
        self.cut = self.cut or what

    def found(self, value: Any) -> None:
        if isinstance(value, np.ndarray) and value.flags.writeable:
            self.arrays.append((value, _contents(value)))

    def contents(self) -> list[tuple[int, int]]:
        return [(id(a), c) for a, c in self.arrays]

    def read(self, target: Any, key: Any, value: Any) -> Any:
        self.reads.append((target, key, value))
        return value

    def unchanged(self) -> bool:
        try:
            return self._unchanged()
        except Exception:  # a place that cannot be read again: walk again
            return False

    def _unchanged(self) -> bool:
        missing = self._MISSING
        for target, key, value in self.reads:
            if isinstance(key, str) and not isinstance(target, dict):
                try:  # function attributes, cell contents
                    now = getattr(target, key, missing)
                except ValueError:  # a cell emptied since
                    return False
            elif isinstance(target, dict):
                now = target.get(key, missing)  # a global may be missing, and stay so
            else:
                try:
                    now = target[key]
                except (IndexError, TypeError):
                    return False
            if now is not value and not (isinstance(value, _SCALARS) and type(now) is type(value)
                                         and now == value):
                return False
        return all(len(c) == n for c, n in self.sizes) and \
            all(_contents(a) == c for a, c in self.arrays)


def _contents(a: np.ndarray) -> int:
    """A checksum of a numpy array's values (its bytes, read in place where contiguous)."""
    import zlib

    if a.dtype.hasobject:  # (no bytes to read: its identity only)
        return 0
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data)


def _captured_values(fn: Any, sites: _Sites | None = None) -> list[Any]:
    """Arrays ``fn`` reads from closures, referenced globals, defaults, partial arguments and
    callable objects' attributes, and the plain scalars among its closure cells, globals and
    defaults: the values jax.jit bakes into a trace. ``sites`` collects where each was read
    (see :class:`_Sites`).

    Dicts, lists and tuples are walked to any depth (a Flax-style ``params["params"]
    ["Encoder_0"]["Dense_0"]["kernel"]``); what is limited is the number of hops through
    functions and objects (:data:`_MAX_HOPS`: a model object, its list of layer objects, their
    weights is two), and the objects visited in all (:data:`_MAX_VISITS`)."""
    found: list[Any] = []
    seen: set[int] = set()
    log = sites if sites is not None else _Sites()

    def visit(obj: Any, hops: int, scalars: bool, nested: int = 0) -> None:
        if _is_array(obj) or isinstance(obj, _SCALARS):
            if _is_array(obj) or scalars:
                found.append(obj)
                log.found(obj)
            return
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            return
        if len(seen) > _MAX_VISITS:
            log.cut_at(f"more than {_MAX_VISITS:,} objects")
            return
        if nested > _MAX_NESTING:
            log.cut_at(f"containers or objects nested more than {_MAX_NESTING} deep")
            return
        if isinstance(obj, (dict, list, tuple)):
            seen.add(id(obj))
            log.sizes.append((obj, len(obj)))
            if len(obj) > _MAX_ITEMS:
                log.cut_at(f"a {type(obj).__name__} of {len(obj):,} items (the first "
                           f"{_MAX_ITEMS} are watched)")
            keys = list(obj)[:_MAX_ITEMS] if isinstance(obj, dict) \
                else range(min(len(obj), _MAX_ITEMS))
            for key in keys:
                visit(log.read(obj, key, obj[key]), hops, scalars, nested + 1)
            return
        if hops >= _MAX_HOPS:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            for what, target, key, value in reads(obj):
                if value is EMPTY:  # an empty cell holds nothing (and cannot be read again)
                    continue
                log.read(target, key, value)
                if what in ("code", "closure") or value is MISSING:
                    continue  # (the code's globals and the cells come one by one)
                if what in ("defaults", "kwdefaults"):
                    value = value or ()  # (none)
                visit(value, hops + 1, True, nested + 1)
        elif isinstance(obj, types.MethodType):
            visit(obj.__self__, hops + 1, False, nested + 1)
            visit(obj.__func__, hops + 1, False, nested + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, hops + 1, False, nested + 1)
            visit(obj.args, hops + 1, True, nested + 1)
            visit(obj.keywords, hops + 1, True, nested + 1)
        elif hasattr(obj, "__dict__"):  # a callable object or a container of weights
            # arrays only: other attributes may be counters
            visit(vars(obj), hops + 1, False, nested + 1)

    try:
        visit(fn, 0, False)
    except Exception as e:  # an object that cannot be read as plain ones are: unwatched
        log.cut_at(f"an object the walk could not read ({type(e).__name__}: {e})"[:200])
    return found


def _same_values(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if isinstance(x, _SCALARS) and type(x) is type(y) and x == y:
            continue
        return False
    return True
