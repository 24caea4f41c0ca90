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
  autograd (``autograd.grad(..., is_grads_batched=True)``, a little slower).

The model always sees its ordinary batch, as in training code; no per-instance wrapper. On the
benchmark workloads this is as fast as ``vmap(jacrev)``/``vmap(jacfwd)`` or faster. The
Jacobians come back as views of the framework's layout (``(basis, rows, ...)`` moved to
``(rows, ..., basis)``), not copied: a copy costs a noticeable share of a large call.

``torch.compile`` is not used: it cuts the steady-state time of an MLP by a quarter to a
third, but its compilation takes seconds on a 2-core CPU, which a call must be thousands of
chunks long to win back (measured: docs/thresholds.md, "Measured choices").
Parameters are constants: kernels run under ``torch.no_grad()`` (torch.func transforms are
unaffected by it), so no graph is built for the weights and ``.grad`` is never touched.
"""

from __future__ import annotations

import contextlib
import math
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..._errors import (
    BatchJacError,
    ForwardModeFallbackWarning as ForwardModeFallbackWarning,
    InputError,
    ModelError,
    NotConnectedError,
    TrainingModeWarning as TrainingModeWarning,
)
from ..._keras_compat import is_keras
from ..._spec import assemble
from .._base import (
    UNTUNED,
    Backend,
    BoundModel,
    CallBudget,
    Kernel,
    Mode,
    Order,
    SecondKind,
    Signature,
    user_stacklevel,
)
from . import compat, kinds
from .builds import Engine, TorchKernel as TorchKernel
from .errors import _explain_model_failure
from .second import TorchSecondKernel as TorchSecondKernel
from .tensors import _to_numpy, _to_torch, _unknowns_require_grad

_OPTIONS = ("train_mode", "device")


class TorchOps:
    """torch tensors as the pipeline's arrays (:class:`batchjac._xp.ArrayOps`), on their
    device: what ``jacobian`` works with when torch tensors go into a torch model."""

    kind = "torch"

    def is_native(self, a: Any) -> bool:
        return isinstance(a, torch.Tensor)

    def dtype_of(self, a: Any) -> np.dtype:
        try:
            return np.dtype(str(a.dtype).removeprefix("torch."))
        # bfloat16 and the like: no numpy dtype (_validate.examine refuses them by name first)
        except TypeError:
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
        # (torch.isfinite(a).all() is four passes, a sizeable share of a call on a wide input);
        # only a sum that overflowed is checked entry by entry
        return not a.is_floating_point() or bool(torch.isfinite(a.sum())) or \
            bool(torch.isfinite(a).all())

    def any_nonzero(self, a: Any) -> bool:
        return bool(a.any())

    def is_traced(self, a: Any) -> bool:
        return False

    def to_numpy(self, a: Any) -> np.ndarray:
        return _to_numpy(a)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        return _to_torch(np.asarray(a), torch.device(device) if device is not None
                         else torch.device("cpu"))

    def to_device(self, a: Any, device: Any) -> Any:
        return a.to(device)


OPS = TorchOps()


class GraphOps(TorchOps):
    """:class:`TorchOps` that keep autograd's graph: a differentiable call's chunks are cut
    and cast from the caller's tensors, whose gradient must flow back through them."""

    def cast(self, a: Any, dtype: np.dtype) -> Any:
        return a.to(getattr(torch, np.dtype(dtype).name)).contiguous()

    def contiguous(self, a: Any) -> Any:
        return a.contiguous()


GRAPH_OPS = GraphOps()


def _owner_module(model: Any) -> torch.nn.Module | None:
    """The module whose state the model uses: the model itself, or ``module.method``."""
    if isinstance(model, torch.nn.Module):
        return model
    if isinstance(model, types.MethodType) and isinstance(model.__self__, torch.nn.Module):
        return model.__self__
    return None


def _set_eval(module: torch.nn.Module, flags: list[tuple[torch.nn.Module, bool]]) -> None:
    """``module.eval()``, without its per-module ``__setattr__`` (a few percent of a small
    MLP's call) unless some submodule overrides ``train`` and must see the call."""
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
    reductions_over_forward = False  # (see BoundModel; measured: docs/thresholds.md)
    hessian_outputs_at_once = False  # (see BoundModel: plain autograd, an output at a time)

    def __init__(self, model: Any, signature: Signature, *, train_mode: bool = False,
                 device: Any = None) -> None:
        super().__init__(signature)
        # a torch.compile'd model runs uncompiled: under torch.func's transforms TorchDynamo
        # compiles it again for each chunk shape and derivative, which a call does not win back
        plain = compat.uncompiled(model)
        if plain is not None:
            self.model_note = ("torch.compile'd: differentiated through the original module, "
                               "uncompiled (compiling each chunk shape costs more than it saves)")
            if not isinstance(plain, types.MethodType):  # (a module compiled in place: below)
                model = plain
        #: a Keras 3 model on the PyTorch backend (a torch.nn.Module): its inputs go in as
        #: Keras takes several, one list or one dict; one computing in half precision runs
        #: as its float32 clone (:mod:`.kinds`)
        self.is_keras = is_keras(model)
        self.model = kinds.keras_runner(model, signature) if self.is_keras else model
        if isinstance(self.model, kinds.KerasWidened):
            self.model_note = ("a Keras model computing in half precision: differentiated "
                               "through a float32 clone that reads its weights")
        self.module = _owner_module(model)
        #: what a plain call runs: the model, or a module compiled in place called uncompiled
        self._call = plain if isinstance(plain, types.MethodType) else self.model
        self.train_mode = train_mode
        self.dtype: torch.dtype = getattr(torch, np.dtype(signature.dtype).name)
        self.device = torch.device(device) if device is not None else _model_device(self.module)
        self._k = math.prod(signature.unknown_shape)
        # Parameters and buffers whose dtype differs from the compute dtype are run as cast
        # copies through torch.func.functional_call (the user's module is never changed).
        self._cast: dict[str, torch.Tensor] = {}
        self._cast_src: dict[str, tuple[torch.Tensor, int | None]] = {}
        self._mode_warned = False
        #: the second-order kernels of differentiable calls, by (kind, order): kept, so that
        #: their traced tapes serve the next training step (:mod:`.differentiable`)
        self.differentiable_kernels: dict[tuple[str, str], Any] = {}
        self._mode_lock = threading.Lock()
        self._active = 0  # calls in progress: the first switches to eval, the last restores
        self._flags: list[tuple[torch.nn.Module, bool]] = []
        self._perm: torch.Tensor | None = None  # layout.perm as an index tensor
        # what the first kernel call found out about this model (see TorchKernel._establish)
        self.forward_failure: str | None = None
        self.fallback_warned = False
        self.reverse_engine: Engine | None = None
        self.forward_engine: Engine | None = None  # (forward mode: what another kernel found works)
        #: the custom autograd.Functions between unknowns and outputs (None: not read yet)
        self.path_functions: dict[str, tuple[bool, bool]] | None = None
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
                old, version = self._cast_src.get(name), compat.version(src)
                # (a version that cannot be read is taken as changed: the copy is made again)
                if old is None or old[0] is not src or version is None or old[1] != version:
                    self._cast[name] = src.detach().to(self.dtype)
                    self._cast_src[name] = (src, version)
        for name in set(self._cast) - set(wanted):
            del self._cast[name], self._cast_src[name]
        return False  # the kernels take the cast weights as arguments: none is stale

    @contextlib.contextmanager
    def calling(self, grad: bool = False) -> Iterator[None]:
        """Eval mode (unless training is forced) for the call, then every submodule's own
        flag back; no autograd graph for the weights, unless ``grad`` (a differentiable
        call's: :mod:`.differentiable`)."""
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
            with contextlib.nullcontext() if grad else torch.no_grad():
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
        # layers whose output depends on training mode (batch statistics, random masks)
        layers = compat.mode_dependent_layers()
        found = [m for m, f in flags if f and isinstance(m, layers)]
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

    def accumulation(self) -> Any:
        """The model's chain and its bracketing where mixed mode is offered, read once from a
        recording of one row (:mod:`batchjac._backends.torch.chain`), else None."""
        if "_accumulation" not in self.__dict__:
            from . import chain

            self._accumulation = chain.read(self)
        return self._accumulation

    def linear_head(self) -> Any:
        """The model's linear head (:mod:`batchjac._backends.torch.head`), read once from a
        recording of one row (made again where the weights change), else None."""
        if "_linear_head" not in self.__dict__:
            from . import head

            self._linear_head = head.read(self)
        return self._linear_head

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
        if self.is_keras and (len(args) > 1 or kwargs):  # Keras takes a list, or a dict
            args, kwargs = ((list(args) if args else kwargs),), {}
        if state:
            y = torch.func.functional_call(self.model, state, args, kwargs)
        else:
            y = self._call(*args, **kwargs)
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
            if self.is_keras:
                raise ModelError(
                    f"float64 was asked for, but this Keras model on the PyTorch backend "
                    f"returned {y.dtype}: Keras computes in its layers' dtype and turns 64-bit "
                    f"results into 32-bit ones outside TensorFlow (keras.backend.result_type). "
                    f"Use dtype='float32', or run it with KERAS_BACKEND=tensorflow, where "
                    f"Keras computes in float64.")
            raise ModelError(
                f"float64 was asked for (dtype='float64' or float64 inputs), but the model "
                f"returned {y.dtype}: it computes in lower precision inside. Pass the "
                f"torch.nn.Module itself (batchjac runs a float64 copy of its weights), convert "
                f"what it uses with .double(), or use dtype='float32'."
            )
        return y if y.dtype == self.dtype else y.to(self.dtype)

    def product(self, kind: str, u: Any, ctx: tuple[Any, ...], t: Any) -> tuple[Any, Any]:
        from . import products

        return products.product(self, kind, u, ctx, t)

    # -- probes ------------------------------------------------------------------------------
    def forward(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        ut, ct = self.tensors(u, ctx)
        with self.calling():
            try:
                y = self._counted(ut, ct)
            except (BatchJacError, Warning):
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
            except (BatchJacError, Warning):
                raise
            except Exception as e:
                if "numpy()" in str(e):  # x.numpy() on the unknowns: the path is cut there
                    return False
                raise _explain_model_failure(e, self.signature) from e
            if not y.requires_grad:
                return False
            (grad,) = torch.autograd.grad(y.sum(), x, allow_unused=True)
        return grad is not None

    def differentiable(self, kind: str, how: str, *, with_outputs: bool, with_jacobian: bool,
                       recomputed: bool = False) -> Any:
        from .differentiable import derivatives

        return derivatives(self, kind, how, with_outputs, with_jacobian, recomputed)

    def rematerializes_reverse(self, kind: str) -> bool:
        # (torch.func's reverse transforms refuse the checkpoint's saved-tensor hooks: a
        # recomputed reverse-mode Jacobian is plain autograd's, the second-order reverse
        # orders are torch.func's)
        return kind == "jacobian"

    def rematerialized(self, fn: Any) -> Any:
        from .differentiable import checkpointed

        return checkpointed(fn)

    def differentiable_output_shape(self, u: Any, ctx: tuple[Any, ...]) -> tuple[int, ...]:
        with self.calling():
            try:
                y = self.apply(u, ctx)
            except (BatchJacError, Warning):
                raise
            except Exception as e:
                raise _explain_model_failure(e, self.signature) from e
        return tuple(y.shape[1:])

    def build_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool,
                     budget: CallBudget = UNTUNED) -> Kernel:
        return TorchKernel(self, mode, chunk_size, with_outputs, budget)

    def build_second_kernel(self, kind: SecondKind, order: Order, chunk_size: int,
                            with_outputs: bool, with_jacobian: bool) -> Kernel:
        return TorchSecondKernel(self, kind, order, chunk_size, with_outputs, with_jacobian)



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
