"""JAX arrays as the pipeline's arrays, on their device (:class:`JaxOps`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import compat


class JaxOps:
    """JAX arrays as the pipeline's arrays (:class:`batchjac._xp.ArrayOps`), on their device:
    what ``jacobian`` works with when JAX arrays go into a JAX model."""

    kind = "jax"

    def is_native(self, a: Any) -> bool:
        return isinstance(a, jax.Array)

    def dtype_of(self, a: Any) -> np.dtype:
        return np.dtype(a.dtype)

    def device_of(self, a: Any) -> Any:
        """The device of a committed array (the result is committed to it too); None for an
        uncommitted one, which JAX moves wherever it is used."""
        if not getattr(a, "committed", False):
            return None
        devices = a.devices()
        return next(iter(devices)) if len(devices) == 1 else None

    def cast(self, a: Any, dtype: np.dtype) -> Any:
        return a if a.dtype == dtype else a.astype(dtype)

    def contiguous(self, a: Any) -> Any:
        return a

    def take(self, a: Any, cols: tuple[int, ...]) -> Any:
        return jnp.take(a, jnp.asarray(cols), axis=-1)

    def pad_rows(self, a: Any, rows: int) -> Any:
        return jnp.concatenate([a, jnp.repeat(a[-1:], rows - a.shape[0], axis=0)])

    def concat(self, parts: list[Any]) -> Any:
        return jnp.concatenate(parts)

    def buffer(self, like: Any, shape: tuple[int, ...], host: Any) -> Any | None:
        """On the CPU, where a JAX array's memory is the host's: a numpy array (``host``'s)
        that becomes the JAX result without a copy (:meth:`sealed`). XLA's CPU concatenate of
        many chunks of a large result costs more than the chunking saves, where a numpy copy of
        each chunk as it comes costs a fraction of it (measured: docs/thresholds.md). Off the
        CPU, None: the chunks are joined on the device."""
        devices = like.devices()
        device = next(iter(devices))
        if len(devices) != 1 or device.platform != "cpu":
            return None
        return _HostBuffer(host(shape, np.dtype(like.dtype)), device)

    def write(self, buffer: Any, lo: int, a: Any) -> None:
        # a view of the CPU array's memory (DLPack never copies), copied once into the result
        buffer.array[lo:lo + a.shape[0]] = np.from_dlpack(a)

    def sealed(self, buffer: Any) -> Any:
        return buffer.seal()

    def all_finite(self, a: Any) -> bool:
        # one reduction, as TorchOps.all_finite (a finite sum proves every entry finite)
        return not jnp.issubdtype(a.dtype, jnp.floating) or bool(jnp.isfinite(jnp.sum(a))) or \
            bool(jnp.isfinite(a).all())

    def any_nonzero(self, a: Any) -> bool:
        return bool(jnp.any(a))

    def is_traced(self, a: Any) -> bool:
        # a tracer, or any array inside the caller's trace: jit stages every operation, on
        # concrete arrays too, whose results are then tracers (numbers known only later)
        return compat.is_tracer(a) or compat.is_tracer(jnp.zeros(()))

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        return jax.device_put(a, device) if device is not None else jnp.asarray(a)

    def to_device(self, a: Any, device: Any) -> Any:
        # committed to it: on the same device that shares the buffer (no copy)
        return a if a.committed and a.devices() == {device} else jax.device_put(a, device)


class _HostBuffer:
    """A result written on the host and handed to JAX as it is: ``jax.device_put`` of an
    array aligned to :data:`ALIGN` bytes onto a CPU device takes its memory, with no copy
    (PjRt's zero-copy host buffers; a misaligned one would be copied, a large result's whole
    size), and keeps the numpy array alive for as long as the JAX array lives. A large
    result (``batchjac._sinks.new_result``: a mapping) is page-aligned; a smaller one that
    is not aligned is allocated again, aligned, before anything is written into it."""

    ALIGN = 128

    def __init__(self, array: np.ndarray, device: Any) -> None:
        if array.ctypes.data % self.ALIGN:
            raw = np.empty(array.nbytes + self.ALIGN, np.uint8)
            start = -raw.ctypes.data % self.ALIGN
            array = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
        self.array: np.ndarray = array
        self.device = device

    def seal(self) -> Any:
        out = jax.device_put(self.array, self.device)
        self.array = np.empty(0, self.array.dtype)  # no writes into what JAX now holds
        return out
