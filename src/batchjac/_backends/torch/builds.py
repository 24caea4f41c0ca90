"""The PyTorch backend's first-order builds and the kernel that chooses among them.

Forward mode: torch.func's ``vmap`` of ``jvp`` over the unknowns' basis ("vmap",
:func:`jac_forward`), or reverse mode transposed on plain autograd ("transposed",
:func:`jac_transposed`). Reverse mode: torch.func's ``vmap`` of the ``vjp`` pullback ("vmap",
:func:`jac_reverse`), plain autograd batched over the outputs' basis (for ``autograd.Function``
subclasses torch.func refuses), the chunk replicated once per output ("replicated",
:func:`_jac_replicated`) or a backward pass per output ("looped", :func:`_jac_looped`). Each
takes the bound model (:class:`batchjac._backends.torch.TorchBound`) whose ``apply`` runs the
model on the chunk; :class:`TorchKernel` finds what works for the model and picks the build.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from ..._errors import BatchJacError, ForwardModeFallbackWarning
from ..._tune import chooser
from ..._tune.chooser import Build, timings
from .._base import (
    UNTUNED,
    CallBudget,
    Kernel,
    Mode,
    asked_mode_failed,
    user_stacklevel,
)
from . import compat
from .errors import _FORWARD_CAUSE, _explain_model_failure, _first_line, _out_of_memory
from .state import _FORWARD_AD, _load_forward_ad
from .tensors import _basis, _to_numpy, _unknowns_require_grad

if TYPE_CHECKING:
    from . import TorchBound

Engine = Literal["func", "autograd", "replicated", "looped", "transposed", "mixed"]
#: the build that accumulates in mixed mode along the model's chain (:mod:`.chain`)
MIXED = "mixed"


def jac_forward(bound: TorchBound, u: torch.Tensor, ctx: tuple[torch.Tensor, ...],
                basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``basis`` is ``(k, rows, *unknown_shape)``: unit tangents broadcast over the rows."""
    def push(tangent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.func.jvp(lambda a: bound.apply(a, ctx), (u,), (tangent,))
        return out[0], out[1]

    # out_dims None: the primal output does not depend on the tangent, so it is unbatched
    y, jt = torch.func.vmap(push, out_dims=(None, 0))(basis)  # type: ignore[arg-type]
    # jt: (k, rows, *out)
    jac = jt.movedim(0, -1)
    return y, jac.reshape(*jac.shape[:-1], *bound.signature.unknown_shape)


def jac_transposed(bound: TorchBound, u: torch.Tensor, ctx: tuple[torch.Tensor, ...],
                   basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward mode on plain autograd, by transposing reverse mode: ``g(w) = J^T w`` (one
    backward pass with ``create_graph``) is linear in the cotangent ``w``, so its
    pullback along a unit tangent ``e_j`` is ``J e_j``: one batched double-backward pass
    over ``basis`` (``(k, rows, *unknown_shape)``) gives every column. It loads neither
    torch.func (whose forward mode imports torch._dynamo through ``F.linear``'s
    decomposition) nor the forward-mode decompositions, and ran faster than vmap(jvp)
    (measured: docs/thresholds.md, "PyTorch's reverse-mode builds")."""
    ushape = tuple(u.shape[1:])
    with torch.enable_grad(), _unknowns_require_grad():
        x = u.detach().requires_grad_(True)
        y = bound.apply(x, ctx)
        jt = None
        if y.requires_grad:
            _check_transposable(bound, y, x)
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


def _path_functions(bound: TorchBound, y: torch.Tensor, x: torch.Tensor
                    ) -> dict[str, tuple[bool, bool]]:
    """The custom ``autograd.Function`` classes on the graph from ``x`` (the unknowns) to
    ``y`` (``second._custom_functions``), read once per bound model."""
    if bound.path_functions is None:
        from .second import _custom_functions

        bound.path_functions = _custom_functions(y, x) if y.requires_grad else {}
    return bound.path_functions


def _check_transposable(bound: TorchBound, y: torch.Tensor, x: torch.Tensor) -> None:
    """Raise where the graph from ``x`` to ``y`` holds a custom ``autograd.Function``: reverse
    mode transposed differentiates its backward pass in the cotangent, and nothing promises
    that a user's backward is differentiable there. One marked ``@once_differentiable`` (or one
    that detaches the cotangent, or leaves torch for numpy) gives zeros for its part, silently:
    a batched second pass (``is_grads_batched``) does not even raise the error a single one
    would."""
    found = _path_functions(bound, y, x)
    if found:
        raise RuntimeError(f"reverse mode transposed would differentiate the backward of the "
                           f"custom autograd.Function {', '.join(sorted(found))} again, which "
                           f"it may not support")


def _check_jvp(bound: TorchBound, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
    """Raise where the graph holds a custom ``autograd.Function`` without torch.func's form (a
    ``jvp`` and ``setup_context``): most raise in forward mode, but an operator of
    ``torch.library.custom_op`` with ``register_autograd`` only gives zero tangents, silently.
    The first time, the graph comes from one plain autograd pass over ``(u, ctx)``."""
    if bound.path_functions is None:
        with torch.enable_grad(), _unknowns_require_grad():
            x = u.detach().requires_grad_(True)
            _path_functions(bound, bound.apply(x, ctx), x)
    found = [name for name, (_, func_form) in (bound.path_functions or {}).items()
             if not func_form]
    if found:
        raise RuntimeError(f"the custom autograd.Function {', '.join(sorted(found))} has no "
                           f"forward-mode rule (jvp)")


def jac_reverse(bound: TorchBound, u: torch.Tensor, ctx: tuple[torch.Tensor, ...],
                basis: torch.Tensor | None, engine: Engine = "func"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``basis`` is ``(m, rows, *out)``: unit cotangents broadcast over the rows (None:
    built here). ``engine="func"`` is ``torch.func.vjp`` (the fastest); ``"autograd"`` is
    plain autograd, for ``autograd.Function`` subclasses that torch.func rejects."""
    if engine == "replicated":
        return _jac_replicated(bound, u, ctx)
    if engine == "looped":
        return _jac_looped(bound, u, ctx)
    if engine == "func":
        y, pull = torch.func.vjp(lambda a: bound.apply(a, ctx), u)[:2]
    else:
        with torch.enable_grad(), _unknowns_require_grad():
            x = u.detach().requires_grad_(True)
            y = bound.apply(x, ctx)
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
    # (torch.func's output is in the caller's graph where grad is on: a differentiable call's)
    return y if engine == "func" else y.detach(), jac.reshape(rows, *out_shape,
                                                              *bound.signature.unknown_shape)


def _jac_replicated(bound: TorchBound, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse mode with plain autograd and no vmap: the chunk repeated once per output,
    one forward and one backward pass, block ``i`` seeded with the unit cotangent ``e_i``
    (rows are independent, which the probes check). It computes the forward pass ``m``
    times, but skips torch.func's per-call Python work, which dominates small chunks of
    small models (measured: docs/thresholds.md, "PyTorch's reverse-mode builds")."""
    assert bound.output_shape is not None
    out_shape = bound.output_shape
    m, rows = math.prod(out_shape), u.shape[0]

    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat(m, *([1] * (t.ndim - 1)))

    with torch.enable_grad(), _unknowns_require_grad():
        x = rep(u.detach()).requires_grad_(True)
        y = bound.apply(x, tuple(rep(c) for c in ctx))
        if y.requires_grad:
            seed = _basis(m, rows, out_shape, y.dtype, y.device).reshape(m * rows, *out_shape)
            (g,) = torch.autograd.grad(y, x, seed, allow_unused=True, materialize_grads=True)
        else:  # no path from the unknowns at all (probes off): zero Jacobians
            g = torch.zeros_like(x)
    jac = g.reshape(m, rows, *u.shape[1:]).movedim(0, 1)
    return y[:rows].detach(), jac.reshape(rows, *out_shape, *bound.signature.unknown_shape)


def _jac_looped(bound: TorchBound, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], *,
                graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse mode with plain autograd and no vmap: one forward pass of the chunk, then
    one backward pass per output ``o`` of ``sum_rows y[:, o]`` (rows are independent,
    which the probes check, so its gradient at row ``i`` is row ``i``'s Jacobian row).
    It imports nothing (torch.func's vmap imports torch._dynamo on its first pullback),
    holds one copy of the activations (the replicated pass holds ``m``), and can run faster
    than vmap (measured: docs/thresholds.md, "PyTorch's reverse-mode builds").

    ``graph``: in the caller's graph (a differentiable call's chunk, which
    ``torch.utils.checkpoint`` recomputes, where torch.func's ``vjp`` refuses its hooks): on
    ``u`` itself where it requires grad, each backward pass with ``create_graph``, and the
    model's own pass hidden from a checkpoint's hooks, which would otherwise recompute the
    chunk inside each backward pass and keep every recomputation until the loss's gradient
    is taken (a pass's activations are small beside the backward passes' graphs)."""
    rows, ushape = u.shape[0], tuple(u.shape[1:])
    kept = torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is) if graph else \
        contextlib.nullcontext()
    with torch.enable_grad(), _unknowns_require_grad():
        with kept:
            x = u if graph and u.requires_grad else u.detach().requires_grad_(True)
            y = bound.apply(x, ctx)
        out_shape = tuple(y.shape[1:])
        m = math.prod(out_shape)
        jac = x.new_empty((rows, m, *ushape))
        if not y.requires_grad:  # no path from the unknowns at all (probes off)
            jac.zero_()
        else:
            flat = y.reshape(rows, m)
            for o in range(m):
                (g,) = torch.autograd.grad(flat[:, o].sum(), x, retain_graph=graph or o < m - 1,
                                           create_graph=graph, allow_unused=True,
                                           materialize_grads=True)
                jac[:, o] = g
    return y if graph else y.detach(), jac.reshape(rows, *out_shape,
                                                   *bound.signature.unknown_shape)


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


class TorchKernel(Kernel):
    """Forward or reverse mode over chunks of ``chunk_size`` rows. The first call finds the
    fastest path that works for this model: forward mode falls back to reverse mode (with one
    warning), and torch.func's reverse mode to plain autograd (same values, no warning).

    Reverse mode has three implementations: torch.func's ``vmap`` of ``vjp`` ("vmap"), one
    backward pass through the chunk repeated once per output ("replicated", see
    :func:`_jac_replicated`) and one forward pass with a backward pass per output
    ("looped", :func:`_jac_looped`). "replicated" wins on small chunks, "looped" on large
    ones (measured: docs/thresholds.md, "PyTorch's reverse-mode builds"). A first call whose
    work repays a race times "vmap" against "looped", and "replicated" too
    when a chunk takes less than ``REPLICATED_BELOW`` (:func:`~batchjac._tune.chooser.race`),
    unless a variant was fixed with :meth:`use` (stores, reproducible solves) or
    ``BATCHJAC_AUTOTUNE=off``: then "vmap". A first call too small to repay a race runs a
    plain-autograd build untimed (:meth:`_first_plain`).
    """

    #: "replicated" is timed only against chunks faster than this (where the Python work
    #: around torch.func matters), never on large chunks (it holds m copies of the chunk)
    REPLICATED_BELOW = 0.005

    def __init__(self, bound: TorchBound, mode: Mode, chunk_size: int, with_outputs: bool,
                 budget: CallBudget = UNTUNED) -> None:
        self.mode, self.chunk_size, self.with_outputs = mode, chunk_size, with_outputs
        #: the rows of the call the kernel is made for, and then first called by
        self._rows = budget.rows
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
        if not budget.mode_asked and bound.accumulation() is not None:
            self.variants = (MIXED, *self.variants)  # (its first: a new store's too)
        self.variant = None

    def _select(self, variant: str, note: str) -> None:
        if self._path is not None and self._path[1] in _PLAIN_ENGINES:
            self._path = (self._path[0], _VARIANT_ENGINE.get(variant, "func"))
        super()._select(variant, note)

    def _run(self, path: tuple[Mode, Engine], u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if path[1] == "mixed":
            return self._mixed(u, ctx)
        if path == ("forward", "transposed"):
            return jac_transposed(self._bound, u, ctx, self._in_basis)
        if path[0] == "forward":
            _check_jvp(self._bound, u, ctx)
            _load_forward_ad()  # (only torch.func's forward mode needs them, and they load slowly)
            with _FORWARD_AD:
                return jac_forward(self._bound, u, ctx, self._in_basis)
        return jac_reverse(self._bound, u, ctx, self._out_basis, path[1])

    def _mixed(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's Jacobians accumulated along the model's chain (:mod:`.chain`): its
        pieces in forward mode need torch's forward-mode decompositions."""
        from . import chain

        found = self._bound.accumulation()
        assert found is not None
        read, plan = found
        tape = chain.current(read, self._bound)
        _load_forward_ad()
        with _FORWARD_AD, torch.no_grad():
            return chain.jacobians(read, plan, tape, u, ctx)

    def _first_mixed(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], budget: CallBudget
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first call in mixed mode, where the model offers it
        (:meth:`~batchjac._backends.torch.TorchBound.accumulation`), the call asked for no
        mode and no other build was fixed: untimed, the pure builds raced later where the
        count is unsure (:data:`batchjac._chain.SURE_GAIN`). None where it is not offered, or
        fails for the model (a pure build then computes)."""
        from .._base import untimed_note

        bound = self._bound
        if budget.mode_asked or self._forced not in (None, MIXED):
            return None
        found = bound.accumulation()
        if found is None:
            return None
        try:
            out = self._run((self.mode, "mixed"), u, ctx)
        except (BatchJacError, Warning):
            raise
        except Exception as e:  # an operation the pieces cannot re-run: no mixed build
            bound.__dict__["_accumulation"] = None
            self.mixed_failure = _first_line(e)
            self.variants = tuple(v for v in self.variants if v != MIXED)
            return None
        plan = found[1]
        self._path, self.variant = (self.mode, "mixed"), MIXED
        if self._forced == MIXED:
            self.note = f"{MIXED} ({self._forced_why})"
        elif plan.sure:
            self.variants = (MIXED,)
            self.note = (f"{MIXED} (the model's chain as the plan says; counted "
                         f"{plan.gain:.1f}x ahead of the better pure mode: the pure builds "
                         f"are not raced)")
        else:
            self.variants = (MIXED, "vmap")
            self.untimed = True
            self.note = (f"{MIXED} (the model's chain as the plan says; counted "
                         f"{plan.gain:.1f}x ahead of the better pure mode: the pure build "
                         f"races it once the work repays it; {untimed_note()})")
        return out

    #: why the "mixed" build could not run for this model, where it could not
    mixed_failure = ""

    def call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget = UNTUNED
             ) -> tuple[np.ndarray | None, np.ndarray]:
        bound = self._bound
        ut, ct = bound.tensors(u, ctx)
        with bound.calling():
            first = None
            if self._path is None:
                with self.building:  # (threads sharing the kernel: one chooses its path)
                    if self._path is None:
                        first = self._establish(ut, ct, budget)
            path = self._path
            if first is not None:
                y, jac = first
            else:
                assert path is not None
                if path[0] != self.planned and budget.mode_asked:
                    raise asked_mode_failed(self.planned, str(bound.forward_failure), _FORWARD_CAUSE)
                y, jac = self._run(path, ut, ct)
        if isinstance(u, torch.Tensor):  # tensors in, tensors out, on the device
            return (y if self.with_outputs else None), jac
        return (_to_numpy(y) if self.with_outputs else None), _to_numpy(jac)

    # -- the builds as the chooser (:mod:`batchjac._tune.chooser`) sees them, on the path the
    # first call found: torch.func's vmap runs without a race; forward mode's transposed pass,
    # reverse mode's replicated and looped passes challenge it

    #: about how long a race of this kernel's builds takes in all (cheaper than the compiled
    #: frameworks': an eager build costs nothing to make, so a race is mostly timing)
    RACE_SECONDS = 0.1
    race_options = {"timing_seconds": RACE_SECONDS}  # noqa: RUF012 - read only
    #: the later race runs on the user's calls, its results theirs (:class:`~batchjac._tune.chooser.CallRace`)
    races_on_calls = True

    @property
    def race_setup_seconds(self) -> float:
        """torch._dynamo's import, where a contender is torch.func's and it is not loaded."""
        torch_func = "vmap" in self.variants and self.variant != "vmap"
        return compat.DYNAMO_IMPORT_SECONDS if torch_func and not compat.dynamo_loaded() else 0.0

    def build(self, name: str) -> Build:
        if MIXED in self.variants:  # the pure build challenges the mixed one
            return Build(name, int(name != MIXED))
        return Build(name, int(name != "vmap"))

    @property
    def retunable(self) -> bool:
        """An untimed plain-autograd first build: the race against torch.func's it skipped;
        an untimed mixed one, the race against the pure build."""
        path = self._path
        if path is not None and path[1] == "mixed":
            return len(self.variants) > 1
        if path == ("forward", "transposed"):
            return True
        return path is not None and path[0] == "reverse" and path[1] in _PLAIN_ENGINES \
            and "replicated" in self.variants

    @contextlib.contextmanager
    def timing(self, u: Any, ctx: tuple[Any, ...]) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        bound = self._bound
        ut, ct = bound.tensors(u, ctx)
        with bound.calling():
            yield ut, ct

    def untimed_first(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], budget: CallBudget
                      ) -> tuple[str, str, bool]:
        from .._base import untimed_note

        return "vmap", f"vmap ({untimed_note()})", True

    def contenders_beside(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                          ) -> tuple[str, ...]:
        """The later race's builds, none run beforehand (eager builds: nothing to make; one
        that fails for the model leaves the race on its call, which the build in use before
        answers again: ``chooser.failed_call``). Reverse mode admits "replicated" where a
        chunk of the build in use took under ``REPLICATED_BELOW`` (the ledger's seconds per
        row), as the first call's race admits it by torch.func's chunk."""
        assert self._path is not None
        if self._path[1] == "mixed":
            return self.variants
        if self._path[0] == "forward":
            return "vmap", "transposed"
        per_row = self._bound.tuning.ledger.seconds_per_row
        fast = per_row is not None and per_row * self.chunk_size < self.REPLICATED_BELOW
        self.variants = ("vmap", "replicated", "looped") if fast else ("vmap", "looped")
        return self.variants

    def contenders(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> tuple[str, ...]:
        assert self._path is not None
        if self._path[0] == "forward":
            return self._forward_contenders(u, ctx)
        return self._reverse_contenders(u, ctx)

    def _forward_contenders(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                            ) -> tuple[str, ...]:
        """"vmap" (torch.func's jvp) and "transposed" for a forward-mode kernel (both compute
        the same columns), those that run."""
        names = []
        for name in ("vmap", "transposed"):
            try:
                self.run_build(name, u, ctx)  # (warm up: torch.func's first call imports)
            except Exception:  # e.g. an operator without a double-backward rule
                continue
            names.append(name)
        if len(names) < 2:
            only = next(iter(names), "vmap")
            self._path, self.variant = ("forward", _VARIANT_ENGINE[only]), only
            self.variants = (only,)
            self.note = f"{only} (the other forward-mode build failed)"
            return ()
        return tuple(names)

    def _reverse_contenders(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                            ) -> tuple[str, ...]:
        """"vmap", "replicated" and "looped" for a reverse-mode kernel that runs with
        torch.func, those that run; "replicated" only for fast chunks (it holds m copies of
        the chunk)."""
        start = time.perf_counter()
        self._run(("reverse", "func"), u, ctx)
        took = time.perf_counter() - start
        rivals = ["looped"] if took >= self.REPLICATED_BELOW else ["replicated", "looped"]
        for name in list(rivals):
            try:
                self.run_build(name, u, ctx)  # warm up
            except Exception:  # e.g. a model that keeps state across rows: torch.func only
                rivals.remove(name)
        self.variants = ("vmap", *(v for v in self.variants if v in rivals))
        if not rivals:
            self._path, self.variant = ("reverse", "func"), "vmap"
            self.note = "vmap (the plain-autograd passes failed)"
            return ()
        return ("vmap", *rivals)

    def run_build(self, name: str, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
        assert self._path is not None
        self._run((self._path[0], _VARIANT_ENGINE[name]), u, ctx)

    def raced_to(self, best: str, times: dict[str, float], u: Any) -> None:
        assert self._path is not None
        self._path = (self._path[0], _VARIANT_ENGINE[best])
        self.variant = best
        self.note = f"{best} (timed one chunk: {timings(times)})"

    #: the replicated pass is a reverse-mode first call's build while it holds at most this
    #: many rows (the call's, or the chunk's where larger, times the outputs) and torch.func
    #: has not loaded torch._dynamo;
    #: past it the looped pass is (a larger limit made a wide model's warm first call slower
    #: than its cold one: docs/thresholds.md)
    REPLICATED_FIRST_ROWS = 2048

    def _establish(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], budget: CallBudget
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first call: the cheap plain-autograd build where it answers first
        (:meth:`_first_plain`), else the first path that works for the model (forward mode,
        then torch.func's reverse mode, then plain autograd's), then the chooser's choice
        between that path's builds. Returns the call's answer."""
        self._rows = budget.rows or self._rows
        out = self._first_mixed(u, ctx, budget)
        if out is not None:
            return out
        out = self._first_plain(u, ctx, budget)
        if out is not None:
            return out
        bound = self._bound
        paths: list[tuple[Mode, Engine]] = [("reverse", "func"), ("reverse", "autograd")]
        if bound.reverse_engine is not None:  # another kernel found what works
            paths = [("reverse", bound.reverse_engine)]
        if self.mode == "forward" and bound.forward_failure is None:
            # forward mode fails only where both of its builds fail: torch.func's jvp and
            # reverse mode transposed (an operator without a forward-mode formula may run
            # the second)
            forward: list[tuple[Mode, Engine]] = [("forward", "func")]
            if "transposed" in self.variants:
                forward.append(("forward", "transposed"))
            if bound.forward_engine is not None:  # another kernel found what works
                forward = [("forward", bound.forward_engine)]
            paths[:0] = forward
        last_forward = next((p for p in reversed(paths) if p[0] == "forward"), None)
        first: Exception | None = None
        for path in paths:
            try:
                out = self._run(path, u, ctx)
            except (BatchJacError, Warning):  # Warning: a warnings-as-errors run, not a failure
                raise
            except Exception as e:
                if _out_of_memory(e):
                    raise _explain_model_failure(e, bound.signature) from e
                first = first or e
                if path == last_forward:  # (both forward-mode builds failed)
                    bound.forward_failure = f"{type(first).__name__}: {_first_line(first)}"
                continue
            if path[0] == "reverse":
                bound.reverse_engine = path[1]
                if self.mode == "forward" and budget.mode_asked:
                    # asked for (as TensorFlow and JAX do): refuse, the failure being the mode's
                    raise asked_mode_failed("forward", str(bound.forward_failure),
                                            _FORWARD_CAUSE) from first
                if self.mode == "forward":
                    self._warn_fallback(budget)
            else:
                bound.forward_engine = path[1]
            self._path = path
            if path == ("forward", "transposed"):  # torch.func's jvp failed: the one build
                self.variant, self.variants = "transposed", ("transposed",)
                self.note = "transposed (torch.func's forward mode fails for this model)"
                return out
            self.variant = "vmap"
            if (path == ("reverse", "func") and "replicated" in self.variants) or \
                    (path == ("forward", "func") and "transposed" in self.variants):
                self.choose(u, ctx, budget)
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
            plain = "transposed" in self.variants and not compat.dynamo_loaded() \
                and bound.forward_failure is None and bound.reverse_engine in (None, "func")
            return "transposed" if plain else None
        if not (self.mode == "reverse" and "replicated" in self.variants
                and not compat.dynamo_loaded() and bound.reverse_engine in (None, "func")
                and bound.output_shape is not None):
            return None
        # (the call's rows: a large call cut into cache-sized chunks would otherwise run a
        # wide model's forward pass once per output in every chunk, replicated, and its first
        # call is slower than looped; measured: docs/thresholds.md, REPLICATED_FIRST_ROWS)
        rows = max(self.chunk_size, self._rows)
        small = math.prod(bound.output_shape) * rows <= self.REPLICATED_FIRST_ROWS
        return "replicated" if small else "looped"

    @property
    def cheap_first(self) -> str | None:
        """The build a first call takes when an earlier process's race chose another one
        (:func:`batchjac._tune.policy.recall_variant`): a plain-autograd build where it imports
        nothing and torch.func would import torch._dynamo (most of a warm small first call:
        docs/thresholds.md, "PyTorch's first calls"); the remembered build replaces it once
        the work repays it."""
        return self._plain_first()

    def _first_plain(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], budget: CallBudget
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An untimed reverse-mode first call on plain autograd, where that is the cheaper
        first answer: torch.func's reverse mode imports torch._dynamo when its first pullback
        runs, which can cost far more than a small job's whole computation (measured:
        docs/thresholds.md, "PyTorch's first calls"). Small chunks take the replicated pass,
        larger ones the looped pass (a backward pass per output, as fast as vmap or faster).
        The builds are raced later, once the work repays it (:meth:`retune`). None: the usual
        first call (a variant fixed, a race allowed, torch.func loaded already, another kernel
        of this model found that torch.func fails)."""
        from ..._config import autotune_enabled
        from .._base import untimed_note

        step = chooser.first_step(self, budget, builds=2)
        forced = step == "fixed" and self._bound.reverse_engine in (None, "func") and (
            (self._forced in ("replicated", "looped") and self.mode == "reverse")
            or (self._forced == "transposed" and self.mode == "forward"))
        build = self._forced if forced else \
            self._plain_first() if step == "untimed" and autotune_enabled() else None
        if build is None:
            return None
        engine = _VARIANT_ENGINE[build]
        mode: Mode = "forward" if build == "transposed" else "reverse"
        try:
            out = self._run((mode, engine), u, ctx)
        except (BatchJacError, Warning):
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

    def _warn_fallback(self, budget: CallBudget) -> None:
        self.mode = "reverse"
        bound = self._bound
        if bound.fallback_warned or budget.plan_race:
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
                                      "transposed": "transposed", MIXED: "mixed"}
_PLAIN_ENGINES = ("func", "replicated", "looped", "transposed")
