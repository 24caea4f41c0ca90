"""JAX backend.

A model is a function of a batch, ``f(x)`` (inputs assembled as for the other backends:
``f(x)``, ``f(*inputs)`` or ``f(**inputs)``), or ``f(params, x)`` with
``backend_options={"params": params}``; Equinox modules and other callables work the same
way. A function of *one* instance (Equinox style) is vmapped by batchjac when
``backend_options={"per_instance": True}`` is given.

Kernel: ``jit(vmap(jacfwd | jacrev))`` over instances, each instance pushed through the
batch function as a one-row batch (``f(x_i[None])[0]``; for a per-instance model, ``f(x_i)``).
That is what people write by hand, and on a 2-core CPU it was the faster of the two shapes
tried: the alternative, vmapping ``jvp``/``vjp`` of the whole batch over the basis (rows are
independent), was slower on the benchmark's MLPs, and no faster within batchjac where it
timed faster as a bare kernel (measured: docs/thresholds.md, "Measured choices"). Each
kernel is traced once and compiled ahead of time for its fixed chunk shape
(``jit(...).lower(...).compile()``; calling the compiled executable skips jit's argument
matching), on the CPU in two builds, each also computing the chunk in blocks of ~128 rows
inside the one call, that the first call times against each other (see :class:`JaxKernel`).

Array leaves of the model (an Equinox module is a pytree) and of ``params`` are arguments of
the compiled kernel, not constants: floating ones are cast to the compute dtype inside it (so
a float32 model can be differentiated in float64), and new params of the same structure reuse
the compilation. Arrays a plain function closes over are baked into the kernel when it is
traced, as ``jax.jit`` does; :meth:`JaxBound.refresh` notices when those were rebound (a
global ``params`` reassigned after a training step) or, for numpy arrays, changed in place
(``w *= 0.9``: a checksum of each), and compiles again instead of returning stale Jacobians.
It watches at most 256 items of a container and 2,000 objects; where a function reaches
more, one :class:`~batchjac.UnwatchedValuesWarning` says so and names the fix (params as an
argument).

float64 needs JAX's x64 mode; batchjac never switches it on (that is a process-wide setting).

>>> import jax, jax.numpy as jnp, numpy as np, batchjac
>>> x = np.random.default_rng(0).normal(size=(100, 3)).astype(np.float32)
>>> w = jnp.asarray(np.random.default_rng(1).normal(size=(3, 2)).astype(np.float32))
>>> batchjac.jacobian(lambda x: jnp.tanh(x @ w), x).shape                # f(x), a batch
(100, 2, 3)
>>> one = lambda x: jnp.tanh(w.T @ x)                                     # one instance
>>> batchjac.jacobian(one, x, backend_options={"per_instance": True}).shape
(100, 2, 3)
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ... import _keras_compat
from ..._errors import InputError, ModelError, UnwatchedValuesWarning
from ..._spec import assemble, sample_inputs
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
from .builds import JaxKernel as JaxKernel
from .ops import JaxOps as JaxOps
from .second import JaxSecondKernel as JaxSecondKernel
from .staleness import _captured_values, _is_array, _same_values, _Sites

_OPTIONS = ("params", "per_instance", "device", "state")
_X64_FIX = (
    'call jax.config.update("jax_enable_x64", True) at the start of the program (before '
    "creating any JAX array), or compute in float32 with dtype='float32'"
)


def x64_enabled() -> bool:
    """Whether float64 arrays are float64 right now (respects ``jax.enable_x64`` contexts)."""
    return bool(jax.dtypes.canonicalize_dtype(np.float64) == np.float64)


def _require_x64(dtype: np.dtype) -> None:
    if dtype == np.float64 and not x64_enabled():
        raise InputError(
            f"float64 was asked for (dtype='float64' or float64 inputs), but JAX's x64 mode is "
            f"off, so JAX would silently compute in float32. To get float64 Jacobians, "
            f"{_X64_FIX}."
        )


def _cast_floats(leaves: list[Any], dtype: np.dtype) -> list[Any]:
    return [x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype
            else x for x in leaves]


class _Split:
    """A pytree cut into its array leaves (kernel arguments) and the rest (static)."""

    def __init__(self, tree: Any, device: Any = None) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        self.treedef: Any = treedef
        self.where = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        #: the array leaves as the tree held them (kept: :meth:`same` compares identities)
        self.leaves = [leaves[i] for i in self.where]
        self.arrays = [jax.device_put(leaf, device) for leaf in self.leaves]
        self.static = [None if _is_array(leaf) else leaf for leaf in leaves]

    def same(self, tree: Any) -> bool | None:
        """Whether ``tree`` still holds the array leaves it was split from (a mutable pytree,
        e.g. a Flax NNX module whose ``Variable`` got a new value, holds others): True; None
        where only the arrays differ (the same structure, shapes and dtypes: new kernel
        arguments, no new trace); False where the structure changed (trace again)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        now = [leaves[i] for i in self.where] if len(leaves) == len(self.static) else []
        if len(now) == len(self.leaves) and all(a is b for a, b in zip(now, self.leaves)):
            return True
        if treedef != self.treedef or [i for i, leaf in enumerate(leaves) if _is_array(leaf)] \
                != self.where:
            return False
        alike = all(np.shape(a) == np.shape(b) and a.dtype == b.dtype
                    for a, b in zip(now, self.leaves))
        return None if alike else False

    def merge(self, arrays: list[Any]) -> Any:
        leaves = list(self.static)
        for i, a in zip(self.where, arrays):
            leaves[i] = a
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


_NO_PARAMS = object()


def _immutable(tree: Any) -> bool:
    """Whether a pytree model cannot take new arrays in place: a frozen dataclass, or an
    Equinox module (frozen by Equinox after its ``__init__``). A Flax NNX module can."""
    if getattr(getattr(type(tree), "__dataclass_params__", None), "frozen", False):
        return True
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(tree, eqx.Module)


class JaxBound(BoundModel):
    #: ``jacfwd`` traces and compiles quicker than ``jacrev`` and runs as fast where the widths
    #: are close (a first call of the benchmark's seed MLP is quicker forward); in TensorFlow
    #: (ForwardAccumulator) and PyTorch forward mode costs more, and they keep the default
    #: (measured: docs/thresholds.md)
    forward_bias: ClassVar[float] = 1.5
    #: full Hessians pushed forward by :mod:`.laplacian`'s rule set (JaxSecondKernel)
    forward_hessian: ClassVar[bool] = True
    #: a race's kernel is traced and compiled beside the calls (XLA's compilation releases
    #: Python's lock), where that thread traces as the calling one would (its settings)
    builds_beside = True

    def beside_settings(self) -> Any:
        return compat.trace_settings()

    def made_beside(self, settings: Any, mode: Mode, chunk_size: int, with_outputs: bool,
                    budget: CallBudget, variant: str | None = None) -> Any:
        if settings is None or compat.trace_settings() != settings:
            return None  # (the calling thread's own x64, matmul precision, ...: made there)
        return super().made_beside(settings, mode, chunk_size, with_outputs, budget, variant)

    def __init__(self, model: Any, signature: Signature, *, params: Any = _NO_PARAMS,
                 per_instance: bool = False, device: Any = None) -> None:
        super().__init__(signature)
        self.model = model
        #: where the kernels compute (None: JAX's default device); the model's arrays and the
        #: kernels' arguments are placed there
        self.device = device
        self.per_instance = per_instance
        self.has_params = params is not _NO_PARAMS
        self._model_split = _Split(model, device)
        self._mutable_tree = bool(self._model_split.where) and not _immutable(model)
        self._params = params if self.has_params else None
        self._params_split = _Split(self._params, device)
        self._forward: Any = None
        #: the probes' one trace: ((u, ctx), the jaxpr of (y, dy) or the error tracing it)
        self._tangent: tuple[tuple[Any, tuple[Any, ...]], Any] | None = None
        #: XLA compilations of kernels (an executable loaded from the disk cache is none)
        self.compile_count = 0
        #: what the last kernel that timed its variants chose (see JaxKernel): its build,
        #: and whether in blocks. Kernels timed against it (other chunk sizes) run the same
        #: before they choose their own, so that sizes are compared alike
        self.hint: tuple[str, bool] | None = None
        self._x64 = x64_enabled()
        self._sites, self._captured = self._walk()
        #: modes that failed to trace for this model where the other one worked (JAX traces
        #: the same for every chunk size): kernels then compute the other mode at once
        self.failed: dict[Mode, str] = {}
        #: the fallback warnings given for this model (one of each kind)
        self.warned: set[type[Warning]] = set()
        self._warn_unwatched()

    def _warn_unwatched(self) -> None:
        """One warning per bound model where the walk of its captured values stopped at a
        limit: what lies past it is baked into the kernels unwatched (stale if it changes)."""
        if not self._sites.cut or UnwatchedValuesWarning in self.warned:
            return
        self.warned.add(UnwatchedValuesWarning)
        warnings.warn(
            f"This JAX function closes over more values than batchjac watches for changes "
            f"between calls ({self._sites.cut}). The values past that limit are baked into "
            f"the compiled kernel as constants, as jax.jit does: if you rebind or change them "
            f"between calls, batchjac will not notice and the results will be stale. Pass "
            f"them as an argument instead: define f(params, x) and call with "
            f'backend_options={{"params": params}} (arguments are never baked in).',
            UnwatchedValuesWarning, stacklevel=user_stacklevel())

    # -- options and state -------------------------------------------------------------------
    @property
    def args(self) -> tuple[list[Any], list[Any]]:
        """The array leaves of the model and of params: the kernels' first argument."""
        return self._model_split.arrays, self._params_split.arrays

    def update(self, **options: Any) -> None:
        """New params of the same structure (see ``JaxBackend.options_key``): no recompilation."""
        params = options.get("params", self._params)
        if "state" in options:  # (a Haiku function with state: both are its params)
            params = (params, options["state"])
            if self._params is not None and all(a is b for a, b in zip(params, self._params)):
                return
        if not self.has_params or params is self._params:
            return
        new = _Split(params, self.device)
        same = new.treedef == self._params_split.treedef and \
            [np.shape(a) for a in new.arrays] == [np.shape(a) for a in self.args[1]]
        if not same:
            raise InputError("`params` changed structure; bind the model again.")
        self._params, self._params_split = params, new

    def refresh(self) -> bool:
        _require_x64(self.signature.dtype)
        # a model that is a mutable pytree of arrays (a Flax NNX module; not an Equinox module
        # or a frozen dataclass: _immutable) may hold new arrays since: its leaves are read again
        same = self._model_split.same(self.model) if self._mutable_tree else True
        if same is None:
            # new values in its leaves (NNX: ``layer.kernel[...] *= 0.5``; a Keras model's
            # ``assign``): the kernels' arguments change, nothing is traced again unless a
            # value baked into the traces changed too (below); True, as the model changed
            # under a result computed before this check (the fast path's launched call)
            self._model_split = _Split(self.model, self.device)
        elif same and self._x64 == x64_enabled() and self._sites.unchanged():
            return False  # every value the traces baked in is still where it was read
        sites, captured = self._walk()
        changed = sites.contents() != self._sites.contents()  # a numpy array changed in place
        self._sites = sites
        self._warn_unwatched()
        if same is False or self._x64 != x64_enabled() or \
                not _same_values(captured, self._captured) or changed:
            # the x64 mode changes the dtypes of traced arrays; rebound closure values (or
            # numpy arrays changed in place) would be stale constants in the compiled
            # kernels: trace everything again
            self._model_split = _Split(self.model, self.device)
            self._params_split = _Split(self._params, self.device)
            self._kernels.clear()
            self.products.clear()
            self.__dict__.pop("_second_kernels", None)
            self.__dict__.pop("_accumulation", None)
            self.__dict__.pop("_linear_head", None)
            self.__dict__.pop("_one_jaxpr", None)
            self.failed.clear()
            self._forward = None
            self.probed = False
            self._x64 = x64_enabled()
            self._captured = captured
            return True
        return same is None

    def _walk(self) -> tuple[_Sites, list[Any]]:
        """The values the traces bake in, and where they were read: those the model reaches
        less its own pytree leaves, which are the kernels' arguments (a mutable pytree's
        new leaves then cost no new trace, at this call or the next)."""
        sites = _Sites()
        leaves = {id(a) for a in self._model_split.leaves}
        return sites, [v for v in _captured_values(self.model, sites) if id(v) not in leaves]

    # -- model call --------------------------------------------------------------------------
    def _call(self, args: tuple[list[Any], list[Any]], u: Any, ctx: tuple[Any, ...]) -> Any:
        """The model on ``u``/``ctx`` (one batch, or one instance when ``per_instance``)."""
        dtype = self.signature.dtype
        model = self._model_split.merge(_cast_floats(args[0], dtype))
        lay = self.signature.layout
        inputs = assemble(lay, u, ctx, concat=lambda xs: jnp.concatenate(xs, axis=-1),
                          take=lambda x, idx: jnp.take(x, jnp.asarray(idx), axis=-1))
        pre = (self._params_split.merge(_cast_floats(args[1], dtype)),) if self.has_params \
            else ()
        try:
            if lay.kind in ("single", "concat"):
                y = model(*pre, inputs[0])
            elif lay.kind == "tuple":
                y = model(*pre, *inputs)
            else:
                assert lay.keys is not None
                y = model(*pre, **dict(zip(lay.keys, inputs)))
        except ModelError:
            raise
        except Exception as e:
            raise self._explain(e) from e
        return self._check_output(y)

    def _check_output(self, y: Any) -> Any:
        if isinstance(y, (tuple, list)):
            raise ModelError(
                f"The model returned a {type(y).__name__} of {len(y)} outputs; batchjac "
                f"differentiates one output array. Return one array, e.g. wrap the model as "
                f"`lambda x: jnp.concatenate(f(x), axis=-1)`, or pick the output you need "
                f"(`lambda x: f(x)[0]`)."
            )
        if isinstance(y, dict):
            raise ModelError(
                f"The model returned a dict with keys {list(y)[:8]}; batchjac differentiates "
                f"one output array. Wrap the model to return one array, e.g. "
                f"`lambda x: f(x)[{next(iter(y), 'key')!r}]`."
            )
        if not isinstance(y, jax.Array):
            where = "numpy" if isinstance(y, (np.ndarray, np.generic)) else type(y).__name__
            raise ModelError(
                f"The model returned a {type(y).__name__}, not a JAX array: its output was "
                f"computed outside JAX ({where}), so no derivative can reach the unknowns. "
                f"batchjac differentiates one JAX array computed with jax.numpy from the "
                f"inputs it passes to the model."
            )
        if not jnp.issubdtype(y.dtype, jnp.floating):
            raise ModelError(
                f"The model output has dtype {y.dtype}; it must be floating (float32 or "
                f"float64) to have a Jacobian. Cast it inside the model, e.g. "
                f"`.astype(jnp.float32)`, if the integer values are meant as numbers."
            )
        return y.astype(self.signature.dtype)

    def _explain(self, e: Exception) -> ModelError:
        text = f"{type(e).__name__}: {e}".strip()
        first = text.splitlines()[0][:300]
        if isinstance(e, jax.errors.TracerArrayConversionError):
            return ModelError(
                f"The model converts a traced JAX array to numpy ({first}). It leaves JAX "
                f"(np.asarray, numpy functions, .item(), a non-JAX library), so no derivative "
                f"can flow through it. Write the model with jax.numpy only."
            )
        if isinstance(e, (jax.errors.ConcretizationTypeError,
                          jax.errors.TracerBoolConversionError,
                          jax.errors.TracerIntegerConversionError)):
            return ModelError(
                f"The model uses the values of its inputs in Python control flow or to build "
                f"shapes ({first}); batchjac compiles it with jax.jit, where inputs have no "
                f"values. Use jnp.where, jax.lax.cond or jax.lax.fori_loop instead of Python "
                f"`if`/`for` on array values."
            )
        hints = []
        if "RNG" in text and "apply" in text:  # a Haiku apply function passed as it is
            hints.append("For a Haiku function, pass the transformed function itself (what "
                         "hk.transform returned) with backend_options={'params': params}: "
                         "batchjac calls its apply without an RNG.")
        if not self.has_params and isinstance(e, TypeError) and "positional argument" in text:
            hints.append("If the model is f(params, x), pass backend_options={'params': params}.")
        if not self.per_instance and any(w in text.lower() for w in ("shape", "dimension", "rank")):
            hints.append("If the model maps one instance, not a batch, to one output (as "
                         "Equinox modules do), pass backend_options={'per_instance': True}.")
        if self.signature.dtype == np.float64 and "float32" in text:
            hints.append("The model may close over float32 arrays: pass them through "
                         "backend_options={'params': ...} (batchjac casts them to the compute "
                         "dtype), or use dtype='float32'.")
        return ModelError(f"Calling the model failed: {text[:2000]}" +
                          "".join(f" {h}" for h in hints))

    def maps_one_instance(self) -> bool:
        """Whether the model runs on one instance (no batch axis): the convention of its
        kind (an Equinox module) when the model leaves it open. Probed by shapes alone
        (``jax.eval_shape``: nothing computed). A model that runs on a batch too computes
        the same rows either way, vmapped."""
        sig = self.signature
        u = jax.ShapeDtypeStruct(tuple(sig.unknown_shape), sig.dtype)
        ctx = tuple(jax.ShapeDtypeStruct(tuple(shape), jax.dtypes.canonicalize_dtype(dt))
                    for shape, dt in sig.ctx)
        try:
            jax.eval_shape(lambda a, u_i, c_i: self._call(a, u_i, c_i), self.args, u, ctx)
        except Exception:
            return False
        return True

    def _instance_fn(self, args: tuple[list[Any], list[Any]]
                     ) -> Callable[[Any, tuple[Any, ...]], Any]:
        """``(u_i, ctx_i) -> y_i`` for one instance."""
        if self.per_instance:
            return lambda u_i, ctx_i: self._call(args, u_i, ctx_i)

        def one(u_i: Any, ctx_i: tuple[Any, ...]) -> Any:
            y = self._call(args, u_i[None], tuple(c[None] for c in ctx_i))
            if y.ndim == 0 or y.shape[0] != 1:
                raise ModelError(
                    f"For a batch of 1 row the model returned shape {y.shape}; it must map a "
                    f"batch (N, ...) to outputs (N, ...). If it handles one instance at a time "
                    f"(as Equinox modules do), pass backend_options={{'per_instance': True}}."
                )
            return y[0]
        return one

    def _batch(self, args: tuple[list[Any], list[Any]], u: Any, ctx: tuple[Any, ...]) -> Any:
        if self.per_instance:
            return jax.vmap(self._instance_fn(args))(u, ctx)
        return self._call(args, u, ctx)

    def _specs(self, rows: int) -> tuple[Any, tuple[Any, ...]]:
        sig = self.signature
        at = {} if self.device is None else \
            {"sharding": jax.sharding.SingleDeviceSharding(self.device)}
        u = jax.ShapeDtypeStruct((rows, *sig.unknown_shape), sig.dtype, **at)
        ctx = tuple(jax.ShapeDtypeStruct((rows, *shape), jax.dtypes.canonicalize_dtype(dt), **at)
                    for shape, dt in sig.ctx)
        return u, ctx

    # -- probes ------------------------------------------------------------------------------
    def in_thread(self) -> contextlib.AbstractContextManager[Any]:
        x64 = x64_enabled()  # read here, in the calling thread (enable_x64() is per thread)
        return compat.enable_x64(x64)

    def device_free_memory(self) -> int | None:
        """Free bytes of the device the kernels run on when it is an accelerator (None on the
        CPU)."""
        return _free_bytes(self.device if self.device is not None else _default_device())

    def output_shape_of(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[int, ...] | None:
        closed = self._traced_tangent(u, ctx, trace=False)
        if closed is not None and not isinstance(closed, Exception):  # the probes' trace
            shape = closed.out_avals[0].shape
        else:
            try:  # (the jaxpr is kept: a row's working set is read from it)
                forward, out = jax.make_jaxpr(self._batch, return_shape=True)(self.args, u, tuple(ctx))
            except Exception:  # the probes, run in full, will explain it
                return None
            self._forward_trace = ((u, tuple(ctx)), forward)
            shape = getattr(out, "shape", None)  # (a tuple or mapping of outputs: the probes)
        if shape is None or len(shape) < 1 or shape[0] != u.shape[0]:
            return None
        return tuple(int(s) for s in shape[1:])

    def row_working_set(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> float | None:
        """From a jaxpr of these rows made already, no new trace: the probes' one of the
        forward derivative (:meth:`_traced_tangent`), the live arrays at its peak
        (:func:`batchjac._backends.jax.cost.peak_row_bytes`); else the forward's that told the
        output shape, twice its peak (a tangent beside each array: W1 512 against 1,024 bytes
        a row, W4 21.6 against 43.3 KB)."""
        from . import cost as jax_cost

        device = self.device if self.device is not None else _default_device()
        if getattr(device, "platform", "cpu") != "cpu":
            return None
        closed = self._traced_tangent(u, ctx, trace=False)
        if closed is not None and not isinstance(closed, Exception):
            return jax_cost.peak_row_bytes(closed, u.shape[0])
        forward = _traced_for(self.__dict__.get("_forward_trace"), u, ctx)
        if forward is None:
            return None
        peak = jax_cost.peak_row_bytes(forward, u.shape[0])
        return None if peak is None else 2 * peak

    def _traced_tangent(self, u: Any, ctx: tuple[Any, ...], *, trace: bool = True) -> Any:
        """The jaxpr of ``(args, u, ctx, t) -> (y, dy)`` (the batch function and its forward
        derivative along ``t``), or the exception tracing it raised: the one trace the abstract
        probes read (rows kept apart, the connection, the output shape), made once for the
        probes' rows (``trace=False``: only if made already)."""
        found = _traced_for(self._tangent, u, ctx)
        if found is not None:
            return found
        if not trace:
            return None

        def both(args: Any, u: Any, ctx: Any, t: Any) -> Any:
            return jax.jvp(lambda v: self._batch(args, v, ctx), (u,), (t,))

        try:
            closed: Any = jax.make_jaxpr(both)(self.args, u, tuple(ctx), u)
        except (ModelError, InputError):
            raise
        except Exception as e:
            closed = e
        self._tangent = ((u, tuple(ctx)), closed)
        return closed

    def rows_apart(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        """Read from a jaxpr (:mod:`batchjac._backends.jax.rows`): a trace, no compilation (the
        forward passes the probes would run otherwise cost a compilation of the forward, as
        much as the first kernel's on small models). The jaxpr of the forward derivative
        (:meth:`_traced_tangent`, which :meth:`connected` and :meth:`output_shape_of` read
        too) keeps the rows apart only if the function does; where it cannot tell (or forward
        mode fails for the model), the forward's own jaxpr is read."""
        from . import rows as jax_rows

        n_args = len(jax.tree_util.tree_leaves(self.args))
        n_ctx = len(jax.tree_util.tree_leaves(tuple(ctx)))
        batched = [False] * n_args + [True] * (1 + n_ctx)
        closed = self._traced_tangent(u, ctx)
        if not isinstance(closed, Exception) and jax_rows.rows_apart(closed, [*batched, True]):
            return True
        try:
            closed = jax.make_jaxpr(self._batch)(self.args, u, tuple(ctx))
        except Exception:  # the probes' forward pass will explain it
            return False
        return jax_rows.rows_apart(closed, batched)

    def forward(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        if self._forward is None:
            self._forward = jax.jit(self._batch)
        try:
            return np.asarray(self._forward(self.args, u, tuple(ctx)))
        except (ModelError, InputError):
            raise
        except Exception as e:
            raise self._explain(e) from e

    def connected(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        """Walk the jaxpr of the forward-mode derivative (:meth:`_traced_tangent`): JAX drops
        symbolic-zero tangents, so when no path leads from the unknowns to the output, the
        tangent output does not depend on the tangent input. Conservative: any equation that
        reads a dependent value is taken to depend on it."""
        closed = self._traced_tangent(u, ctx)
        if isinstance(closed, Exception):
            raise self._explain(closed) from closed
        jaxpr = closed.jaxpr
        dependent = {id(jaxpr.invars[-1])}  # the tangent t is the last flat argument
        for eqn in jaxpr.eqns:
            if any(id(v) in dependent for v in eqn.invars):
                dependent.update(id(v) for v in eqn.outvars)
        tangents = jaxpr.outvars[len(jaxpr.outvars) // 2:]  # (y's leaves, then dy's)
        return any(id(v) in dependent for v in tangents)

    def accumulation(self) -> Any:
        """The model's chain and its bracketing where mixed mode is offered
        (:func:`batchjac._chain.choose`), else None: read once from a jaxpr of one instance
        (:mod:`batchjac._backends.jax.chain`), only where the basis ``min(k, m)`` is wide
        enough for a cut to pay (:data:`batchjac._chain.MIN_BASIS`)."""
        if "_accumulation" not in self.__dict__:
            self._accumulation = self._read_accumulation()
        return self._accumulation

    def _read_accumulation(self) -> Any:
        from ..._chain import MIN_BASIS, choose
        from . import chain as jax_chain

        sig = self.signature
        if self.output_shape is None or \
                min(math.prod(sig.unknown_shape), math.prod(self.output_shape)) < MIN_BASIS:
            return None
        closed = self._instance_jaxpr()
        if closed is None:
            return None
        read = jax_chain.read(closed, len(jax.tree_util.tree_leaves(self.args)))
        accumulation = None if read is None else choose(read.chain, self.forward_bias)
        return None if accumulation is None else (read, accumulation)

    def _instance_jaxpr(self) -> Any:
        """The jaxpr of the model's function of one instance (no compilation), which the chain
        and the linear head are read from: traced once (again after a retrace); None where the
        model cannot be traced (the probes explain it)."""
        if "_one_jaxpr" not in self.__dict__:
            sig = self.signature
            u = jax.ShapeDtypeStruct(tuple(sig.unknown_shape), sig.dtype)
            ctx = tuple(jax.ShapeDtypeStruct(tuple(shape), jax.dtypes.canonicalize_dtype(dt))
                        for shape, dt in sig.ctx)
            closed: Any
            try:
                closed = jax.make_jaxpr(
                    lambda a, u_i, c_i: self._instance_fn(a)(u_i, c_i))(self.args, u, ctx)
            except Exception:
                closed = None
            self.__dict__["_one_jaxpr"] = closed
        return self.__dict__["_one_jaxpr"]

    def linear_head(self) -> Any:
        """The model's linear head (:mod:`batchjac._backends.jax.head`), read once from a jaxpr
        of one instance (again after a retrace); None where it has none."""
        if "_linear_head" not in self.__dict__:
            self._linear_head = self._read_head()
        return self._linear_head

    def _read_head(self) -> Any:
        from . import head as jax_head

        closed = self._instance_jaxpr()
        if closed is None:
            return None
        read = jax_head.read(closed, len(jax.tree_util.tree_leaves(self.args)))
        return None if read is None else jax_head.JaxHead(self, read)

    def product(self, kind: str, u: Any, ctx: tuple[Any, ...], t: Any) -> tuple[Any, Any]:
        from . import products

        return products.product(self, kind, u, ctx, t)

    # -- kernels -----------------------------------------------------------------------------
    def differentiable(self, kind: str, how: str, *, with_outputs: bool, with_jacobian: bool,
                       recomputed: bool = False) -> Any:  # (each of its builds recomputes)
        from .differentiable import derivatives

        return derivatives(self, kind, how)

    def rematerialized(self, fn: Any) -> Any:
        return jax.checkpoint(fn)

    def differentiable_output_shape(self, u: Any, ctx: tuple[Any, ...]) -> tuple[int, ...]:
        y = jax.eval_shape(lambda a, c: self._batch(self.args, a, c), u, ctx)
        return tuple(int(d) for d in y.shape[1:])

    def build_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool,
                     budget: CallBudget = UNTUNED) -> Kernel:
        return JaxKernel(self, mode, chunk_size, with_outputs, budget)

    def build_second_kernel(self, kind: SecondKind, order: Order, chunk_size: int,
                            with_outputs: bool, with_jacobian: bool) -> Kernel:
        return JaxSecondKernel(self, kind, order, chunk_size, with_outputs, with_jacobian)


def _leaf_key(leaf: Any) -> Hashable:
    if _is_array(leaf):
        return ("array", tuple(np.shape(leaf)), str(leaf.dtype))
    try:
        hash(leaf)
    except TypeError:
        return ("id", id(leaf))
    return leaf


def _traced_for(found: tuple[tuple[Any, tuple[Any, ...]], Any] | None, u: Any,
                ctx: tuple[Any, ...]) -> Any:
    """The trace of a ``((u, ctx), trace)`` record if it was made of these very arrays."""
    if found is None or found[0][0] is not u or len(found[0][1]) != len(ctx) \
            or not all(a is b for a, b in zip(found[0][1], ctx)):
        return None
    return found[1]


def _default_device() -> Any:
    """The device JAX computes on when nothing is committed elsewhere."""
    return getattr(jax.config, "jax_default_device", None) or jax.devices()[0]


def _free_bytes(device: Any) -> int | None:
    if getattr(device, "platform", "cpu") == "cpu":
        return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a platform without memory statistics
        return None
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    return None if limit is None else max(0, int(limit) - int(used))


OPS = JaxOps()


class JaxBackend(Backend):
    caches_differentiable_binds = False  # (the model's arrays may be tracers of jax.grad)
    name = "jax"

    def bind(self, model: Any, signature: Signature, **options: Any) -> BoundModel:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise InputError(
                f"Unknown JAX backend option(s) {unknown}; the options are {list(_OPTIONS)}: "
                f"'params' for a model f(params, x), 'per_instance' (bool) for a model that "
                f"maps one instance, not a batch."
            )
        per_instance = options.get("per_instance")
        if per_instance is not None and not isinstance(per_instance, (bool, np.bool_)):
            raise InputError(
                f"backend_options['per_instance'] must be True or False; got {per_instance!r}."
            )
        guess = per_instance is None and kinds.per_instance(model)
        model, kwargs = kinds.as_function(model, options)
        if not callable(model):
            raise InputError(
                f"`model` must be callable (a function of a batch, f(x), or f(params, x) with "
                f"backend_options={{'params': params}}); got {type(model).__name__}."
            )
        _require_x64(signature.dtype)
        device = options.get("device")
        if device is not None and not isinstance(device, jax.Device):
            raise InputError(f"backend_options['device'] must be a jax.Device (e.g. "
                             f"jax.devices()[0]); got {device!r}.")
        dtype = np.dtype(signature.dtype).name
        if isinstance(model, kinds.KerasStateless) and (
                dtype == "float64" or _keras_compat.clone_needed(model.model, dtype)):
            model = model.widened(*sample_inputs(signature), dtype)
        bound = JaxBound(model, signature, per_instance=bool(per_instance), device=device,
                         **kwargs)
        if guess:
            bound.per_instance = bound.maps_one_instance()
        return bound

    def device_options(self, model: Any, device: Any, options: dict[str, Any]) -> dict[str, Any]:
        """Arrays committed to a device other than the default one: the kernels are compiled
        for that device (an executable compiled for the default device refuses them)."""
        if "device" in options or device is None or device == _default_device():
            return options
        return {**options, "device": device}

    def options_key(self, options: dict[str, Any]) -> Hashable:
        """A hashable key for caching bound models: params by structure, shapes and dtypes
        (their values are kernel arguments, see :meth:`JaxBound.update`)."""
        key: list[Any] = []
        for name, value in sorted(options.items()):
            if name in ("params", "state"):
                leaves, treedef = jax.tree_util.tree_flatten(value)
                try:
                    hash(treedef)
                    tkey: Hashable = treedef
                except TypeError:
                    tkey = ("id", id(value))
                key.append((name, tkey, tuple(_leaf_key(leaf) for leaf in leaves)))
            else:
                key.append((name, _leaf_key(value)))
        return tuple(key)


BACKEND = JaxBackend()
