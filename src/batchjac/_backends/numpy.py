"""A numpy backend for models given in closed form (einops keeps a numpy backend alike).

A :class:`ClosedForm` model carries its function and its Jacobian as numpy code, so the
runner, the sinks, the stores and the Dask path can be tested on exact answers with no
framework installed, and fail only for their own reasons. It is also a way to feed batchjac's
machinery (chunking, stores, resume, ``check``, ``propagate``, ``solve``) a model whose
derivatives are known analytically.

Kernels are plain numpy calls: nothing compiles (``compiles_kernels`` is False), but each
kernel built counts as a trace, so tests can count them as they count the frameworks'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import InputError
from .._spec import assemble
from ._base import UNTUNED, Backend, BoundModel, CallBudget, Kernel, Mode, Signature


class ClosedForm:
    """A model from numpy functions of the model's inputs (each ``(N, ...)``):

    - ``f(*inputs) -> y`` of shape ``(N, *output_shape)``;
    - ``jac(*inputs) -> J`` of shape ``(N, *output_shape, *row_shape)``: the derivative of each
      row's output with respect to that row of the input that holds the unknowns (the whole
      row of the input array the unknown columns are taken from; batchjac selects them).

    ``wrt_input`` names that input when the model takes several (its position). Pass it to any
    batchjac verb like a framework model: ``batchjac.jacobian(ClosedForm(f, jac), x, wrt=[0, 2])``.
    """

    __batchjac_backend__ = "numpy"

    def __init__(self, f: Callable[..., np.ndarray], jac: Callable[..., np.ndarray]) -> None:
        self.f = f
        self.jac = jac

    def __call__(self, *inputs: np.ndarray) -> np.ndarray:
        return np.asarray(self.f(*inputs))


def _concat(parts: list[Any]) -> np.ndarray:
    return np.concatenate(parts, axis=-1)


def _take(x: np.ndarray, idx: tuple[int, ...]) -> np.ndarray:
    return x[..., list(idx)]


class _NumpyKernel(Kernel):
    def __init__(self, bound: NumpyBound, mode: Mode, chunk_size: int, with_outputs: bool) -> None:
        self.bound, self.mode, self.chunk_size, self.with_outputs = bound, mode, chunk_size, with_outputs

    def call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget = UNTUNED
             ) -> tuple[np.ndarray | None, np.ndarray]:
        if u.shape[0] != self.chunk_size:
            raise InputError(f"This kernel takes chunks of {self.chunk_size} rows; got {u.shape[0]}.")
        return self.bound.evaluate(u, ctx, self.with_outputs)


class NumpyBound(BoundModel):
    compiles_kernels = False

    def __init__(self, model: ClosedForm, signature: Signature) -> None:
        super().__init__(signature)
        self.model = model
        layout = signature.layout
        k = int(np.prod(signature.unknown_shape))
        if layout.kind == "concat" or (layout.columns is not None and layout.perm is None):
            self.columns: list[int] | None = list(range(k))  # the unknowns lead the assembled row
        elif layout.columns is not None:
            # the assembled row is concat([u, rest])[..., perm]: u's column j sits where perm is j
            assert layout.perm is not None
            where = {src: pos for pos, src in enumerate(layout.perm)}
            self.columns = [where[j] for j in range(k)]
        else:
            self.columns = None  # the whole input is unknown

    def _inputs(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> list[np.ndarray]:
        return assemble(self.signature.layout, u, ctx, _concat, _take)

    def forward(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        return np.asarray(self.model.f(*self._inputs(u, ctx)), self.signature.dtype)

    def connected(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        return bool(np.any(self._jacobian(self._inputs(u, ctx), u.shape[0])))

    def _jacobian(self, inputs: list[np.ndarray], n: int) -> np.ndarray:
        jac = np.asarray(self.model.jac(*inputs), self.signature.dtype)
        if jac.shape[0] != n:
            raise InputError(f"The ClosedForm model's jac returned {jac.shape[0]} rows for {n}.")
        # (n, *output_shape, *row_shape) -> the unknown columns of the row
        return jac[..., self.columns] if self.columns is not None else jac

    def evaluate(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], with_outputs: bool
                 ) -> tuple[np.ndarray | None, np.ndarray]:
        inputs = self._inputs(u, ctx)
        y = np.asarray(self.model.f(*inputs), self.signature.dtype) if with_outputs else None
        return y, self._jacobian(inputs, u.shape[0])

    def build_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool,
                     budget: CallBudget = UNTUNED) -> Kernel:
        self.trace_count += 1
        return _NumpyKernel(self, mode, chunk_size, with_outputs)


class NumpyBackend(Backend):
    name = "numpy"

    def bind(self, model: Any, signature: Signature, **options: Any) -> BoundModel:
        if not isinstance(model, ClosedForm):
            raise InputError(f"The numpy backend takes a batchjac ClosedForm model (f and its "
                             f"Jacobian in numpy); got {type(model).__name__}.")
        if options:
            raise InputError(f"The numpy backend takes no backend_options; got {sorted(options)}.")
        return NumpyBound(model, signature)


BACKEND = NumpyBackend()
