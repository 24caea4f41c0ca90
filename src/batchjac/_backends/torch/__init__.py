"""PyTorch backend.

The model maps a batch to a batch with independent rows, so a basis vector broadcast over the
whole chunk yields one column (forward mode) or one row (reverse mode) of every instance's
Jacobian at once:

- forward mode: ``torch.func.vmap`` over the unknowns' basis of ``torch.func.jvp`` of the
  whole chunk. The primal pass is not batched by ``vmap``: it runs once, and the model may
  branch on its values (``if x.sum() > 0``).
- reverse mode: ``torch.func.vjp`` of the whole chunk (one forward pass), then ``vmap`` of its
  pullback over the outputs' basis. ``autograd.Function`` subclasses in the old style
  (``forward(ctx, ...)``) are refused by torch.func; for them the same is done with plain
  autograd (``autograd.grad(..., is_grads_batched=True)``, ~10% slower on W2).

The model always sees its ordinary batch, as in training code; no per-instance wrapper. On the
benchmark workloads this is as fast as ``vmap(jacrev)``/``vmap(jacfwd)`` or faster. The
Jacobians come back as views of the framework's layout (``(basis, rows, ...)`` moved to
``(rows, ..., basis)``), not copied: a copy costs ~15% on W2.

``torch.compile`` is not used: on W1 and W3 it cut the steady-state time by 25-35% but took
4-17 s to compile on a 2-core CPU, which a call must be thousands of chunks long to win back.
Parameters are constants: kernels run under ``torch.no_grad()`` (torch.func transforms are
unaffected by it), so no graph is built for the weights and ``.grad`` is never touched.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
import types
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch

from ..._errors import (
    BatchJacError,
    ForwardModeFallbackWarning as ForwardModeFallbackWarning,
    InputError,
    ModelError,
    NotConnectedError,
    OrderFailedError,
    TrainingModeWarning as TrainingModeWarning,
)
from ..._spec import assemble
from .._base import (
    SECOND_RESULT,
    Backend,
    BoundModel,
    Kernel,
    Mode,
    Order,
    SecondKind,
    Signature,
    allowed,
    asked_mode_failed,
    fallback_allowed,
    in_mode_race,
    race,
    rows_at_hand,
    user_stacklevel,
)
from .state import _FORWARD_AD, _load_forward_ad, _silenced

Engine = Literal["func", "autograd", "replicated", "looped", "transposed"]

_OPTIONS = ("train_mode", "device")

#: layers whose output depends on training mode (batch statistics, random masks)
_MODE_DEPENDENT = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.dropout._DropoutNd)




@contextlib.contextmanager
def _unknowns_require_grad() -> Iterator[None]:
    """Plain autograd needs ``requires_grad`` on the unknowns; a model that branches on their
    values (``float(x.max())``) then gets torch's warning about converting such a tensor to a
    number. The flag is batchjac's doing, not the user's, so that one warning is silenced."""
    with _silenced("Converting a tensor with requires_grad=True", UserWarning):
        yield


def _to_torch(a: np.ndarray, device: torch.device) -> torch.Tensor:
    if isinstance(a, torch.Tensor):  # a native chunk (see batchjac._arrays): no host copy
        return a.detach().to(device)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    # torch.from_numpy shares memory and warns on read-only arrays (memmaps opened 'r').
    t = torch.from_numpy(a if a.flags.writeable else a.copy())
    return t if t.device == device else t.to(device)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


class TorchOps:
    """torch tensors as the pipeline's arrays (:class:`batchjac._xp.ArrayOps`), on their
    device: what ``jacobian`` works with when torch tensors go into a torch model."""

    kind = "torch"

    def is_native(self, a: Any) -> bool:
        return isinstance(a, torch.Tensor)

    def dtype_of(self, a: Any) -> np.dtype:
        try:
            return np.dtype(str(a.dtype).removeprefix("torch."))
        except TypeError:  # bfloat16 and the like: no numpy dtype (_validate.examine refuses them by name first)
            return np.dtype(object)

    def device_of(self, a: Any) -> Any:
        return a.device

    def cast(self, a: Any, dtype: np.dtype) -> Any:
        return a.detach().to(getattr(torch, np.dtype(dtype).name)).contiguous()

    def contiguous(self, a: Any) -> Any:
        return a.detach().contiguous()

    def take(self, a: Any, cols: tuple[int, ...]) -> Any:
        return a.index_select(-1, torch.tensor(cols, dtype=torch.long, device=a.device))

    def pad_rows(self, a: Any, rows: int) -> Any:
        return torch.cat([a, a[-1:].expand(rows - a.shape[0], *a.shape[1:])])

    def concat(self, parts: list[Any]) -> Any:
        return torch.cat(parts)

    def buffer(self, like: Any, shape: tuple[int, ...], host: Any) -> Any | None:
        if like.device.type == "cpu":  # host memory, allocated as numpy results are
            return torch.from_numpy(host(shape, self.dtype_of(like)))
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def write(self, buffer: Any, lo: int, a: Any) -> None:
        buffer[lo:lo + a.shape[0]].copy_(a)

    def sealed(self, buffer: Any) -> Any:
        return buffer

    def all_finite(self, a: Any) -> bool:
        # one reduction: NaN and Inf reach the sum, so a finite sum proves every entry finite
        # (torch.isfinite(a).all() is four passes: 19 ms on W2's 10,000 x 784 input against
        # 0.5 ms, 4% of the call); only a sum that overflowed is checked entry by entry
        return not a.is_floating_point() or bool(torch.isfinite(a.sum())) or \
            bool(torch.isfinite(a).all())

    def any_nonzero(self, a: Any) -> bool:
        return bool(a.any())

    def to_numpy(self, a: Any) -> np.ndarray:
        return _to_numpy(a)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        return _to_torch(np.asarray(a), torch.device(device) if device is not None
                         else torch.device("cpu"))

    def to_device(self, a: Any, device: Any) -> Any:
        return a.to(device)


OPS = TorchOps()


def _owner_module(model: Any) -> torch.nn.Module | None:
    """The module whose state the model uses: the model itself, or ``module.method``."""
    if isinstance(model, torch.nn.Module):
        return model
    if isinstance(model, types.MethodType) and isinstance(model.__self__, torch.nn.Module):
        return model.__self__
    return None


def _set_eval(module: torch.nn.Module, flags: list[tuple[torch.nn.Module, bool]]) -> None:
    """``module.eval()``, without its per-module ``__setattr__`` (~0.1 ms a call for a small
    MLP, 5% of W1) unless some submodule overrides ``train`` and must see the call."""
    if any(type(m).train is not torch.nn.Module.train for m, _ in flags):
        module.eval()
        return
    for m, f in flags:
        if f:
            m.__dict__["training"] = False


def _restore(flags: list[tuple[torch.nn.Module, bool]]) -> None:
    """Every submodule's own training flag back (mixed flags included); an overridden
    ``train`` of the top module is called with its original mode first."""
    top, top_flag = flags[0]
    if any(type(m).train is not torch.nn.Module.train for m, _ in flags):
        top.train(top_flag)
    for m, f in flags:
        if m.training is not f:
            m.__dict__["training"] = f  # Module.__setattr__ is slow


def _model_device(module: torch.nn.Module | None) -> torch.device:
    first: torch.Tensor | None = None
    if module is not None:
        first = next(module.parameters(), None)
        first = first if first is not None else next(module.buffers(), None)
    return first.device if first is not None else torch.device("cpu")


class TorchBound(BoundModel):
    compiles_kernels = False  # eager: a kernel of another chunk size costs nothing to make
    reductions_over_forward = False  # (see BoundModel: measured 1.8-1.9x)
    hessian_outputs_at_once = False  # (see BoundModel: plain autograd, an output at a time)

    def __init__(self, model: Any, signature: Signature, *, train_mode: bool = False,
                 device: Any = None) -> None:
        super().__init__(signature)
        self.model = model
        self.module = _owner_module(model)
        self.train_mode = train_mode
        self.dtype: torch.dtype = getattr(torch, np.dtype(signature.dtype).name)
        self.device = torch.device(device) if device is not None else _model_device(self.module)
        self._k = math.prod(signature.unknown_shape)
        # Parameters and buffers whose dtype differs from the compute dtype are run as cast
        # copies through torch.func.functional_call (the user's module is never changed).
        self._cast: dict[str, torch.Tensor] = {}
        self._cast_src: dict[str, tuple[torch.Tensor, int]] = {}
        self._mode_warned = False
        self._mode_lock = threading.Lock()
        self._active = 0  # calls in progress: the first switches to eval, the last restores
        self._flags: list[tuple[torch.nn.Module, bool]] = []
        self._perm: torch.Tensor | None = None  # layout.perm as an index tensor
        # what the first kernel call found out about this model (see TorchKernel._first_call)
        self.forward_failure: str | None = None
        self.fallback_warned = False
        self.reverse_engine: Engine | None = None
        self.refresh()

    # -- state -------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Keep the cast copies of the weights in step with the user's module: re-cast only
        tensors that were replaced or changed in place (their version counter moved)."""
        model = self.model
        if not isinstance(model, torch.nn.Module):
            return False
        if not self._cast and all(not t.is_floating_point() or t.dtype == self.dtype
                                  for t in (*model.parameters(), *model.buffers())):
            return False  # the common case, checked without building names
        named = [*model.named_parameters(), *model.named_buffers()]
        wanted = {n: t for n, t in named if t.is_floating_point() and t.dtype != self.dtype}
        with torch.no_grad():
            for name, src in wanted.items():
                old = self._cast_src.get(name)
                if old is None or old[0] is not src or old[1] != src._version:
                    self._cast[name] = src.detach().to(self.dtype)
                    self._cast_src[name] = (src, src._version)
        for name in set(self._cast) - set(wanted):
            del self._cast[name], self._cast_src[name]
        return False  # the kernels take the cast weights as arguments: none is stale

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Eval mode (unless training is forced) for the call, then every submodule's own
        flag back; no autograd graph for the weights."""
        switch = self.module is not None and not self.train_mode
        if switch:
            assert self.module is not None
            with self._mode_lock:  # threads sharing the model (e.g. a threaded scheduler)
                if self._active == 0:
                    self._flags = [(m, m.training) for m in self.module.modules()]
                    if any(f for _, f in self._flags):
                        self._warn_training(self._flags)
                        _set_eval(self.module, self._flags)
                self._active += 1
        try:
            with torch.no_grad():
                yield
        finally:
            if switch:
                with self._mode_lock:
                    self._active -= 1
                    if self._active == 0:
                        _restore(self._flags)
                        self._flags = []

    def _warn_training(self, flags: list[tuple[torch.nn.Module, bool]]) -> None:
        if self._mode_warned:
            return
        assert self.module is not None
        found = [m for m, f in flags if f and isinstance(m, _MODE_DEPENDENT)]
        if not found:
            return
        names = {id(m): n for n, m in self.module.named_modules()}
        hits = [f"{names.get(id(m)) or type(m).__name__} ({type(m).__name__})" for m in found]
        self._mode_warned = True
        more = f" and {len(hits) - 3} more" if len(hits) > 3 else ""
        warnings.warn(
            f"The model is in training mode and has layers that behave differently in eval "
            f"mode: {', '.join(hits[:3])}{more}. batchjac evaluates it in eval mode (running "
            f"statistics, no dropout), because batch statistics would make each instance's "
            f"Jacobian depend on the other rows; your model's mode is restored afterwards. "
            f"Call model.eval() to silence this warning, or pass "
            f"backend_options={{'train_mode': True}} to force training mode (models with "
            f"batch statistics are then rejected, since their rows interact).",
            TrainingModeWarning, stacklevel=user_stacklevel(),
        )

    def _state(self) -> dict[str, torch.Tensor]:
        """The tensors functional_call substitutes: cast weights, and in forced training mode
        copies of the buffers so that batch-norm statistics of the user's model stay put."""
        if not self.train_mode or not isinstance(self.model, torch.nn.Module):
            return self._cast
        state = dict(self._cast)
        for name, b in self.model.named_buffers():
            if name not in state:
                state[name] = b.detach().clone()
        return state

    def _take(self, x: torch.Tensor, idx: tuple[int, ...]) -> torch.Tensor:
        if self._perm is None or self._perm.device != x.device:
            self._perm = torch.tensor(idx, dtype=torch.long, device=x.device)
        return x.index_select(-1, self._perm)

    def device_free_memory(self) -> int | None:
        """Free bytes of the CUDA device the kernels run on (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(self.device)[0])

    def tensors(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return _to_torch(u, self.device), tuple(_to_torch(c, self.device) for c in ctx)

    # -- model call --------------------------------------------------------------------------
    def apply(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The model's output for ``(u, ctx)``. Framework errors propagate unchanged (the
        callers decide between a fallback and a ModelError); bad outputs raise ModelError."""
        lay = self.signature.layout
        inputs = assemble(lay, u, ctx, concat=lambda xs: torch.cat(xs, dim=-1), take=self._take)
        state = self._state()
        if lay.kind in ("single", "concat", "tuple"):
            args, kwargs = tuple(inputs), {}
        else:
            assert lay.keys is not None
            args, kwargs = (), dict(zip(lay.keys, inputs))
        if state:
            y = torch.func.functional_call(self.model, state, args, kwargs)
        else:
            y = self.model(*args, **kwargs)
        return self._check_output(y)

    def _check_output(self, y: Any) -> torch.Tensor:
        if isinstance(y, (list, tuple, dict)):
            raise ModelError(
                f"The model returned a {type(y).__name__} of {len(y)} outputs; batchjac "
                f"differentiates one output tensor. Wrap the model to return one tensor, e.g. "
                f"torch.cat(outputs, dim=-1), or pick the output you need."
            )
        if not isinstance(y, torch.Tensor):
            raise NotConnectedError(
                f"The model returned a {type(y).__module__}.{type(y).__name__}, not a torch "
                f"tensor: its output was computed outside torch (.numpy(), numpy functions), so "
                f"no gradient can reach the unknowns. Compute the output with torch operations "
                f"on the tensors the model receives."
            )
        if not y.is_floating_point():
            raise ModelError(f"The model output has dtype {y.dtype}; it must be floating.")
        if self.dtype == torch.float64 and y.dtype != torch.float64:
            raise ModelError(
                f"float64 was asked for (dtype='float64' or float64 inputs), but the model "
                f"returned {y.dtype}: it computes in lower precision inside. Pass the "
                f"torch.nn.Module itself (batchjac runs a float64 copy of its weights), convert "
                f"what it uses with .double(), or use dtype='float32'."
            )
        return y if y.dtype == self.dtype else y.to(self.dtype)

    # -- probes ------------------------------------------------------------------------------
    def forward(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        ut, ct = self.tensors(u, ctx)
        with self.calling():
            try:
                y = self._counted(ut, ct)
            except (ModelError, Warning):
                raise
            except Exception as e:
                raise _explain_model_failure(e, self.signature) from e
        return _to_numpy(y)

    #: bytes a row of the model's intermediates holds (:mod:`.cost`), once counted
    _row_bytes_seen: float | None = None
    _row_bytes_counted = False

    def _counted(self, ut: torch.Tensor, ct: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The forward pass, on the CPU the first time with its intermediates counted (the
        probes' pass: :meth:`row_working_set`). A model that fails under the counting (a
        compiled one, say) is run again as it is, and nothing is counted."""
        from . import cost

        if self._row_bytes_counted or self.device.type != "cpu" or ut.dim() == 0:
            return self.apply(ut, ct)
        self._row_bytes_counted = True
        try:
            y, self._row_bytes_seen = cost.counted(lambda: self.apply(ut, ct), ut.shape[0])
        except Exception:  # (the plain call below raises the model's own error, if any)
            self._row_bytes_seen = None
            return self.apply(ut, ct)
        return y  # type: ignore[no-any-return]

    def row_working_set(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> float | None:
        """From the probes' forward pass on the CPU (:mod:`.cost`): the bytes a row of its
        intermediates holds, which autograd keeps for the backward passes; None elsewhere."""
        return self._row_bytes_seen if self.device.type == "cpu" else None

    def connected(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        ut, ct = self.tensors(u, ctx)
        with self.calling(), torch.enable_grad(), _unknowns_require_grad():
            x = ut.detach().requires_grad_(True)
            try:
                y = self.apply(x, ct)
            except (ModelError, Warning):
                raise
            except Exception as e:
                if "numpy()" in str(e):  # x.numpy() on the unknowns: the path is cut there
                    return False
                raise _explain_model_failure(e, self.signature) from e
            if not y.requires_grad:
                return False
            (grad,) = torch.autograd.grad(y.sum(), x, allow_unused=True)
        return grad is not None

    # -- Jacobians ---------------------------------------------------------------------------
    def jac_forward(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], basis: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``basis`` is ``(k, rows, *unknown_shape)``: unit tangents broadcast over the rows."""
        def push(tangent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = torch.func.jvp(lambda a: self.apply(a, ctx), (u,), (tangent,))
            return out[0], out[1]

        # out_dims None: the primal output does not depend on the tangent, so it is unbatched
        y, jt = torch.func.vmap(push, out_dims=(None, 0))(basis)  # type: ignore[arg-type]
        # jt: (k, rows, *out)
        jac = jt.movedim(0, -1)
        return y, jac.reshape(*jac.shape[:-1], *self.signature.unknown_shape)

    def jac_transposed(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], basis: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward mode on plain autograd, by transposing reverse mode: ``g(w) = J^T w`` (one
        backward pass with ``create_graph``) is linear in the cotangent ``w``, so its
        pullback along a unit tangent ``e_j`` is ``J e_j``: one batched double-backward pass
        over ``basis`` (``(k, rows, *unknown_shape)``) gives every column. It loads neither
        torch.func (whose forward mode imports torch._dynamo through ``F.linear``'s
        decomposition: 0.5-1.4 s) nor the forward-mode decompositions (0.3 s), and on W3's
        1,000 rows took 128-136 ms against vmap(jvp)'s 176 ms (side by side, loaded)."""
        ushape = tuple(u.shape[1:])
        with torch.enable_grad(), _unknowns_require_grad():
            x = u.detach().requires_grad_(True)
            y = self.apply(x, ctx)
            jt = None
            if y.requires_grad:
                w = torch.zeros_like(y, requires_grad=True)
                (g,) = torch.autograd.grad(y, x, w, create_graph=True, allow_unused=True,
                                           materialize_grads=True)
                if g.requires_grad:  # (J constant in w only where no path leads from u)
                    (jt,) = torch.autograd.grad(g, w, basis, is_grads_batched=True,
                                                allow_unused=True, materialize_grads=True)
            if jt is None:  # no path from the unknowns at all (probes off): zero Jacobians
                jt = y.new_zeros((basis.shape[0], *y.shape))
        jac = jt.detach().movedim(0, -1)  # (rows, *out, k)
        return y.detach(), jac.reshape(*jac.shape[:-1], *ushape)

    def jac_reverse(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...],
                    basis: torch.Tensor | None, engine: Engine = "func"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``basis`` is ``(m, rows, *out)``: unit cotangents broadcast over the rows (None:
        built here). ``engine="func"`` is ``torch.func.vjp`` (the fastest); ``"autograd"`` is
        plain autograd, for ``autograd.Function`` subclasses that torch.func rejects."""
        if engine == "replicated":
            return self._jac_replicated(u, ctx)
        if engine == "looped":
            return self._jac_looped(u, ctx)
        if engine == "func":
            y, pull = torch.func.vjp(lambda a: self.apply(a, ctx), u)[:2]
        else:
            with torch.enable_grad(), _unknowns_require_grad():
                x = u.detach().requires_grad_(True)
                y = self.apply(x, ctx)
        rows, out_shape = y.shape[0], tuple(y.shape[1:])
        m = math.prod(out_shape)
        if basis is None or tuple(basis.shape[1:]) != (rows, *out_shape):
            basis = _basis(m, rows, out_shape, y.dtype, y.device)
        if engine == "func":
            (jt,) = torch.func.vmap(pull)(basis)
        elif y.requires_grad:
            (jt,) = torch.autograd.grad(y, x, basis, is_grads_batched=True, allow_unused=True,
                                        materialize_grads=True)
        else:  # no path from the unknowns at all (probes off): zero Jacobians
            jt = x.new_zeros((m, *x.shape))
        jac = jt.movedim(0, 1)  # (rows, m, *unknown_shape)
        return y.detach(), jac.reshape(rows, *out_shape, *self.signature.unknown_shape)

    def _jac_replicated(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reverse mode with plain autograd and no vmap: the chunk repeated once per output,
        one forward and one backward pass, block ``i`` seeded with the unit cotangent ``e_i``
        (rows are independent, which the probes check). It computes the forward pass ``m``
        times, but skips torch.func's per-call Python work (~0.2 ms), which dominates small
        chunks of small models."""
        assert self.output_shape is not None
        out_shape = self.output_shape
        m, rows = math.prod(out_shape), u.shape[0]

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat(m, *([1] * (t.ndim - 1)))

        with torch.enable_grad(), _unknowns_require_grad():
            x = rep(u.detach()).requires_grad_(True)
            y = self.apply(x, tuple(rep(c) for c in ctx))
            if y.requires_grad:
                seed = _basis(m, rows, out_shape, y.dtype, y.device).reshape(m * rows, *out_shape)
                (g,) = torch.autograd.grad(y, x, seed, allow_unused=True, materialize_grads=True)
            else:  # no path from the unknowns at all (probes off): zero Jacobians
                g = torch.zeros_like(x)
        jac = g.reshape(m, rows, *u.shape[1:]).movedim(0, 1)
        return y[:rows].detach(), jac.reshape(rows, *out_shape, *self.signature.unknown_shape)

    def _jac_looped(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reverse mode with plain autograd and no vmap: one forward pass of the chunk, then
        one backward pass per output ``o`` of ``sum_rows y[:, o]`` (rows are independent,
        which the probes check, so its gradient at row ``i`` is row ``i``'s Jacobian row).
        It imports nothing (torch.func's vmap imports torch._dynamo, 0.6-0.9 s, on its first
        pullback), holds one copy of the activations (the replicated pass holds ``m``), and
        on W2's 10,000 rows took 437 ms against vmap's 507-541 ms (side by side, loaded)."""
        assert self.output_shape is not None
        out_shape = self.output_shape
        m, rows, ushape = math.prod(out_shape), u.shape[0], tuple(u.shape[1:])
        with torch.enable_grad(), _unknowns_require_grad():
            x = u.detach().requires_grad_(True)
            y = self.apply(x, ctx)
            jac = x.new_empty((rows, m, *ushape))
            if not y.requires_grad:  # no path from the unknowns at all (probes off)
                jac.zero_()
            else:
                flat = y.reshape(rows, m)
                for o in range(m):
                    (g,) = torch.autograd.grad(flat[:, o].sum(), x, retain_graph=o < m - 1,
                                               allow_unused=True, materialize_grads=True)
                    jac[:, o] = g
        return y.detach(), jac.reshape(rows, *out_shape, *self.signature.unknown_shape)

    def build_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool) -> Kernel:
        return TorchKernel(self, mode, chunk_size, with_outputs)

    def build_second_kernel(self, kind: SecondKind, order: Order, chunk_size: int,
                            with_outputs: bool, with_jacobian: bool) -> Kernel:
        return TorchSecondKernel(self, kind, order, chunk_size, with_outputs, with_jacobian)


def _weights(bound: TorchBound) -> list[torch.Tensor]:
    """The tensors a traced graph of the model holds: its parameters and buffers (and the
    cast copies batchjac made of them), whose identities and versions say when it is stale."""
    found = list(bound._state().values())
    module = bound.module
    if module is not None:
        found += list(module.parameters()) + list(module.buffers())
    # a plain function's weights: the tensors its closure holds, alone or in a list or dict
    for cell in getattr(bound.model, "__closure__", None) or ():
        try:
            held = cell.cell_contents
        except ValueError:  # (an empty cell)
            continue
        items = held.values() if isinstance(held, dict) else held \
            if isinstance(held, (list, tuple)) else (held,)
        for item in items:
            parts = item if isinstance(item, (list, tuple)) else (item,)
            found += [t for t in parts if isinstance(t, torch.Tensor)]
    return found


def _basis(n: int, rows: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
           ) -> torch.Tensor:
    """``(n, rows, *shape)``: the unit vectors of ``shape``, broadcast over the rows (a view,
    no copy)."""
    eye = torch.eye(n, dtype=dtype, device=device).reshape(n, 1, *shape)
    return eye.expand(n, rows, *shape)


class TorchKernel(Kernel):
    """Forward or reverse mode over chunks of ``chunk_size`` rows. The first call finds the
    fastest path that works for this model: forward mode falls back to reverse mode (with one
    warning), and torch.func's reverse mode to plain autograd (same values, no warning).

    Reverse mode has three implementations: torch.func's ``vmap`` of ``vjp`` ("vmap"), one
    backward pass through the chunk repeated once per output ("replicated", see
    ``TorchBound._jac_replicated``) and one forward pass with a backward pass per output
    ("looped", ``TorchBound._jac_looped``). Measured here on an 8-output MLP (5-32-32-8,
    float64), "replicated" takes 0.22 ms for 15 rows against 0.39 ms, but 2.2 against 1.6 ms
    for 1,000 rows; on W2's 10,000 rows "looped" took 437 ms against vmap's 507-541 ms. A
    first call whose work repays a race times "vmap" against "looped", and "replicated" too
    when a chunk takes less than ``REPLICATED_BELOW`` (:func:`~batchjac._backends._base.race`),
    unless a variant was fixed with :meth:`use` (stores, reproducible solves) or
    ``BATCHJAC_AUTOTUNE=off``: then "vmap". A first call too small to repay a race runs a
    plain-autograd build untimed (:meth:`_first_plain`).
    """

    MARGIN = 0.95
    #: "replicated" is timed only against chunks faster than this (where the Python work
    #: around torch.func matters), never on large chunks (it holds m copies of the chunk)
    REPLICATED_BELOW = 0.005

    def __init__(self, bound: TorchBound, mode: Mode, chunk_size: int, with_outputs: bool) -> None:
        self.mode, self.chunk_size, self.with_outputs = mode, chunk_size, with_outputs
        self._bound = bound
        bound.trace_count += 1
        sig = bound.signature
        self._out_basis: torch.Tensor | None = None
        if bound.output_shape is not None:
            m = math.prod(bound.output_shape)
            self._out_basis = _basis(m, chunk_size, bound.output_shape, bound.dtype, bound.device)
        self._in_basis = _basis(bound._k, chunk_size, sig.unknown_shape, bound.dtype, bound.device)
        self._path: tuple[Mode, Engine] | None = None
        self.planned = mode  # ``mode`` becomes "reverse" where forward mode falls back
        self.variants = ("vmap", "replicated", "looped") if mode == "reverse" \
            else ("vmap", "transposed")
        self.variant = None

    def _select(self, variant: str, note: str) -> None:
        if self._path is not None and self._path[1] in _PLAIN_ENGINES:
            self._path = (self._path[0], _VARIANT_ENGINE.get(variant, "func"))
        super()._select(variant, note)

    def _run(self, path: tuple[Mode, Engine], u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if path == ("forward", "transposed"):
            return self._bound.jac_transposed(u, ctx, self._in_basis)
        if path[0] == "forward":
            _load_forward_ad()  # (only torch.func's forward mode needs them: 0.3 s)
            with _FORWARD_AD:
                return self._bound.jac_forward(u, ctx, self._in_basis)
        return self._bound.jac_reverse(u, ctx, self._out_basis, path[1])

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]
                 ) -> tuple[np.ndarray | None, np.ndarray]:
        bound = self._bound
        ut, ct = bound.tensors(u, ctx)
        with bound.calling():
            first = None
            if self._path is None:
                with self.building:  # (threads sharing the kernel: one chooses its path)
                    if self._path is None:
                        first = self._first_call(ut, ct)
            path = self._path
            if first is not None:
                y, jac = first
            else:
                assert path is not None
                if path[0] != self.planned and not fallback_allowed():
                    raise asked_mode_failed(self.planned, str(bound.forward_failure), _FORWARD_CAUSE)
                y, jac = self._run(path, ut, ct)
        if isinstance(u, torch.Tensor):  # tensors in, tensors out, on the device
            return (y if self.with_outputs else None), jac
        return (_to_numpy(y) if self.with_outputs else None), _to_numpy(jac)

    def retune(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        if self.untimed and self._path == ("forward", "transposed") and self._forced is None:
            self.untimed = False
            ut, ct = self._bound.tensors(u, ctx)
            with self._bound.calling(), allowed(True):
                self._choose_forward(ut, ct)
            return
        if not self.untimed or self._path is None or self._path[0] != "reverse" \
                or self._path[1] not in _PLAIN_ENGINES or "replicated" not in self.variants:
            return
        self.untimed = False
        bound = self._bound
        ut, ct = bound.tensors(u, ctx)
        with bound.calling(), allowed(True):
            self._choose_reverse(ut, ct)

    #: the replicated pass is a reverse-mode first call's build while it holds at most this
    #: many rows (the call's, or the chunk's where larger, times the outputs) and torch.func
    #: has not loaded torch._dynamo;
    #: past it the looped pass is. (At 16,384 a remembered chunk of 625 W2 rows took the
    #: replicated pass, which runs the 784-wide forward pass 10 times: the bench's warm W2
    #: first call 1.10x native against the cold one's 0.50x.)
    REPLICATED_FIRST_ROWS = 2048

    def _first_call(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._first_plain(u, ctx)
        if out is not None:
            return out
        bound = self._bound
        paths: list[tuple[Mode, Engine]] = [("reverse", "func"), ("reverse", "autograd")]
        if bound.reverse_engine is not None:  # another kernel found what works
            paths = [("reverse", bound.reverse_engine)]
        if self.mode == "forward" and bound.forward_failure is None:
            paths.insert(0, ("forward", "func"))
        first: Exception | None = None
        for path in paths:
            try:
                out = self._run(path, u, ctx)
            except (ModelError, Warning):  # Warning: a warnings-as-errors run, not a failure
                raise
            except Exception as e:
                if _out_of_memory(e):
                    raise _explain_model_failure(e, bound.signature) from e
                first = first or e
                if path[0] == "forward":
                    bound.forward_failure = f"{type(e).__name__}: {_first_line(e)}"
                continue
            if path[0] == "reverse":
                bound.reverse_engine = path[1]
                if self.mode == "forward" and not fallback_allowed():
                    # asked for (as TensorFlow and JAX do): refuse, the failure being the mode's
                    raise asked_mode_failed("forward", str(bound.forward_failure),
                                            _FORWARD_CAUSE) from first
                if self.mode == "forward":
                    self._warn_fallback()
            self._path = path
            self.variant = "vmap"
            if path == ("reverse", "func") and "replicated" in self.variants:
                self._choose_reverse(u, ctx)
            elif path == ("forward", "func") and "transposed" in self.variants:
                self._choose_forward(u, ctx)
            elif path[0] == "reverse" and self.planned == "forward":
                self.variants = ("vmap",)  # (forward mode failed: its builds are gone)
            return out
        assert first is not None
        raise _explain_model_failure(first, bound.signature) from first

    def _plain_first(self) -> str | None:
        """The plain-autograd build that answers this kernel's first call sooner than
        torch.func, which would import torch._dynamo first (see :meth:`_first_plain`):
        "replicated" for small chunks, "looped" past ``REPLICATED_FIRST_ROWS``; None where
        torch.func is loaded already, the mode is forward, or torch.func failed here."""
        bound = self._bound
        if self.mode == "forward":
            plain = "transposed" in self.variants and "torch._dynamo" not in sys.modules \
                and bound.forward_failure is None and bound.reverse_engine in (None, "func")
            return "transposed" if plain else None
        if not (self.mode == "reverse" and "replicated" in self.variants
                and "torch._dynamo" not in sys.modules and bound.reverse_engine in (None, "func")
                and bound.output_shape is not None):
            return None
        # (the call's rows: a large call cut into cache-sized chunks, W4's 2,000 images in
        # chunks of 143, ran its conv net's forward pass 10 times a chunk replicated, first
        # call 0.61 s against 0.37 looped)
        rows = max(self.chunk_size, rows_at_hand())
        small = math.prod(bound.output_shape) * rows <= self.REPLICATED_FIRST_ROWS
        return "replicated" if small else "looped"

    @property
    def cheap_first(self) -> str | None:
        """The build a first call takes when an earlier process's race chose another one
        (:func:`batchjac._tuning.recall_variant`): a plain-autograd build where it imports
        nothing and torch.func would import torch._dynamo (0.6 s of a 25 ms first call,
        measured in the bench's warm-cache W1 case); the remembered build replaces it once
        the work repays it."""
        return self._plain_first()

    def _first_plain(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An untimed reverse-mode first call on plain autograd, where that is the cheaper
        first answer: torch.func's reverse mode imports torch._dynamo when its first pullback
        runs (measured here: 0.5 s idle, 2.4-2.7 s on the loaded machine, for a W1 job that
        then computes in 1.5 ms; 0.6-0.9 s of W2's first call at 10,000 rows). Small chunks
        take the replicated pass (1.4x slower at 1,000 rows of an 8-output MLP, faster below),
        larger ones the looped pass (a backward pass per output, as fast as vmap or faster).
        The builds are raced later, once the work repays it (:meth:`retune`). None: the usual
        first call (a variant fixed, a race allowed, torch.func loaded already, another kernel
        of this model found that torch.func fails)."""
        from ..._config import autotune_enabled
        from .._base import race_allowed, untimed_note

        forced = self._bound.reverse_engine in (None, "func") and (
            (self._forced in ("replicated", "looped") and self.mode == "reverse")
            or (self._forced == "transposed" and self.mode == "forward"))
        build = self._forced if forced else self._plain_first()
        if not forced and (self._forced is not None or race_allowed() or not autotune_enabled()):
            return None
        if build is None:
            return None
        engine = _VARIANT_ENGINE[build]
        mode: Mode = "forward" if build == "transposed" else "reverse"
        try:
            out = self._run((mode, engine), u, ctx)
        except (ModelError, Warning):
            raise
        except Exception:  # e.g. a model that keeps state across rows: the usual first call
            return None
        self._path, self.variant = (mode, engine), build
        if forced:  # a plain-autograd build fixed (remembered, a store's record): no vmap first
            self.note = f"{build} ({self._forced_why})"
            return out
        self.untimed = True
        self.note = (f"{build} (plain autograd: torch.func's {mode} mode would load "
                     f"torch._dynamo first; {untimed_note()})")
        return out

    def _race_skipped(self, running: str) -> bool:
        """Before a race of builds: a fixed variant is selected, or, where the work does not
        repay a race, ``running`` is kept untimed (True: no race)."""
        from .._base import race_allowed, untimed_note

        if self._forced is not None:
            self._select(self._forced, f"{self._forced} ({self._forced_why})")
            return True
        if not race_allowed():
            self.note = f"{running} ({untimed_note()})"
            self.untimed = True
            return True
        return False

    def _choose_forward(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
        """"vmap" (torch.func's jvp) or "transposed" for a forward-mode kernel, timed where
        the work repays it (both compute the same columns)."""
        if self._race_skipped(str(self.variant)):
            return
        runs = {v: (lambda v=v: self._run(("forward", _VARIANT_ENGINE[v]), u, ctx))
                for v in ("vmap", "transposed")}
        for name, run in list(runs.items()):
            try:
                run()  # (warm up: torch.func's first call imports, the plain one may fail)
            except Exception:  # e.g. an operator without a double-backward rule
                del runs[name]
        if len(runs) < 2:
            only = next(iter(runs), "vmap")
            self._path, self.variant = ("forward", _VARIANT_ENGINE[only]), only
            self.variants = (only,)
            self.note = f"{only} (the other forward-mode build failed)"
            return
        best = race(lambda v: runs[v](), list(runs), timing_seconds=0.1)
        winner = "transposed" if best["transposed"] < self.MARGIN * best["vmap"] else "vmap"
        self._path, self.variant = ("forward", _VARIANT_ENGINE[winner]), winner
        timed = ", ".join(f"{v} {t * 1e3:.2f} ms" for v, t in best.items())
        self.note = f"{winner} (timed one chunk: {timed})"

    def _choose_reverse(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
        """"vmap", "replicated" or "looped" for a reverse-mode kernel that runs with torch.func."""
        if self._race_skipped("vmap"):
            return
        start = time.perf_counter()
        self._run(("reverse", "func"), u, ctx)
        took = time.perf_counter() - start
        # the replicated pass holds m copies of the chunk: only for fast chunks
        rivals = ["looped"] if took >= self.REPLICATED_BELOW else ["replicated", "looped"]
        for name in list(rivals):
            try:
                self._run(("reverse", _VARIANT_ENGINE[name]), u, ctx)  # warm up
            except Exception:  # e.g. a model that keeps state across rows: torch.func only
                rivals.remove(name)
        self.variants = ("vmap", *(v for v in self.variants if v in rivals))
        if not rivals:
            self._path, self.variant = ("reverse", "func"), "vmap"
            self.note = "vmap (the plain-autograd passes failed)"
            return
        best = race(lambda v: self._run(("reverse", _VARIANT_ENGINE[v]), u, ctx),
                    ["vmap", *rivals], timing_seconds=0.1)
        fastest = min(rivals, key=lambda v: best[v])
        winner = fastest if best[fastest] < self.MARGIN * best["vmap"] else "vmap"
        self._path = ("reverse", _VARIANT_ENGINE[winner])
        self.variant = winner
        timed = ", ".join(f"{v} {t * 1e3:.2f} ms" for v, t in best.items())
        self.note = f"{winner} (timed one chunk: {timed})"

    def _warn_fallback(self) -> None:
        self.mode = "reverse"
        bound = self._bound
        if bound.fallback_warned or in_mode_race():
            return
        bound.fallback_warned = True
        warnings.warn(
            f"Forward mode failed for this model ({bound.forward_failure}); batchjac computes "
            f"the Jacobians in reverse mode instead, which gives the same values but takes one "
            f"backward pass per output rather than one pass per unknown. {_FORWARD_CAUSE} "
            f"Pass mode='reverse' to skip the attempt.",
            ForwardModeFallbackWarning, stacklevel=user_stacklevel(),
        )


#: the reverse-mode builds of :class:`TorchKernel` and the engine each runs on
_VARIANT_ENGINE: dict[str, Engine] = {"vmap": "func", "replicated": "replicated", "looped": "looped",
                                      "transposed": "transposed"}
_PLAIN_ENGINES = ("func", "replicated", "looped", "transposed")

_FORWARD_CAUSE = ("Usual cause: an operator or a custom torch.autograd.Function without a "
                  "forward-mode rule (jvp, or vmap support).")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


#: the code of the wrapper ``torch.autograd.function.once_differentiable`` puts around a
#: backward (functools.wraps copies the name, not the code): the Function's own marker
_ONCE_CODE = torch.autograd.function.once_differentiable(lambda ctx, *g: g).__code__


def _is_once_differentiable(function: type) -> bool:
    """Whether a custom ``torch.autograd.Function``'s backward is ``@once_differentiable``:
    computed under ``no_grad``, so plain autograd cannot differentiate it again."""
    for name in ("backward", "vjp"):
        fn = getattr(function, name, None)
        if getattr(fn, "__code__", None) is _ONCE_CODE:
            return True
    return False


def _in_func_form(function: type) -> bool:
    """Whether torch.func can push a tangent through a custom Function and its backward: its
    own ``setup_context`` and ``jvp`` staticmethods."""
    base = torch.autograd.Function
    return all(getattr(function, name, None) is not getattr(base, name, None)
               for name in ("setup_context", "jvp"))


def _custom_functions(y: torch.Tensor, x: torch.Tensor) -> dict[str, tuple[bool, bool]]:
    """The custom ``torch.autograd.Function`` classes on a path of ``y``'s graph from ``x``,
    by name, each with whether its backward is ``@once_differentiable`` and whether it is in
    torch.func's form (:func:`_in_func_form`). (Functions on the weights' paths only do not
    count: the derivatives are taken in ``x``.)"""
    found: dict[str, tuple[bool, bool]] = {}
    root = y.grad_fn
    if root is None:
        return found
    reaches: dict[int, bool] = {}
    keep: list[Any] = []  # the nodes walked, alive, so that their ids stay unique
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if not done:
            if id(node) in reaches:
                continue
            reaches[id(node)] = False  # (a DAG: finished before any parent reads it)
            keep.append(node)
            stack.append((node, True))
            stack.extend((n, False) for n, _ in node.next_functions
                         if n is not None and id(n) not in reaches)
            continue
        hit = getattr(node, "variable", None) is x or any(
            reaches.get(id(n), False) for n, _ in node.next_functions if n is not None)
        reaches[id(node)] = hit
        function = getattr(node, "_forward_cls", None)
        if hit and isinstance(function, type):
            found[f"{function.__module__}.{function.__qualname__}"] = (
                _is_once_differentiable(function), _in_func_form(function))
    return found


def _first_sentence(e: Exception) -> str:
    text = _first_line(e)[:300]
    return text.split(". ", 1)[0].rstrip(".")


def _quoted(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _out_of_memory(e: Exception) -> bool:
    text = str(e)
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in text \
        or "can't allocate memory" in text


def _explain_model_failure(e: Exception, sig: Signature) -> ModelError:
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0][:300]
    if _out_of_memory(e):
        return ModelError(
            f"The model ran out of memory while computing the Jacobians ({first}). Lower "
            f"`max_memory` or `chunk_size` so that fewer rows are processed at once."
        )
    if "numpy()" in text or ("item()" in text and "vmap" in text):
        return ModelError(
            f"The model leaves torch ({first}): it converts tensors to numpy or Python numbers, "
            f"so gradients cannot flow through it. Write the model with torch operations only."
        )
    if "same device" in text or ("device" in text and ("cuda" in text or "mps" in text)):
        return ModelError(
            f"The model and its inputs are on different devices ({first}). batchjac moves the "
            f"inputs to the device of the model's first parameter; for a plain function pass "
            f"backend_options={{'device': 'cuda'}} (or the device its tensors live on)."
        )
    dtype_hint = ""
    lower = text.lower()
    if any(t in lower for t in ("double", "float64", "float32", "half")) and \
            any(t in lower for t in ("dtype", "scalar type", "same type")):
        dtype_hint = (f" The compute dtype is {np.dtype(sig.dtype).name}; the model holds "
                      f"tensors of another float dtype. Pass the torch.nn.Module itself "
                      f"(batchjac then casts its weights), or choose `dtype` to match.")
    return ModelError(f"Calling the model failed: {text[:2000]}.{dtype_hint}")


# -- second order ---------------------------------------------------------------------------
# PyTorch second-order kernels: per-instance Hessians, their diagonal, the Laplacian, and
# Hessian-vector products.
#
# As the first-order kernels (:mod:`batchjac._backends.torch`), they run the model on its
# ordinary batch and broadcast each basis vector over the rows: rows are independent (the
# probes check it), so the derivative of the batch along ``e_j`` broadcast is every instance's
# derivative along ``e_j``. That is what ``vmap(jacfwd(jacrev(f)))`` computes per instance,
# without batching the primal pass:
#
# - forward over reverse (the default for full Hessians and products): ``torch.func.vjp`` of
#   the chunk with ``vmap`` over the outputs' basis gives the Jacobians (one forward pass); a
#   ``torch.func.jvp`` of that function, ``vmap``-ed over the unknowns' basis, differentiates
#   them once more. ``hvp`` pushes the caller's tangents ``v`` instead of the basis: one pass.
# - forward over forward: ``jvp`` of ``jvp``. Along the same tangent ``e_j`` twice it gives
#   ``d2 f / dx_j^2`` (the diagonal) and never holds a ``k x k`` block; summed, the Laplacian.
#   Along ``e_i`` then ``e_j`` it gives the full Hessian in ``k^2`` passes (fewer than forward
#   over reverse's ``m k`` when the outputs outnumber the unknowns).


class TorchSecondKernel(Kernel):
    """One of :data:`~batchjac._backends._base.SecondKind` over chunks of ``chunk_size`` rows."""

    def __init__(self, bound: TorchBound, kind: SecondKind, order: Order, chunk_size: int,
                 with_outputs: bool, with_jacobian: bool) -> None:
        self.mode = "forward"  # the outer differentiation is forward mode in both orders
        self.kind, self.order = kind, order
        self.chunk_size, self.with_outputs, self.with_jacobian = chunk_size, with_outputs, with_jacobian
        self._bound = bound
        bound.trace_count += 1
        # (forward mode's decompositions, 0.37 s in a fresh process, are loaded where
        # torch.func's forward mode runs: the forward Laplacian and plain autograd need none)
        self.note = f"{kind}: {order}"
        #: the forward Laplacian's graph of the model per input shapes, with the weights'
        #: identities and versions it was traced with (a graph holds the weights it saw)
        self._graphs: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        #: why the forward Laplacian could not run for this model (the order's own then)
        self.laplacian_failed = ""
        if kind == "laplacian":
            # the forward Laplacian (one pass, see batchjac._backends.torch.laplacian), whose
            # trace into ATen operations costs one forward pass of a block, or the order's own
            # computation, whose torch.func passes import torch._dynamo on their first use
            # (W7, fresh processes, first calls: 1,000 rows 36 ms against 1.72 s, 100,000
            # rows 1.5 against 4.0 s): the first untimed, the other timed against it only
            # when the tuning policy says the work repays a race
            self.variants = ("plain", "forward-laplacian")
            self.variant = None
        elif order == "forward-over-reverse" and self._autograd_passes() <= self.AUTOGRAD_PASSES:
            # plain autograd first (it imports nothing), torch.func's vmap-ed passes timed
            # against it once the work repays a race
            self.variants = ("autograd", "plain")
            self.variant = None

    #: forward over reverse on plain autograd (:meth:`_autograd_over_reverse`) is a build
    #: where it takes at most this many backward passes a chunk (a Python loop over them)
    AUTOGRAD_PASSES = 64

    def _autograd_passes(self) -> int:
        """Backward passes of :meth:`_autograd_over_reverse`: one per output, and per output
        one more per unknown (one for a Hessian-vector product)."""
        out_shape = self._bound.output_shape
        m = math.prod(out_shape) if out_shape is not None else self.AUTOGRAD_PASSES + 1
        k = math.prod(self._bound.signature.unknown_shape)
        return m * (2 if self.kind == "hvp" else k + 1)

    @property
    def cheap_first(self) -> str | None:
        if self.kind == "laplacian":
            return self.variants[-1]  # the forward Laplacian, "plain" where it failed
        return "autograd" if "autograd" in self.variants else None

    #: rows of the chunk the race times each build on (an eager kernel runs any size): a
    #: chunk of W7's 100,000 rows takes ~2 s, and a race calls each build several times. Not
    #: fewer: on a loaded machine the forward Laplacian's many small operations lose more to
    #: scheduling on small chunks (W7 in chunks of 2,000: 0.93x the native trace, one chunk
    #: of 20,000: 0.5x), and a race on 4,096 rows once kept the slower build
    RACE_ROWS = 16384

    def _select(self, variant: str, note: str) -> None:
        what = "a forward Laplacian (one pass)" if variant == "forward-laplacian" else variant
        if self.laplacian_failed and variant == "plain":
            note = f"{note}; {self.laplacian_failed}"
        self.variant, self.note = variant, f"{self.kind}: {self.order}, {what} ({note})"

    def _first_call(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
        from .._base import race_allowed, untimed_note

        chosen = self._bound.__dict__.get("_laplacian_build")
        if self._forced is not None:
            self._select(self._forced, self._forced_why)
        elif chosen is not None and chosen in self.variants:
            # as a race chose for another chunk size of this model (the ladder of chunk sizes
            # compares the sizes on one build)
            self._select(chosen, "as timed for another chunk size")
        elif race_allowed():
            self._race(u, ctx)
        else:
            if "forward-laplacian" in self.variants:
                # (where it cannot be traced, _compute computes the plain build and says why)
                self._select("forward-laplacian", f"{untimed_note()}; its trace costs a "
                                                  f"forward pass, the plain build's first "
                                                  f"use imports torch._dynamo")
            elif "autograd" in self.variants:
                self._select("autograd", f"plain autograd: torch.func would load "
                                         f"torch._dynamo first; {untimed_note()}")
            else:
                self._select("plain", untimed_note())
            self.untimed = True

    def retune(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        if not self.untimed or self._forced is not None or len(self.variants) < 2:
            return
        self.untimed = False
        bound = self._bound
        ut, ct = bound.tensors(u, ctx)
        with bound.calling(), _FORWARD_AD:
            self._race(ut, ct)

    def _race(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
        rows = min(u.shape[0], self.RACE_ROWS)
        u, ctx = u[:rows], tuple(c[:rows] for c in ctx)
        if "forward-laplacian" in self.variants and self._forward_laplacian(u, ctx) is None:
            self._select("plain", "the forward Laplacian failed")
            return
        if "autograd" in self.variants and self._autograd_over_reverse(u, ctx, None) is None:
            self._select("plain", self.autograd_failed)
            return

        v = torch.ones_like(u) if self.kind == "hvp" else None  # (any tangents: timed alike)

        def run(variant: str) -> None:
            self.variant = variant
            self._compute(u, ctx, v)

        times = race(run, self.variants)
        best = min(times, key=lambda v: times[v])
        timed = ", ".join(f"{v} {t * 1e3:.1f} ms" for v, t in times.items())
        self._select(best, f"timed {rows} rows: {timed}")
        if self.kind == "laplacian":
            self._bound.__dict__["_laplacian_build"] = best

    # a mapping of named arrays, which the runner takes as it takes a Jacobian kernel's pair
    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]  # type: ignore[override]
                 ) -> dict[str, np.ndarray]:
        bound = self._bound
        v: torch.Tensor | None = None
        if self.kind == "hvp":
            ctx, v = ctx[:-1], bound.tensors(ctx[-1], ())[0]
        ut, ct = bound.tensors(u, ctx)
        with bound.calling(), _FORWARD_AD:
            try:
                if self.variant is None:
                    self._first_call(ut, ct)
                y, jac, second = self._compute(ut, ct, v)
            except (BatchJacError, Warning):
                raise
            except Exception as e:
                raise _explain_model_failure(e, bound.signature) from e
        out = {SECOND_RESULT[self.kind]: second}
        if self.with_outputs:
            out["outputs"] = y
        if self.with_jacobian:
            out["jacobians"] = jac
        if isinstance(u, torch.Tensor):  # tensors in, tensors out, on the device
            return {name: t.detach() for name, t in out.items()}
        return {name: _to_numpy(t) for name, t in out.items()}

    # -- the computations --------------------------------------------------------------------
    def _compute(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], v: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(y, J, result)``; ``J`` is ``(rows, *out, *unk)``."""
        if self.variant == "forward-laplacian":
            found = self._forward_laplacian(u, ctx)
            if found is not None:
                return found
            self._select("plain", "the forward Laplacian failed")
        if self.variant == "autograd":
            found = self._autograd_over_reverse(u, ctx, v)
            if found is not None:
                return found
            self._select("plain", self.autograd_failed)
        self._guard(u, ctx)
        _load_forward_ad()  # (torch.func's forward mode, from here on)
        if self.kind in ("diagonal", "laplacian") and self.order == "forward-over-forward":
            return self._diagonal_ff(u, ctx)
        if self.kind == "hessian" and self.order == "forward-over-forward":
            return self._hessian_ff(u, ctx)
        if v is not None and self.order == "forward-over-forward":
            return self._hvp_ff(u, ctx, v)
        try:
            return self._over_reverse(u, ctx, v)
        except (BatchJacError, Warning):
            raise
        except Exception as e:
            once = self._once(u, ctx)
            if once:
                raise self._not_twice(once, e) from e
            if any(not form for _, form in self._custom(u, ctx).values()) and \
                    self.variant != "autograd" and "autograd" not in self.autograd_failed:
                # a Function torch.func refuses (forward(ctx, ...), or no jvp) whose backward
                # autograd records: plain autograd's forward over reverse (the Laplacian's
                # kernel has no such build of its own)
                found = self._autograd_over_reverse(u, ctx, v)
                if found is not None:
                    self.variants = ("autograd",)
                    self._select("autograd", f"torch.func failed: {_first_sentence(e)}")
                    return found
            raise

    #: why forward over reverse on plain autograd could not run for this model
    autograd_failed = ""
    #: the custom autograd Functions between the unknowns and the output (see
    #: :func:`_custom_functions`), found on the first chunk's first row
    _functions: dict[str, tuple[bool, bool]] | None = None

    def _custom(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                ) -> dict[str, tuple[bool, bool]]:
        """The custom Functions of the model's graph from the unknowns (one forward pass of
        one row, once): second derivatives through them need care (:meth:`_guard`)."""
        if self._functions is None:
            self._functions = {}
            with contextlib.suppress(Exception), torch.enable_grad(), _unknowns_require_grad():
                x = u[:1].detach().requires_grad_(True)
                self._functions = _custom_functions(
                    self._bound.apply(x, tuple(c[:1] for c in ctx)), x)
        return self._functions

    def _once(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], *, func_form: bool = True
              ) -> list[str]:
        """The Functions whose backward is ``@once_differentiable`` (of them, with
        ``func_form=False``, those torch.func cannot differentiate either)."""
        return sorted(name for name, (once, form) in self._custom(u, ctx).items()
                      if once and (func_form or not form))

    def _not_twice(self, names: list[str], cause: Exception) -> ModelError:
        one = len(names) == 1
        what = ("is a custom torch.autograd.Function whose backward is" if one else
                "are custom torch.autograd.Functions whose backwards are")
        err = ModelError(
            f"The model is not twice differentiable: {_quoted(names)} {what} "
            f"marked @once_differentiable, so plain autograd cannot differentiate "
            f"{'it' if one else 'them'} again (it would read the gradient as constant: a zero "
            f"Hessian), and torch.func, which can, failed: {_first_sentence(cause)}. Make the "
            f"backward differentiable (drop @once_differentiable; write it with torch "
            f"operations), or give the Function torch.func's form (setup_context and jvp "
            f"staticmethods). batchjac.jacobian (first derivatives) works with it as it is.")
        err.__cause__ = cause
        return err

    def _guard(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
        """Before torch.func's second-order passes: forward over forward pushes a tangent
        through a custom Function's ``jvp`` twice, and torch's nested forward mode loses the
        second-order terms there (zeros, whatever the backward): a clear error instead."""
        if self.order != "forward-over-forward":
            return
        names = sorted(self._custom(u, ctx))
        if names:
            one = len(names) == 1
            raise OrderFailedError(
                f"Second derivatives cannot be computed with mode='forward-over-forward' for "
                f"this model: {_quoted(names)} "
                f"{'is a custom torch.autograd.Function' if one else 'are custom torch.autograd.Functions'}"
                f", and torch's forward mode loses the second-order terms of a Function's jvp "
                f"(they would come out zero). Pass mode='forward-over-reverse' (or 'auto')"
                + (" (a backward marked @once_differentiable must then be differentiable, or "
                   "its Function have setup_context and jvp staticmethods)"
                   if self._once(u, ctx, func_form=False) else "") + ".")

    def _autograd_over_reverse(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...],
                               v: torch.Tensor | None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(y, J, result)`` forward over reverse on plain autograd: one forward pass of the
        chunk; per output ``o``, the backward pass of ``sum_rows y[:, o]`` with ``create_graph``
        (rows are independent, which the probes check: row ``i``'s gradient is its Jacobian
        row ``g_o``), then per unknown ``j`` the backward pass of ``sum_rows g_o[:, j]``: row
        ``i``'s Hessian row (for ``hvp``, one pass of ``sum_rows g_o . v``). No torch.func, so
        nothing is imported: torch.func's passes load torch._dynamo through ``F.linear``'s
        decomposition on their first use. Measured here, fresh processes, batchjac.hessian's
        first and second calls: W6 (10,000 rows, 24 passes) 0.36 and 0.19 s against 1.48 and
        0.29 s with torch.func (the native vmap(jacfwd(jacrev)) 1.72 and 0.27 s); W7H (100,000
        rows, 4 passes) 2.3 and 2.3 s against 3.8 and 2.9 s. None where a double-backward pass fails for this
        model (the note says why; torch.func's build then, which may not fail alike)."""
        bound = self._bound
        k, m, out_shape, ushape = self._shapes(u)
        rows = u.shape[0]
        once = self._once(u, ctx)
        if once:
            # its gradient does not require grad (or its graph ends in torch's error node,
            # off the path to the unknowns): read as constant, it would give zeros
            self.autograd_failed = (f"plain autograd cannot differentiate the "
                                    f"@once_differentiable backward of {_quoted(once)}")
            self.variants = ("plain",)
            return None
        try:
            with torch.enable_grad(), _unknowns_require_grad():
                x = u.detach().requires_grad_(True)
                y = bound.apply(x, ctx)
                flat = y.reshape(rows, m)
                jac = x.new_zeros((rows, m, k))
                second = x.new_zeros((rows, m, k) if v is not None else (rows, m, k, k))
                tangents = v.reshape(rows, k) if v is not None else None
                for o in range(m if y.requires_grad else 0):  # (no path from u: zeros)
                    (g,) = torch.autograd.grad(flat[:, o].sum(), x, retain_graph=True,
                                               create_graph=True, allow_unused=True,
                                               materialize_grads=True)
                    g = g.reshape(rows, k)
                    jac[:, o] = g.detach()
                    if not g.requires_grad:  # the gradient is constant: a zero Hessian
                        continue  # (not twice differentiable: refused above)
                    for j in range(k if tangents is None else 1):
                        seed = g[:, j] if tangents is None else (g * tangents).sum(-1)
                        (h,) = torch.autograd.grad(seed.sum(), x, retain_graph=True,
                                                   allow_unused=True, materialize_grads=True)
                        if tangents is None:
                            second[:, o, j] = h.reshape(rows, k)
                        else:
                            second[:, o] = h.reshape(rows, k)
        except (BatchJacError, Warning):
            raise
        except Exception as e:
            self.autograd_failed = f"plain autograd failed: {_first_line(e)[:200]}"
            self.variants = ("plain",)
            return None
        y, jac = y.detach(), jac.reshape(rows, *out_shape, *ushape)
        if v is not None:
            return y, jac, second.reshape(rows, *out_shape, *ushape)
        return y, jac, self._of_hessian(second, out_shape, ushape)

    #: the forward Laplacian runs a chunk on the CPU in blocks of rows whose values, each
    #: carrying ``k + 1`` derivatives, keep about this many of the widest within the CPU's
    #: last-level cache (``batchjac._config.cache_bytes``): an eager kernel's operations each
    #: read and write whole arrays, from memory once they outgrow it. W7 (k=3, 128 wide,
    #: float32: ~6 KB a row, blocks of ~5,300 rows): one chunk of 100,000 rows 1.3 s in one
    #: block, 0.5 s in blocks (chunks of 6,252 rows took 5.0 us a row, of 25,008 7.0, of
    #: 100,032 12.8)
    LAPLACIAN_LIVE_VALUES = 3
    #: rows of the small trace that measures the widest value, and the fewest rows a block
    #: (fewer are dispatch-bound: each operation is a Python call)
    PROBE_ROWS, MIN_BLOCK_ROWS = 64, 256

    def _forward_laplacian(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(y, J, Laplacian)`` in one forward pass (:mod:`.laplacian`), in blocks of
        rows (:meth:`_block_rows`), or None where the model cannot be traced into ATen
        operations or one of them has no forward derivative (the note says why; the order's
        own build then, the same values)."""
        from . import laplacian

        k, m, out_shape, ushape = self._shapes(u)
        rows = u.shape[0]
        try:
            block = self._block_rows(u, ctx, k)
            parts = []
            for s in range(0, rows, block):
                us, cs = u[s:s + block], tuple(c[s:s + block] for c in ctx)
                parts.append(laplacian.run(self._tape(us, cs), [us, *cs], 0))
        except (BatchJacError, Warning):
            raise
        except Exception as e:
            self._graphs.clear()
            self.laplacian_failed = f"forward Laplacian: {_first_line(e)[:200]}"
            self.variants = ("plain",)
            return None
        if len(parts) == 1:
            y, dy, lap = parts[0]
        else:
            y, lap = (torch.cat([p[i] for p in parts]) for i in (0, 2))
            dy = torch.cat([p[1] for p in parts], dim=1)
        jac = dy.reshape(k, rows, m).permute(1, 2, 0).reshape(rows, *out_shape, *ushape)
        return y, jac, lap.reshape(rows, *out_shape)

    def _tape(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> Any:
        """The model's ATen operations for these shapes, recorded once (again where the
        weights changed: a tape holds the weights it saw)."""
        from . import laplacian

        bound = self._bound
        weights = tuple((id(t), t._version) for t in _weights(bound))
        key = (tuple(u.shape), *(tuple(c.shape) for c in ctx))
        tape, seen = self._graphs.get(key, (None, None))
        if tape is None or seen != weights:
            tape = laplacian.trace(lambda a, *c: bound.apply(a, c), u, *ctx)
            self._graphs[key] = (tape, weights)
        return tape

    def _block_rows(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], k: int) -> int:
        """Rows a block of the forward Laplacian (:data:`LAPLACIAN_LIVE_VALUES`), evened over
        the chunk; the whole chunk on an accelerator, or where it is small."""
        from ..._config import cache_bytes

        rows = u.shape[0]
        if u.device.type != "cpu" or rows <= 2 * self.MIN_BLOCK_ROWS:
            return rows
        probe = self.PROBE_ROWS
        tape = self._tape(u[:probe], tuple(c[:probe] for c in ctx))
        per_row = self.LAPLACIAN_LIVE_VALUES * (k + 1) * tape.widest / probe
        fit = max(self.MIN_BLOCK_ROWS, int(cache_bytes() // max(per_row, 1.0)))
        if fit >= rows:
            return rows
        return -(-rows // -(-rows // fit))

    def _hvp_ff(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(H v)_i``: the derivative along ``v`` of the derivative along ``e_i``, for each
        of the ``k`` unit tangents (``k`` passes; forward over reverse takes one)."""
        bound = self._bound
        k, m, out_shape, ushape = self._shapes(u)
        rows = u.shape[0]

        def along(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            def first(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                out = torch.func.jvp(lambda b: bound.apply(b, ctx), (a,), (t,))
                return out[1], out[0]
            out: Any = torch.func.jvp(first, (u,), (v,), has_aux=True)
            return out[2], out[0], out[1]

        tangents = _basis(k, rows, ushape, u.dtype, u.device)
        y, dys, hvs = torch.func.vmap(along, out_dims=(None, 0, 0))(tangents)  # type: ignore[arg-type]
        jac = dys.reshape(k, rows, m).permute(1, 2, 0).reshape(rows, *out_shape, *ushape)
        return y, jac, hvs.reshape(k, rows, m).permute(1, 2, 0).reshape(rows, *out_shape, *ushape)

    def _shapes(self, u: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        out_shape = self._bound.output_shape
        assert out_shape is not None
        ushape = tuple(u.shape[1:])
        return math.prod(ushape), math.prod(out_shape), tuple(out_shape), ushape

    def _over_reverse(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], v: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bound = self._bound
        k, m, out_shape, ushape = self._shapes(u)
        rows = u.shape[0]
        cot = _basis(m, rows, out_shape, u.dtype, u.device)

        def jac_t(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y, pull = torch.func.vjp(lambda b: bound.apply(b, ctx), a)[:2]
            (jt,) = torch.func.vmap(pull)(cot)  # (m, rows, *unk)
            return jt, y

        def push(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            out: Any = torch.func.jvp(jac_t, (u,), (t,), has_aux=True)  # (primal, jvp, aux)
            return out[0], out[1], out[2]  # (J, its derivative along t, y)

        if v is not None:  # one tangent per instance: H[i] v[i]
            jt, hv, y = push(v)
            jac = jt.movedim(0, 1).reshape(rows, *out_shape, *ushape)
            return y, jac, hv.movedim(0, 1).reshape(rows, *out_shape, *ushape)
        tangents = _basis(k, rows, ushape, u.dtype, u.device)
        jt, ht, y = torch.func.vmap(push, out_dims=(None, 0, None))(tangents)  # type: ignore[arg-type]
        # ht: (k_j, m, rows, *unk_i) -> (rows, m, k_i, k_j)
        h = ht.reshape(k, m, rows, k).permute(2, 1, 3, 0)
        jac = jt.movedim(0, 1).reshape(rows, *out_shape, *ushape)
        return y, jac, self._of_hessian(h, out_shape, ushape)

    def _of_hessian(self, h: torch.Tensor, out_shape: tuple[int, ...], ushape: tuple[int, ...]
                    ) -> torch.Tensor:
        """The kind's result from the Hessians ``h`` (rows, m, k, k): themselves, their
        diagonal or its sum, shaped per instance."""
        rows = h.shape[0]
        if self.kind == "hessian":
            return h.reshape(rows, *out_shape, *ushape, *ushape)
        diag = torch.diagonal(h, dim1=-2, dim2=-1)  # (rows, m, k)
        if self.kind == "diagonal":
            return diag.reshape(rows, *out_shape, *ushape)
        return diag.sum(-1).reshape(rows, *out_shape)

    def _diagonal_ff(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bound = self._bound
        k, m, out_shape, ushape = self._shapes(u)
        rows = u.shape[0]

        def twice(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            def first(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                out = torch.func.jvp(lambda b: bound.apply(b, ctx), (a,), (t,))
                return out[1], out[0]
            out: Any = torch.func.jvp(first, (u,), (t,), has_aux=True)
            return out[2], out[0], out[1]  # (y, dy along t, d2y along t twice)

        tangents = _basis(k, rows, ushape, u.dtype, u.device)
        y, dys, d2ys = torch.func.vmap(twice, out_dims=(None, 0, 0))(tangents)  # type: ignore[arg-type]
        # (k, rows, *out) -> (rows, *out, k)
        jac = dys.reshape(k, rows, m).permute(1, 2, 0).reshape(rows, *out_shape, *ushape)
        diag = d2ys.reshape(k, rows, m).permute(1, 2, 0)
        if self.kind == "diagonal":
            return y, jac, diag.reshape(rows, *out_shape, *ushape)
        return y, jac, diag.sum(-1).reshape(rows, *out_shape)

    def _hessian_ff(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bound = self._bound
        k, m, out_shape, ushape = self._shapes(u)
        rows = u.shape[0]
        tangents = _basis(k, rows, ushape, u.dtype, u.device)

        def column(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            def one(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                out = torch.func.jvp(lambda b: bound.apply(b, ctx), (a,), (t,))
                return out[1], out[0]
            dys, y = torch.func.vmap(one, out_dims=(0, None))(tangents)  # type: ignore[arg-type]
            return dys, y  # dys: (k_i, rows, *out)

        def outer(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            out: Any = torch.func.jvp(column, (u,), (t,), has_aux=True)
            return out[2], out[0], out[1]

        y, dys, d2 = torch.func.vmap(outer, out_dims=(None, None, 0))(tangents)  # type: ignore[arg-type]
        # d2: (k_j, k_i, rows, *out) -> (rows, m, k_i, k_j)
        h = d2.reshape(k, k, rows, m).permute(2, 3, 1, 0)
        jac = dys.reshape(k, rows, m).permute(1, 2, 0).reshape(rows, *out_shape, *ushape)
        return y, jac, h.reshape(rows, *out_shape, *ushape, *ushape)



class TorchBackend(Backend):
    name = "torch"

    def device_options(self, model: Any, device: Any, options: dict[str, Any]) -> dict[str, Any]:
        """Tensors on ``device`` into a model with no parameters or buffers of its own (a plain
        function): compute on that device. A module computes where its parameters are."""
        module = _owner_module(model)
        owns = module is not None and (next(module.parameters(), None) is not None
                                       or next(module.buffers(), None) is not None)
        if "device" in options or owns or device is None:
            return options
        return {**options, "device": device}

    def bind(self, model: Any, signature: Signature, **options: Any) -> BoundModel:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise InputError(
                f"Unknown option(s) {unknown} for the torch backend; it takes {list(_OPTIONS)} "
                f"(e.g. backend_options={{'train_mode': True}})."
            )
        train_mode = options.get("train_mode", False)
        if not isinstance(train_mode, bool):
            raise InputError(f"backend option `train_mode` must be True or False; got "
                             f"{train_mode!r}.")
        device = options.get("device")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise InputError(f"backend option `device` must name a torch device such as "
                                 f"'cpu' or 'cuda:0'; got {device!r} ({e}).") from None
        if not callable(model):
            raise InputError(
                f"`model` must be a torch.nn.Module or a callable on torch tensors; got "
                f"{type(model).__name__}."
            )
        return TorchBound(model, signature, train_mode=train_mode, device=device)


BACKEND = TorchBackend()
