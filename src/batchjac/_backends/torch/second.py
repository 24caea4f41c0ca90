"""PyTorch second-order kernels: per-instance Hessians, their diagonal, the Laplacian, and
Hessian-vector products.

As the first-order kernels (:mod:`.builds`), they run the model on its
ordinary batch and broadcast each basis vector over the rows: rows are independent (the
probes check it), so the derivative of the batch along ``e_j`` broadcast is every instance's
derivative along ``e_j``. That is what ``vmap(jacfwd(jacrev(f)))`` computes per instance,
without batching the primal pass:

- forward over reverse (the default for full Hessians and products): ``torch.func.vjp`` of
  the chunk with ``vmap`` over the outputs' basis gives the Jacobians (one forward pass); a
  ``torch.func.jvp`` of that function, ``vmap``-ed over the unknowns' basis, differentiates
  them once more. ``hvp`` pushes the caller's tangents ``v`` instead of the basis: one pass.
- forward over forward: ``jvp`` of ``jvp``. Along the same tangent ``e_j`` twice it gives
  ``d2 f / dx_j^2`` (the diagonal) and never holds a ``k x k`` block; summed, the Laplacian.
  Along ``e_i`` then ``e_j`` it gives the full Hessian in ``k^2`` passes (fewer than forward
  over reverse's ``m k`` when the outputs outnumber the unknowns).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..._errors import BatchJacError, ModelError, OrderFailedError
from ..._tune.chooser import timings
from .._base import SECOND_RESULT, UNTUNED, CallBudget, Kernel, Order, SecondKind
from . import compat
from .errors import _explain_model_failure, _first_line, _first_sentence, _quoted
from .state import _FORWARD_AD, _load_forward_ad
from .tensors import _basis, _to_numpy, _unknowns_require_grad

if TYPE_CHECKING:
    from . import TorchBound


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
    count: the derivatives are taken in ``x``.) Where this torch's graph cannot be read
    (:func:`.compat.functions_readable`), every node of a Python class, wherever it sits, counts
    as a Function whose backward may be once differentiable, named by its node's class."""
    found: dict[str, tuple[bool, bool]] = {}
    root = y.grad_fn
    if root is None:
        return found
    readable = compat.functions_readable()
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
        hit = compat.leaf_of(node) is x or any(
            reaches.get(id(n), False) for n, _ in node.next_functions if n is not None)
        reaches[id(node)] = hit
        function = compat.function_of(node) if readable else None
        if hit and function is not None:
            found[f"{function.__module__}.{function.__qualname__}"] = (
                compat.once_differentiable(function), _in_func_form(function))
        elif not readable and compat.is_python_node(node):
            found[type(node).__name__] = (True, False)
    return found


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


class TorchSecondKernel(Kernel):
    """One of :data:`~batchjac._backends._base.SecondKind` over chunks of ``chunk_size`` rows."""

    def __init__(self, bound: TorchBound, kind: SecondKind, order: Order, chunk_size: int,
                 with_outputs: bool, with_jacobian: bool) -> None:
        self.mode = "forward"  # the outer differentiation is forward mode in both orders
        self.kind, self.order = kind, order
        self.chunk_size, self.with_outputs, self.with_jacobian = chunk_size, with_outputs, with_jacobian
        self._bound = bound
        bound.trace_count += 1
        # (forward mode's decompositions, slow to load in a fresh process, are loaded where
        # torch.func's forward mode runs: the forward Laplacian and plain autograd need none;
        # measured: docs/thresholds.md)
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
            # (docs/thresholds.md, "PyTorch's second order"): the first untimed, the other
            # timed against it only
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
    #: race calls each build several times, so not a whole large chunk; not fewer: on a
    #: loaded machine the forward Laplacian's many small operations lose more to scheduling
    #: on small chunks, and a race on fewer rows once kept the slower build (docs/thresholds.md)
    RACE_ROWS = 16384

    def _select(self, variant: str, note: str) -> None:
        what = "a forward Laplacian (one pass)" if variant == "forward-laplacian" else variant
        if self.laplacian_failed and variant == "plain":
            note = f"{note}; {self.laplacian_failed}"
        self.variant, self.note = variant, f"{self.kind}: {self.order}, {what} ({note})"

    # -- the builds as the chooser (:mod:`batchjac._tune.chooser`) sees them

    @property
    def known(self) -> str | None:
        # as a race chose for another chunk size of this model (the ladder of chunk sizes
        # compares the sizes on one build)
        return self._bound.tuning.builds.get((self.kind, self.order))

    def take(self, name: str, why: str, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
        self._select(name, why)

    @property
    def race_setup_seconds(self) -> float:
        """torch._dynamo's import, where the plain build (torch.func's passes) races a first
        build that needs none and it is not loaded."""
        torch_func = "plain" in self.variants and self.variant != "plain"
        return compat.DYNAMO_IMPORT_SECONDS if torch_func and not compat.dynamo_loaded() else 0.0

    def untimed_first(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], budget: CallBudget
                      ) -> tuple[str, str, bool]:
        from .._base import untimed_note

        if "forward-laplacian" in self.variants:
            # (where it cannot be traced, _compute computes the plain build and says why)
            return "forward-laplacian", (f"{untimed_note()}; its trace costs a forward pass, "
                                         f"the plain build's first use imports torch._dynamo"), True
        if "autograd" in self.variants:
            return "autograd", (f"plain autograd: torch.func would load torch._dynamo first; "
                                f"{untimed_note()}"), True
        return "plain", untimed_note(), True

    @contextlib.contextmanager
    def timing(self, u: Any, ctx: tuple[Any, ...]) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        bound = self._bound
        ut, ct = bound.tensors(u, ctx)
        with bound.calling(), _FORWARD_AD:
            yield ut, ct

    #: the tangents a Hessian-vector product's race times the builds with
    _race_v: torch.Tensor | None = None

    @property
    def race_rows(self) -> int:
        return self.RACE_ROWS

    def race_inputs(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        rows = min(u.shape[0], self.RACE_ROWS)
        u, ctx = u[:rows], tuple(c[:rows] for c in ctx)
        self._race_v = torch.ones_like(u) if self.kind == "hvp" else None  # (timed alike)
        return u, ctx

    def contenders(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> tuple[str, ...]:
        if "forward-laplacian" in self.variants and self._forward_laplacian(u, ctx) is None:
            self._select("plain", "the forward Laplacian failed")
            return ()
        if "autograd" in self.variants and self._autograd_over_reverse(u, ctx, None) is None:
            self._select("plain", self.autograd_failed)
            return ()
        return self.variants

    def run_build(self, name: str, u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
        self.variant = name
        self._compute(u, ctx, self._race_v)

    def raced_to(self, best: str, times: dict[str, float], u: Any) -> None:
        self._select(best, f"timed {u.shape[0]} rows: {timings(times)}")
        if self.kind == "laplacian":
            self._bound.tuning.builds[(self.kind, self.order)] = best

    # a mapping of named arrays, which the runner takes as it takes a Jacobian kernel's pair
    def call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...],  # type: ignore[override]
             budget: CallBudget = UNTUNED) -> dict[str, np.ndarray]:
        bound = self._bound
        v: torch.Tensor | None = None
        if self.kind == "hvp":
            ctx, v = ctx[:-1], bound.tensors(ctx[-1], ())[0]
        ut, ct = bound.tensors(u, ctx)
        with bound.calling(), _FORWARD_AD:
            try:
                if self.variant is None:
                    self.choose(ut, ct, budget)
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
        try:
            if self.kind in ("diagonal", "laplacian") and self.order == "forward-over-forward":
                return self._diagonal_ff(u, ctx)
            if self.kind == "hessian" and self.order == "forward-over-forward":
                return self._hessian_ff(u, ctx)
            if v is not None and self.order == "forward-over-forward":
                return self._hvp_ff(u, ctx, v)
            return self._over_reverse(u, ctx, v)
        except (BatchJacError, Warning):
            raise
        except Exception as e:
            once = self._once(u, ctx)
            if once:
                raise self._not_twice(once, e) from e
            refused = isinstance(e, NotImplementedError) or any(
                not form for _, form in self._custom(u, ctx).values())
            if refused and self.variant != "autograd" and "autograd" not in self.autograd_failed:
                # what torch.func cannot push a tangent through (an operation without a
                # forward derivative, such as the CPU's LSTM and GRU kernels: torch raises
                # NotImplementedError; a Function in the old form, or without jvp) but
                # autograd differentiates twice: plain autograd's second order, as
                # torch.autograd.functional.hessian computes it (the model's own errors are
                # not retried)
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
        if not compat.functions_readable():
            err = ModelError(
                f"Second derivatives of this model cannot be computed with torch "
                f"{torch.__version__}: batchjac cannot read its custom torch.autograd.Function"
                f"{'' if one else 's'} ({_quoted(names)}) in this torch version, so it cannot "
                f"tell whether plain autograd differentiates {'it' if one else 'them'} twice (a "
                f"backward marked @once_differentiable would give a zero Hessian), and "
                f"torch.func failed: {_first_sentence(cause)}. Give the Function torch.func's "
                f"form (setup_context and jvp staticmethods), or use a torch version batchjac "
                f"is tested with. batchjac.jacobian (first derivatives) works with it as it is.")
            err.__cause__ = cause
            return err
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
                   if self._once(u, ctx, func_form=False) else "") + "."
                + ("" if compat.functions_readable() else
                   f" (In torch {torch.__version__} batchjac cannot read a model's custom "
                   f"Functions: each node of a Python class counts as one.)"))

    def _autograd_over_reverse(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...],
                               v: torch.Tensor | None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(y, J, result)`` forward over reverse on plain autograd: one forward pass of the
        chunk; per output ``o``, the backward pass of ``sum_rows y[:, o]`` with ``create_graph``
        (rows are independent, which the probes check: row ``i``'s gradient is its Jacobian
        row ``g_o``), then per unknown ``j`` the backward pass of ``sum_rows g_o[:, j]``: row
        ``i``'s Hessian row (for ``hvp``, one pass of ``sum_rows g_o . v``). No torch.func, so
        nothing is imported: torch.func's passes load torch._dynamo through ``F.linear``'s
        decomposition on their first use (measured: docs/thresholds.md, "PyTorch's second
        order"). None where a double-backward pass fails for this model (the note says why;
        torch.func's build then, which may not fail alike)."""
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
    #: read and write whole arrays, from memory once they outgrow it (docs/thresholds.md)
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
        by_identity = self.tapes_by_identity
        weights = tuple((id(t), 0 if by_identity else compat.version(t)) for t in _weights(bound))
        if by_identity and u.shape[0] > 3:
            found = self._tape_for_any_rows(u, ctx, weights)
            if found is not None:
                return found
        key = (tuple(u.shape), *(tuple(c.shape) for c in ctx))
        tape, seen = self._graphs.get(key, (None, None))
        # (a version that cannot be read is taken as changed: the model is traced again)
        if tape is None or seen != weights or any(v is None for _, v in weights):
            # (no graph while tracing: a differentiable call's checkpointed chunk saves the
            # same tensors when it is recomputed, and the first call traces, the others not)
            with torch.no_grad():
                tape = laplacian.trace(lambda a, *c: bound.apply(a, c), u, *ctx)
            self._graphs[key] = (tape, weights)
        return tape

    def _tape_for_any_rows(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...],
                           weights: tuple[Any, ...]) -> Any:
        """A tape traced on 2 and on 3 rows, where both are the same operations (none depends
        on the row count): it serves chunks of any size, traced on a few rows instead of the
        chunk's (a forward pass of the chunk, under the recorder). None where they differ."""
        from . import laplacian

        bound = self._bound
        key = ("any rows", tuple(u.shape[1:]), *(tuple(c.shape[1:]) for c in ctx))
        tape, seen = self._graphs.get(key, (None, None))
        if tape == "rows" or (tape is not None and seen == weights):
            return None if tape == "rows" else tape
        with torch.no_grad():
            two, three = (laplacian.trace(lambda a, *c: bound.apply(a, c), u[:r],
                                          *(c[:r] for c in ctx)) for r in (2, 3))
        same = laplacian.same_ops(two, three)
        self._graphs[key] = (three if same else "rows", weights)
        return three if same else None

    #: whether the forward Laplacian runs a chunk in blocks; not in a differentiable call,
    #: whose gradient keeps every block's values anyway (the probe's trace is then saved)
    in_blocks = True
    #: whether a tape stays valid while its weights keep their identities (a differentiable
    #: call's: the tape holds the module's own parameters, not cast copies, so an optimizer's
    #: in-place update is what the next run reads); else their versions count too
    tapes_by_identity = False

    def _block_rows(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], k: int) -> int:
        """Rows a block of the forward Laplacian (:data:`LAPLACIAN_LIVE_VALUES`), evened over
        the chunk; the whole chunk on an accelerator, or where it is small."""
        from ..._config import cache_bytes

        rows = u.shape[0]
        if u.device.type != "cpu" or rows <= 2 * self.MIN_BLOCK_ROWS or not self.in_blocks:
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
        y, jac, hvs = self._along_units(u, ctx, v)
        return y, jac, hvs.reshape(jac.shape)

    def _along_units(self, u: torch.Tensor, ctx: tuple[torch.Tensor, ...], outer: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For each of the ``k`` unit tangents ``t``, vmapped: the value, the derivative along
        ``t`` (the Jacobians, per instance), and the derivative of that along ``outer`` (``t``
        itself where None: the Hessian's diagonal), as ``(rows, m, k)``."""
        bound = self._bound
        k, m, out_shape, ushape = self._shapes(u)
        rows = u.shape[0]

        def along(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            def first(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                out = torch.func.jvp(lambda b: bound.apply(b, ctx), (a,), (t,))
                return out[1], out[0]
            out: Any = torch.func.jvp(first, (u,), (t if outer is None else outer,), has_aux=True)
            return out[2], out[0], out[1]  # (y, dy along t, its derivative along outer)

        tangents = _basis(k, rows, ushape, u.dtype, u.device)
        y, dys, d2ys = torch.func.vmap(along, out_dims=(None, 0, 0))(tangents)  # type: ignore[arg-type]
        # (k, rows, *out) -> (rows, *out, k)
        jac = dys.reshape(k, rows, m).permute(1, 2, 0).reshape(rows, *out_shape, *ushape)
        return y, jac, d2ys.reshape(k, rows, m).permute(1, 2, 0)

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
        y, jac, diag = self._along_units(u, ctx, None)
        rows, out_shape = u.shape[0], self._shapes(u)[2]
        if self.kind == "diagonal":
            return y, jac, diag.reshape(jac.shape)
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
