"""Results in the caller's array kind, on the caller's device.

The rule (the array-API convention, as ``torch.func`` and ``jax`` follow it): the result has
the kind and the device of the inputs. ``output=`` overrides the kind.

- **Native**: the inputs are the model's own framework's arrays (torch tensors into a torch
  model, JAX arrays into a JAX function, TensorFlow tensors into a Keras model), or
  ``output=`` names that framework. The arrays stay on their device from end to end: the
  batch spec slices, casts and pads them there (:mod:`batchjac._xp`), the kernels take them and
  return the framework's arrays, NaN/Inf and all-zero checks are reductions there, and chunk
  results are written as they come into one result there (:class:`ChunkSink`: a torch
  tensor, or on the CPU the host memory a JAX array takes without a copy; elsewhere joined
  with one ``jnp.concatenate``/``tf.concat``; one chunk is returned as the kernel made it).
  Nothing is copied to the host but the few rows the one-off probes read.
- **Mixed** (a torch tensor into a JAX model, or ``output=`` a kind other than the model's
  framework's): the inputs are converted once to numpy, computed as numpy inputs are, and the
  result converted once to the asked kind, onto the input's device when the input was of that
  kind (else the framework's default device).
- ``output="numpy"`` (and every numpy, list, table or file input) gives numpy, as before;
  ``out=`` (an array or a store) takes host chunks and is what it is.

Inputs of two different frameworks in one call are refused: there is no one device to give
the result back on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._backends import array_framework, array_ops, get_backend
from ._errors import InputError
from ._sinks import ArraySink, new_result
from ._spec import BatchSpec
from ._xp import ArrayOps

OutputArg = Literal["auto", "numpy", "torch", "jax", "tensorflow"]
OUTPUTS = ("auto", "numpy", "torch", "jax", "tensorflow")


@dataclass(frozen=True)
class Delivery:
    """Where a call's result goes: its ``kind`` and ``device`` (None: the framework's default),
    and whether it is computed ``native``ly (see the module's docstring)."""

    kind: str
    device: Any = None
    native: bool = False

    @property
    def xp(self) -> ArrayOps:
        return array_ops(self.kind if self.native else "numpy")


HOST = Delivery("numpy")


def ops_of(a: Any) -> ArrayOps:
    """The namespace of ``a``'s kind (numpy for anything not a framework's array)."""
    return array_ops(array_framework(a) or "numpy")


def kind_of(a: Any) -> str:
    """ "numpy", or the framework whose array ``a`` is (a torch tensor, a JAX array, a
    TensorFlow tensor); tables, lists and files read as numpy."""
    found = array_framework(a)
    return found if found is not None and hasattr(a, "shape") else "numpy"


def _leaves(inputs: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, Mapping):
            out.extend(x.values())
        elif isinstance(x, (tuple, list)) and x and all(hasattr(e, "shape") for e in x):
            out.extend(x)
        else:
            out.append(x)
    return out


def resolve(inputs: tuple[Any, ...], output: Any, backend: Callable[[], str], *,
            out: Any = None) -> Delivery:
    """The :class:`Delivery` of a call with these inputs and ``output=``; ``backend()`` names
    the model's backend (asked only when the result is not numpy)."""
    if not isinstance(output, str) or output not in OUTPUTS:
        raise InputError(f"`output` must be one of {list(OUTPUTS)} (\"auto\": the kind of the "
                         f"inputs); got {output!r}.")
    if out is not None:
        if output not in ("auto", "numpy"):
            raise InputError(f"`output={output!r}` cannot be combined with `out=`: results "
                             f"written into `out` are host arrays. Drop one of them.")
        return HOST
    leaves = _leaves(inputs)
    kinds = {kind: a for a in reversed(leaves) if (kind := kind_of(a)) != "numpy"}
    if len(kinds) > 1:
        raise InputError(
            f"The inputs mix arrays of {sorted(kinds)}; give them as one kind (the result comes "
            f"back as that kind, on that device), e.g. convert the others with "
            f"torch.as_tensor / jnp.asarray / tf.convert_to_tensor, or numpy.")
    given = next(iter(kinds), "numpy")
    kind = given if output == "auto" else output
    if kind == "numpy":
        return HOST
    xp = array_ops(kind)  # (the install hint when that framework is missing)
    device = xp.device_of(kinds[kind]) if kind in kinds else None
    return Delivery(kind, device, native=kind == backend())


def on_host(inputs: tuple[Any, ...], output: Any, *, out: Any = None) -> Delivery:
    """The :class:`Delivery` of a verb whose algebra runs on the host (``solve``'s iterations,
    ``propagate``'s covariances): the kind and device of its inputs (or ``output=``'s), never
    computed natively. Its inputs are read to the host once (:func:`batchjac._validate.
    to_numpy`), and :func:`deliver` hands its result arrays back once."""
    found = resolve(inputs, output, lambda: "", out=out)
    return Delivery(found.kind, found.device)


def like(result: Any, template: Any) -> Any:
    """``result`` (host arrays, or a tuple of them) in the kind and on the device of
    ``template`` (any array: numpy gives numpy)."""
    kind = kind_of(template)
    if kind == "numpy":
        return result
    return deliver(result, Delivery(kind, array_ops(kind).device_of(template)))


def native_options(delivery: Delivery, backend: str, model: Any, options: dict[str, Any]
                    ) -> dict[str, Any]:
    """The backend options of a native call: the backend's say on the inputs' device (torch: a
    plain function computes where its input tensors are)."""
    if not delivery.native or delivery.device is None:
        return options
    return get_backend(backend).device_options(model, delivery.device, options)


def deliver(result: Any, delivery: Delivery) -> Any:
    """``result`` (an array, or a tuple ``(y, J)``) as ``delivery`` says: the kind's arrays on
    its device. Arrays of that kind already there are returned as they are."""
    if delivery.kind == "numpy":
        return result
    xp = array_ops(delivery.kind)

    def one(a: Any) -> Any:
        if xp.is_native(a):
            return a if delivery.device is None else xp.to_device(a, delivery.device)
        return xp.from_numpy(np.asarray(a), delivery.device)

    return tuple(one(a) for a in result) if isinstance(result, tuple) else one(result)


class ChunkSink:
    """Named chunk results of a framework's arrays, on their device: written as they come into
    one new result per name (``xp.buffer``: a torch tensor; on the CPU, the host memory a JAX
    array is made of), or, where the kind has no such buffer, kept and joined along the rows
    by :meth:`finish` (one ``concat``). A chunk of all the rows is returned as it is."""

    def __init__(self, xp: ArrayOps, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.xp = xp
        self.shapes = dict(shapes)
        self.parts: dict[str, list[Any]] = {name: [] for name in shapes}
        self.buffers: dict[str, Any] = {}

    def write(self, lo: int, hi: int, results: Mapping[str, Any]) -> None:
        for name, parts in self.parts.items():
            a = results[name]
            if name not in self.buffers and not parts and hi - lo < self.shapes[name][0]:
                self.buffers[name] = self.xp.buffer(a, self.shapes[name], new_result)
            buffer = self.buffers.get(name)
            if buffer is None:
                parts.append(a)
            else:
                self.xp.write(buffer, lo, a)

    def finish(self, name: str) -> Any:
        buffer = self.buffers.get(name)
        if buffer is not None:
            return self.xp.sealed(buffer)
        parts = self.parts[name]
        return parts[0] if len(parts) == 1 else self.xp.concat(parts)


def named_results(spec: BatchSpec, shapes: Mapping[str, tuple[int, ...]],
                  given: Mapping[str, Any] | None = None) -> tuple[Any, Callable[[], dict[str, Any]]]:
    """Where the chunks of a verb's named in-memory results go, and how to read them from
    there: ``(sink, finish)`` with ``finish() -> {name: whole result}``. ``shapes``: each kept
    result's shape for the whole batch; ``given``: arrays to fill for some of them (``out=``).
    Numpy: written into those or new arrays (:func:`batchjac._sinks.new_result`); a
    framework's arrays: kept on the device, written into one result there or joined
    (:class:`ChunkSink`). Every
    in-memory verb (Jacobians, Hessians and their reductions) goes through here."""
    if spec.xp.kind != "numpy":
        chunks = ChunkSink(spec.xp, shapes)
        return chunks, lambda: {name: chunks.finish(name) for name in shapes}
    targets = {name: (given or {}).get(name) for name in shapes}
    targets = {name: t if t is not None else new_result(shapes[name], spec.dtype)
               for name, t in targets.items()}
    return ArraySink(targets), lambda: targets


def in_memory(spec: BatchSpec, y_shape: tuple[int, ...], j_shape: tuple[int, ...], out: Any,
              with_outputs: bool) -> tuple[Any, Any]:
    """:func:`named_results` of a Jacobian call: ``(sink, finish)`` with ``finish() -> (y or
    None, J)``; ``out`` receives the Jacobians."""
    shapes = {"jacobians": j_shape, **({"outputs": y_shape} if with_outputs else {})}
    sink, finish = named_results(spec, shapes, {"jacobians": out})

    def pair() -> tuple[Any, Any]:
        done = finish()
        return done.get("outputs"), done["jacobians"]

    return sink, pair
