"""Array namespaces: the few operations the pipeline does on input and result arrays, for numpy
(here) and for each framework's own arrays (in its backend module, the only place a framework
is imported).

The batch spec cuts chunks, the runner pads them and checks results through one of these, so
that torch tensors, JAX arrays and TensorFlow tensors can go through the same chunk iterator
as numpy arrays, on their device, without a copy to the host (see :mod:`batchjac._arrays`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

#: allocates a host array of a shape and dtype (:func:`batchjac._sinks.new_result`)
HostAlloc = Callable[[tuple[int, ...], np.dtype], np.ndarray]


class ArrayOps(Protocol):
    """What the pipeline needs of an array kind. Arrays are sliced by rows with ``a[lo:hi]``
    and sized with ``a.shape``, which every kind supports; the rest goes through here."""

    #: "numpy", or the name of the backend whose arrays these are ("torch", "jax", "tensorflow")
    kind: str

    def is_native(self, a: Any) -> bool:
        """Whether ``a`` is an array of this kind."""

    def dtype_of(self, a: Any) -> np.dtype:
        """``a``'s element type as a numpy dtype."""

    def device_of(self, a: Any) -> Any:
        """The device ``a`` lives on (None: the host, or the framework's default)."""

    def cast(self, a: Any, dtype: np.dtype) -> Any:
        """``a`` in ``dtype``, contiguous (no copy when it is both already)."""

    def contiguous(self, a: Any) -> Any:
        """``a`` contiguous, in its own dtype."""

    def take(self, a: Any, cols: tuple[int, ...]) -> Any:
        """The columns ``cols`` of ``a``'s last axis."""

    def pad_rows(self, a: Any, rows: int) -> Any:
        """``a`` padded to ``rows`` rows by repeating its last row."""

    def concat(self, parts: list[Any]) -> Any:
        """The parts joined along the first axis (the rows)."""

    def buffer(self, like: Any, shape: tuple[int, ...], host: HostAlloc) -> Any | None:
        """A new result of ``shape``, with ``like``'s dtype and on its device, that
        :meth:`write` fills chunk by chunk as the chunks come (one copy of each, while it is
        fresh in the caches, and no chunk kept after it is written); None where this kind's
        arrays cannot be written in place there (JAX arrays off the CPU, TensorFlow tensors):
        the chunks are then kept and joined once with :meth:`concat`. Where the device's
        memory is the host's (the CPU), it is taken from ``host(shape, dtype)``
        (:func:`batchjac._sinks.new_result`, as numpy results are)."""

    def write(self, buffer: Any, lo: int, a: Any) -> None:
        """``a`` into rows ``lo:lo + len(a)`` of a :meth:`buffer`."""

    def sealed(self, buffer: Any) -> Any:
        """A filled :meth:`buffer` as this kind's array (no copy)."""

    def all_finite(self, a: Any) -> bool:
        """No NaN or Inf in ``a`` (True for non-floating arrays)."""

    def any_nonzero(self, a: Any) -> bool:
        """Some entry of ``a`` is not zero."""

    def is_traced(self, a: Any) -> bool:
        """Whether ``a`` is a symbolic value inside a trace (a JAX tracer, a tensor of a
        ``tf.function``'s graph), whose numbers are not known yet."""

    def to_numpy(self, a: Any) -> np.ndarray:
        """``a`` on the host, as numpy (a copy where it lives on another device)."""

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        """A host array as this kind, on ``device`` (None: the framework's default)."""

    def to_device(self, a: Any, device: Any) -> Any:
        """``a`` on ``device`` (itself when it is there already)."""


class NumpyOps:
    """The host: numpy arrays (and the array-likes numpy reads: memmaps, lazy readers)."""

    kind = "numpy"

    def is_native(self, a: Any) -> bool:
        return isinstance(a, np.ndarray)

    def dtype_of(self, a: Any) -> np.dtype:
        return np.dtype(a.dtype)

    def device_of(self, a: Any) -> Any:
        return None

    def cast(self, a: Any, dtype: np.dtype) -> Any:
        return np.ascontiguousarray(a, dtype=dtype)

    def contiguous(self, a: Any) -> Any:
        return np.ascontiguousarray(a)

    def take(self, a: Any, cols: tuple[int, ...]) -> Any:
        return a[..., np.asarray(cols, dtype=np.intp)]

    def pad_rows(self, a: Any, rows: int) -> Any:
        return np.concatenate([a, np.repeat(a[-1:], rows - a.shape[0], axis=0)], axis=0)

    def concat(self, parts: list[Any]) -> Any:
        return np.concatenate(parts, axis=0)

    def buffer(self, like: Any, shape: tuple[int, ...], host: HostAlloc) -> Any | None:
        return host(shape, np.dtype(like.dtype))

    def write(self, buffer: Any, lo: int, a: Any) -> None:
        buffer[lo:lo + a.shape[0]] = a

    def sealed(self, buffer: Any) -> Any:
        return buffer

    def all_finite(self, a: Any) -> bool:
        return a.dtype.kind != "f" or bool(np.isfinite(a).all())

    def any_nonzero(self, a: Any) -> bool:
        return bool(np.any(a))

    def is_traced(self, a: Any) -> bool:
        return False

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        return a

    def to_device(self, a: Any, device: Any) -> Any:
        return a


NUMPY: ArrayOps = NumpyOps()
