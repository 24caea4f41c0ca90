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
independent), was 1.27x slower on W1 at 4,096 rows and 1.1x on W2 in reverse mode, and at
1,000 rows of W1 it timed 5-10% faster as a bare kernel but no faster within batchjac in
the benchmark (re-measured 2026-11-30). Each kernel is traced once and compiled ahead of
time for its fixed chunk shape (``jit(...).lower(...).compile()``; calling the compiled
executable skips jit's argument matching), on the CPU in two builds, each also computing
the chunk in blocks of ~128 rows inside the one call, that the first call times against each
other (see :class:`JaxKernel`).

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
import functools
import types
import warnings
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..._errors import (
    BatchJacError,
    ForwardModeFallbackWarning,
    InputError,
    ModelError,
    OrderFailedError,
    ReverseModeFallbackWarning,
    UnwatchedValuesWarning,
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
    asked_mode_failed,
    fallback_allowed,
    fallback_message,
    first_line,
    in_mode_race,
    other_mode,
    race,
    user_stacklevel,
)

if TYPE_CHECKING:
    from .executables import Options

_OPTIONS = ("params", "per_instance", "device")
#: why a mode fails in JAX, for the fallback's warning and error
_CAUSES: dict[Mode, str] = {
    "forward": "Usual cause: a jax.custom_vjp function, which has no forward-mode rule.",
    "reverse": ("Usual cause: lax.while_loop (or fori_loop with traced bounds), which has no "
                "reverse-mode rule."),
}
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


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _cast_floats(leaves: list[Any], dtype: np.dtype) -> list[Any]:
    return [x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype
            else x for x in leaves]


class _Split:
    """A pytree cut into its array leaves (kernel arguments) and the rest (static)."""

    def __init__(self, tree: Any, device: Any = None) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        self.treedef: Any = treedef
        self.where = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        self.arrays = [jax.device_put(leaves[i], device) for i in self.where]
        self.static = [None if _is_array(leaf) else leaf for leaf in leaves]

    def merge(self, arrays: list[Any]) -> Any:
        leaves = list(self.static)
        for i, a in zip(self.where, arrays):
            leaves[i] = a
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


_NO_PARAMS = object()


class JaxBound(BoundModel):
    #: ``jacfwd`` traces and compiles quicker than ``jacrev`` and runs as fast where the widths
    #: are close: W1 (5 unknowns, 4 outputs, 1,000 rows) in a fresh process, batchjac's first
    #: call 161-172 ms forward against 221-227 ms reverse, steady 0.36-0.47 ms against
    #: 0.34-0.47 ms (the native first calls: jit(vmap(jacfwd)) 121 ms, jacrev 160 ms). In
    #: TensorFlow (ForwardAccumulator: 399 against 147 ms) and PyTorch (1.14 s against 0.25 s)
    #: forward mode costs more, and they keep the default
    forward_bias: ClassVar[float] = 1.5
    #: full Hessians pushed forward by :mod:`.laplacian`'s rule set (JaxSecondKernel)
    forward_hessian: ClassVar[bool] = True

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
        self._sites = _Sites()
        self._captured = _captured_values(model, self._sites)
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
        if self._x64 == x64_enabled() and self._sites.unchanged():
            return False  # every value the traces baked in is still where it was read
        sites = _Sites()
        captured = _captured_values(self.model, sites)
        changed = sites.contents() != self._sites.contents()  # a numpy array changed in place
        self._sites = sites
        self._warn_unwatched()
        if self._x64 != x64_enabled() or not _same_values(captured, self._captured) or changed:
            # the x64 mode changes the dtypes of traced arrays; rebound closure values (or
            # numpy arrays changed in place) would be stale constants in the compiled
            # kernels: trace everything again
            self._model_split = _Split(self.model, self.device)
            self._params_split = _Split(self._params, self.device)
            self._kernels.clear()
            self.__dict__.pop("_second_kernels", None)
            self.failed.clear()
            self._forward = None
            self.probed = False
            self._x64 = x64_enabled()
            self._captured = captured
            return True
        return False

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
        if hasattr(jax, "enable_x64"):  # jax >= 0.7: a config state usable as a context
            return jax.enable_x64(x64)  # type: ignore[no-any-return]
        from jax.experimental import enable_x64  # type: ignore[attr-defined]  # pragma: no cover

        return enable_x64(x64)  # type: ignore[no-any-return]  # pragma: no cover

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

    # -- kernels -----------------------------------------------------------------------------
    def build_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool) -> Kernel:
        return JaxKernel(self, mode, chunk_size, with_outputs)

    def build_second_kernel(self, kind: SecondKind, order: Order, chunk_size: int,
                            with_outputs: bool, with_jacobian: bool) -> Kernel:
        return JaxSecondKernel(self, kind, order, chunk_size, with_outputs, with_jacobian)


class JaxKernel(Kernel):
    """The compiled chunk kernel, in one of several builds of the same computation.

    *Builds*: XLA's defaults ("default"), whose matrix products are YNNPACK library calls on
    the CPU, or XLA's own dot emitter ("no-ynnpack", the ``xla_cpu_experimental_ynn_fusion_type``
    option emptied). Neither always wins: measured on this 2-core CPU, the second takes 0.73x
    the time on a W2 chunk (313 vs 429 ms) and 0.85-0.9x on W3, the same on W1 at 1,000 rows,
    and as a bare kernel 0.97x on W4 but 1.07x on W1 at 6,252 rows.

    *Blocks* ("default/125": that build, the chunk computed 125 rows at a time in a
    ``lax.map`` inside the one compiled call). XLA's CPU runtime splits each large operation
    of a chunk over its thread pool, and for small chunks the hand-offs cost more than they
    save: W1 at 1,000 rows takes 0.52 ms pinned to one core and 0.65-0.70 ms on two. In
    blocks of 100-200 rows no operation is large enough to be split, and the same chunk took
    0.71-0.80x the time (W1, 1,000 rows), 0.91x on W2 (100 rows of 2,500); above ~240 rows
    the gain is gone, and convolutions (W4: 2x slower) and wide forward mode (W3: 1.2-2x)
    lose. So only :data:`BLOCK_ROWS` are tried, on chunks at least twice as large.

    The first call compiles every variant and times them in one
    :func:`~batchjac._backends._base.race` of interleaved rounds (those clearly slower in a
    first timing left out): "no-ynnpack" must beat "default" by ``MARGIN``, blocks the faster
    of those by ``BLOCK_MARGIN``. Unless a variant was fixed with :meth:`use` (stores,
    reproducible solves) or ``BATCHJAC_AUTOTUNE=off``: then "default". On a GPU, or a JAX
    without that option, there is only "default".

    *The quick build* ("quick": XLA at optimization level 0 without its fusion emitters, on
    the CPU) is a first call's build when the chunk's elementwise work is at most
    :data:`QUICK_ELEMENTS` (counted from the traced equations, :mod:`batchjac._backends.jax.cost`):
    it compiles in a third to 40% of the time, and runs XLA's own loops 2-3x slower (matrix
    products are library calls either way). Measured on the project's 2-core CPU, fresh
    processes, ``jit(vmap(jacfwd))`` of the whole input, compile / steady run: W1, 1,000 rows,
    24-29 ms / 2.6-4.0 ms against the default build's 73-82 ms / 0.9 ms (level 0 alone, the
    earlier quick build: 59 ms / 2.5-5 ms); W3, 1,000 rows, 36-38 / 25 ms against 97 / 16 ms
    (level 0 alone 65-72 / 32 ms); W1 at 10,000 rows 30 / 30 ms against 85 / 16 ms, where
    it no longer pays. Batchjac's W1 first call: 81-90 ms against 129-139 with level 0 alone
    (the native ``jit(vmap(jacfwd))``: 118-138 ms). It is never raced and never a store's
    build: the race the first call skipped, once the work repays it (:mod:`batchjac._tuning`),
    replaces it with the fastest of the others. Chunks with wide matrix products
    (:data:`WIDE_PRODUCTS`) take "no-ynnpack" as their first build, untimed, for the same
    reason: the cost model's choice beats a race the first call cannot repay.
    """

    _OPTIONS: ClassVar[dict[str, Options]] = {
        "default": {}, "no-ynnpack": {"xla_cpu_experimental_ynn_fusion_type": ""},
        "quick": {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": False}}
    #: calls whose equations other than matrix products and convolutions write at most
    #: this many elements (in all their chunks) compile "quick" first: at 0.3-1 ns more an
    #: element, the quick build costs at most ~40 ms more a call, less than the 50-60 ms its
    #: compilation saves (W1: 2.6 million per 1,000 rows; W3 16 million; W2 at 10,000 rows 340 million)
    QUICK_ELEMENTS = 4e7
    #: chunks of at least this many floating-point operations in matrix products compile
    #: "no-ynnpack" first (W2's 10,000 rows: 5.9e10, 273 against 361 ms a chunk; W3's 10,000
    #: rows 2e10, 179 against 196 ms; W2's 2,000 rows and W4's 1,000 the same either way)
    WIDE_PRODUCTS = 1e10
    #: below this ratio of times, "no-ynnpack" is chosen
    MARGIN = 0.97
    #: block sizes tried (each made even over the chunk: 1,000 rows in blocks of 125)
    BLOCK_ROWS = (128,)
    #: below this ratio of times, computing in blocks is chosen
    BLOCK_MARGIN = 0.95
    #: variants slower than the fastest by this factor in a first timing are not raced
    PRUNE = 1.3
    #: blocks are tried where their temporary arrays take at most this many bytes
    BLOCK_MAX_BYTES = 4 << 20

    asynchronous = True

    def __init__(self, bound: JaxBound, mode: Mode, chunk_size: int, with_outputs: bool) -> None:
        self.mode, self.chunk_size, self.with_outputs = mode, chunk_size, with_outputs
        self._bound = bound
        self._lowered: dict[int, Any] = {}  # block rows (the chunk size: no blocks) -> lowering
        self._compiled: dict[str, Any] = {}
        #: the mode computed: ``mode``, or the other one where ``mode`` fails for this model
        #: and the call did not ask for it (see :meth:`_compile_default`)
        self._computes: Mode = mode
        self.failure = ""  # why ``mode`` failed, when ``computes`` is the other mode
        self._jaxpr: Any = None  # the chunk's traced equations (the quick build's count)
        #: the variant compiled first: "quick" for a small chunk on the CPU, else "default",
        #: or the one an earlier race chose, loaded from the disk (:meth:`_load_recalled`)
        self._first = "default"
        self._compile_default()
        self._builds: tuple[str, ...] = ("default",)
        if jax.default_backend() == "cpu":
            self._builds = ("default", "no-ynnpack")
        self._variants: tuple[str, ...] | None = None
        self._fn = self._compiled[self._first]
        self.variant, self.note = None, ""

    @property
    def computes(self) -> Mode:
        return self._computes

    @property  # type: ignore[override]
    def variants(self) -> tuple[str, ...]:
        """The builds, then each in blocks where :meth:`_block_sizes` allows: read when first
        asked (a race, a remembered blocked build), since the block sizes need the default
        build's memory analysis (2-4 ms), which a first call that races nothing never uses."""
        if self._variants is None:
            self._variants = self._builds + tuple(f"{b}/{rows}" for b in self._builds
                                                  for rows in self._block_sizes())
        return self._variants

    @variants.setter
    def variants(self, value: tuple[str, ...]) -> None:
        self._variants = tuple(value)

    def _hinted(self, build: str, blocked: bool) -> str:
        """The variant of a hint: ``build``, in blocks if this chunk has them and the hint
        was blocked."""
        if not blocked:
            return build
        return next((v for v in self.variants if v.startswith(build + "/")), build)

    def _compile_default(self) -> None:
        """Trace and compile the default build of ``mode``. Where that fails (JAX has no
        reverse mode for ``lax.while_loop`` with traced bounds, no forward mode for
        ``custom_vjp``) and the other mode works, the kernel computes the other mode, with one
        warning, unless the call asked for the mode: that call gets a ModelError naming the
        other mode. Where both fail, the model's error for ``mode`` is raised."""
        bound = self._bound
        if not fallback_allowed() and self.mode in bound.failed:  # a kernel of another size
            raise asked_mode_failed(self.mode, bound.failed[self.mode], _CAUSES[self.mode])
        failed: Exception | None = None
        for mode in (self.mode, other_mode(self.mode)):
            if mode in bound.failed:  # the other mode worked for a kernel of another size
                self.failure = bound.failed[mode]
                continue
            self._computes = mode
            self._lowered.clear()
            try:  # each build of one blocking compiles the same lowering
                recalled = self._load_recalled()
                if recalled is not None:
                    self._first, compiled = recalled
                else:
                    lowered = self._lowering(self.chunk_size)
                    self._first = self._first_build()
                    try:
                        compiled = self._load_or_compile(lowered, self._OPTIONS[self._first])
                    except Exception:  # an XLA without that option: its defaults (a model's
                        if self._first == "default":  # failure fails those too)
                            raise
                        self._first = "default"
                        compiled = self._load_or_compile(lowered, {})
                self._compiled[self._first] = compiled
            except InputError:
                raise
            except Exception as e:
                if isinstance(e, Warning):  # warnings as errors: not the model's failure
                    raise
                error = e if isinstance(e, ModelError) else bound._explain(e)
                if error is not e:
                    error.__cause__ = e
                failed = failed or error
                continue
            if mode != self.mode:  # the failure is the mode's, not the model's
                if failed is not None:
                    self.failure = bound.failed[self.mode] = first_line(failed)
                if not fallback_allowed():
                    raise asked_mode_failed(self.mode, self.failure, _CAUSES[self.mode]) from failed
                self._warn_fallback()
            return
        assert failed is not None
        raise failed

    def _load_recalled(self) -> tuple[str, Any] | None:
        """The variant an earlier process's race chose (:func:`~batchjac._backends._base.recalled_variant`)
        and its executable, where that process left it on disk: loading it (2-14 ms) is
        cheaper than compiling even the quick build (W1: 80 ms), and it is the faster build.
        A variant in blocks ("default/125") is traced in its blocks only, not first as a whole
        chunk too (a warm W1 first call traced both: 94-106 ms against a cold 82-87 ms). None
        where no race is remembered, the caller fixed the build (a store), or the executable
        is not on disk (the first build is then chosen as usual)."""
        from ..._config import autotune_enabled
        from . import executables as jax_executables
        from .._base import recalled_variant, wanted_variant

        recalled = recalled_variant()
        if recalled is None or wanted_variant() is not None or not autotune_enabled():
            return None
        build, blocked, rows = recalled.partition("/")
        if build not in self._OPTIONS or build == "quick":
            return None
        block = int(rows) if rows.isdigit() else 0
        if blocked and not 0 < block < self.chunk_size:
            return None  # (not a variant this chunk has)
        lowered = self._lowering(block if blocked else self.chunk_size)
        loaded = jax_executables.load(lowered, self._OPTIONS[build],
                                      starting=self._bound.compiling.set)
        return None if loaded is None else (recalled, loaded)

    def _first_build(self) -> str:
        """The build compiled first, on the CPU with tuning on (``BATCHJAC_AUTOTUNE=off`` and
        other devices: "default"): "quick" where the call's elementwise work (the chunk's,
        times the chunks of the rows at hand, :func:`~batchjac._backends._base.call_rows`) is
        too small to repay XLA's full optimisation (:data:`QUICK_ELEMENTS`; it waits for the race that
        replaces it), "no-ynnpack" where its matrix products are wide
        (:data:`WIDE_PRODUCTS`), else "default"."""
        from ..._config import autotune_enabled
        from . import cost as jax_cost
        from .._base import FIRST_VARIANT, rows_at_hand, wanted_variant

        wanted = wanted_variant()
        if wanted == FIRST_VARIANT:
            return "default"  # (variants[0])
        if wanted is not None and wanted.split("/")[0] in self._OPTIONS:
            return wanted.split("/")[0]  # the build the caller fixes (a store's): compiled once
        if jax.default_backend() != "cpu" or not autotune_enabled() or self._jaxpr is None:
            return "default"
        self.work = jax_cost.work(self._jaxpr)
        # the quick build's cost is per element of every chunk of the call (W4's 2,000 images
        # in chunks of 100: 3.1e7 elements a chunk, 6e8 a call, 0.88 against 0.48 s); never in
        # a mode race, which times full builds (provisional): a quick one would be compiled
        # for nothing
        chunks = max(1, -(-rows_at_hand() // self.chunk_size))
        if self.work.elements * chunks <= self.QUICK_ELEMENTS and not in_mode_race():
            return "quick"
        return "no-ynnpack" if self.work.products >= self.WIDE_PRODUCTS else "default"

    #: the chunk's estimated work, where counted
    work: Any = None

    @property
    def cheap_first(self) -> str | None:
        return "quick" if self._first == "quick" else None

    def _warn_fallback(self) -> None:
        bound = self._bound
        kind: type[Warning] = ForwardModeFallbackWarning if self.mode == "forward" \
            else ReverseModeFallbackWarning
        if kind not in bound.warned and not in_mode_race():
            bound.warned.add(kind)
            warnings.warn(fallback_message(self.mode, self.failure, _CAUSES[self.mode]), kind,
                          stacklevel=user_stacklevel())

    def _check_asked(self) -> None:
        """A kernel that fell back, called by a call that asks for its mode: refuse."""
        if self._computes != self.mode and not fallback_allowed():
            raise asked_mode_failed(self.mode, self.failure, _CAUSES[self.mode])

    def _block_sizes(self) -> list[int]:
        """Rows a block for each of BLOCK_ROWS, evened over the chunk: for chunks at least
        twice as large, on the CPU, where a block's temporary arrays take at most
        BLOCK_MAX_BYTES (W1: 0.3 MB, W2: 2.8 MB; W4's convolutions: 29 MB, not tried)."""
        if jax.default_backend() != "cpu":
            return []
        try:  # (the quick build's, before the default build exists)
            temp = self._compiled.get("default", self._compiled[self._first]) \
                .memory_analysis().temp_size_in_bytes
        except Exception:  # no memory analysis in this JAX: no blocks
            return []
        sizes = []
        for rows in self.BLOCK_ROWS:
            if self.chunk_size >= 2 * rows and temp / self.chunk_size * rows <= self.BLOCK_MAX_BYTES:
                sizes.append(-(-self.chunk_size // -(-self.chunk_size // rows)))
        return sizes

    def _body(self, args: Any, u: Any, ctx: tuple[Any, ...]) -> Any:
        """The Jacobians (and outputs) of the rows of ``u``: ``vmap(jacfwd|jacrev)``."""
        one = self._bound._instance_fn(args)
        jac = jax.jacfwd if self._computes == "forward" else jax.jacrev
        if self.with_outputs:
            j, y = jax.vmap(jac(lambda u_i, c_i: (one(u_i, c_i),) * 2, has_aux=True))(u, ctx)
            return y, j
        return jax.vmap(jac(one))(u, ctx)

    def _lowering(self, rows: int) -> Any:
        """The traced kernel computing the chunk ``rows`` rows at a time (the last block
        padded with copies of the chunk's last row, whose results are dropped)."""
        if rows in self._lowered:
            return self._lowered[rows]
        bound, size = self._bound, self.chunk_size

        def traced(args: Any, u: Any, ctx: tuple[Any, ...]) -> Any:
            bound.trace_count += 1
            if rows >= size:
                return self._body(args, u, ctx)
            return in_blocks(lambda b_u, b_c: self._body(args, b_u, b_c), rows, u, ctx)

        u_spec, ctx_spec = bound._specs(size)
        staged = jax.jit(traced).trace(bound.args, u_spec, ctx_spec)
        if rows >= size:
            self._jaxpr = staged.jaxpr
        self._lowered[rows] = staged.lower()
        return self._lowered[rows]

    def _compile(self, variant: str) -> Any:
        if variant not in self._compiled:
            build, _, rows = variant.partition("/")
            lowered = self._lowering(int(rows) if rows else self.chunk_size)
            self._compiled[variant] = self._load_or_compile(lowered, self._OPTIONS[build])
        return self._compiled[variant]

    def _load_or_compile(self, lowered: Any, options: Options) -> Any:
        """XLA's compilation, or the executable an earlier process compiled for the same
        lowered module (:mod:`batchjac._backends.jax.executables`)."""
        from . import executables as jax_executables

        # the probes beside this first kernel may trace once XLA holds the CPU, not Python
        compiled, loaded = jax_executables.compile(lowered, options,
                                                   starting=self._bound.compiling.set)
        self._bound.compile_count += not loaded
        return compiled

    def _select(self, variant: str, note: str) -> None:
        self._fn = self._compile(variant)
        if self._computes != self.mode:
            note = f"{note}; computed in {self._computes} mode ({self.failure})"
        self.variant, self.note = variant, note

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]
                 ) -> tuple[np.ndarray | None, np.ndarray]:
        return self.launch(u, ctx)()

    @property
    def provisional_builds(self) -> int:
        """A quick first build that :meth:`provisional` replaces by a full one: 1."""
        return int(set(self._compiled) == {"quick"})

    def provisional(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]
                    ) -> tuple[np.ndarray | None, np.ndarray]:
        """Before the first call has chosen: what the last kernel of this model chose (its
        build, in blocks if this chunk has them), else the default; nothing is timed. Never
        the quick build: the races that call this (the modes, the chunk sizes) compare full
        builds, since the quick one's slow loops favour whichever mode has fewer of them (W1:
        forward 1.28 against reverse 1.30 ms a chunk at level 0, 0.4 ms either way in full)."""
        self._check_asked()
        fn = self._fn
        if self.variant is None or self.variant == "quick":
            first = "default" if self._first == "quick" else self._first
            fn = self._compile(self._hinted(*(self._bound.hint or (first, False))))
        return self._result(fn(self._bound.args, u, tuple(ctx)), isinstance(u, jax.Array))()

    def launch(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]
               ) -> Callable[[], tuple[np.ndarray | None, np.ndarray]]:
        from .executables import used

        self._check_asked()
        if self.variant is None:
            with self.building:  # (threads sharing the kernel: one chooses its build)
                if self.variant is None:
                    self._first_call(u, ctx)
        used()
        return self._result(self._fn(self._bound.args, u, tuple(ctx)),  # runs in the background
                            isinstance(u, jax.Array))

    def _result(self, out: Any, native: bool = False
                ) -> Callable[[], tuple[np.ndarray | None, np.ndarray]]:
        """The wait for ``out``: numpy views of its buffers, or (``native``: JAX arrays in)
        the JAX arrays themselves, left on their device."""
        from .executables import release

        def wait() -> tuple[Any, Any]:
            if native:  # (waited for as numpy results are: the tuning times these calls)
                res = (tuple(jax.block_until_ready(out)) if self.with_outputs
                       else (None, jax.block_until_ready(out)))
            elif self.with_outputs:
                res = (np.asarray(out[0]), np.asarray(out[1]))
            else:
                res = (None, np.asarray(out))
            release()  # the executables this call compiled are written now, after its result
            return res
        return wait

    def _run(self, variant: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        jax.block_until_ready(self._compiled[variant](self._bound.args, u, tuple(ctx)))

    def _first_call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        from ..._config import autotune_enabled
        from .._base import race_allowed, untimed_note

        if self._forced is not None:
            self._select(self._forced, f"{self._forced} ({self._forced_why})")
            return
        if len(self._builds) == 1 and len(self.variants) == 1:
            self._select("default", "")
            return
        if not race_allowed() and self._first == "quick":
            self._select("quick", f"quick (XLA at optimization level 0, no fusion emitters: "
                                  f"{self.work.elements:.2g} elements of elementwise work a "
                                  f"chunk, too few to repay a full build; {untimed_note()})")
            self.untimed = True
            return
        if not race_allowed():
            # what an earlier kernel of this model chose by timing (none with autotune off)
            hint = self._hinted(*(self._bound.hint or (self._first, False)) if autotune_enabled()
                                else ("default", False))
            self._select(hint, f"{hint} ({untimed_note()})")
            self.untimed = True
            return
        self._race_builds(u, ctx)

    def retune(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        if not self.untimed or self._forced is not None or (
                len(self._builds) == 1 and len(self.variants) == 1):
            return
        self.untimed = False
        self._race_builds(u, ctx)

    def _race_builds(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        try:
            self._compile("no-ynnpack")
        except Exception:  # e.g. a JAX whose XLA has no such option: one build only
            self.variants = tuple(v for v in self.variants if v.split("/")[0] == "default")
        for v in self.variants:
            self._compile(v)
        # one race of all: a second race, minutes later on a shared machine, compared the
        # winner of the first with itself at another load and once took blocks for it
        times = race(lambda v: self._run(v, u, ctx), self.variants, prune=self.PRUNE)
        winner = "default"
        if "no-ynnpack" in times and times["no-ynnpack"] < self.MARGIN * times["default"]:
            winner = "no-ynnpack"
        blocked = [v for v in self.variants if "/" in v]
        if blocked:
            fastest = min(blocked, key=lambda v: times[v])
            if times[fastest] < self.BLOCK_MARGIN * times[winner]:
                winner = fastest
        self._bound.hint = (winner.split("/")[0], "/" in winner)
        timed = ", ".join(f"{v} {t * 1e3:.2f} ms" for v, t in times.items())
        self._select(winner, f"{winner} (timed one chunk: {timed})")
        from .executables import release

        # the race's executables are written now: a process that stops calling after its
        # race (the bench's settle loop) left them unwritten, and the warm process compiled
        release()


def in_blocks(body: Callable[[Any, tuple[Any, ...]], Any], rows: int, u: Any,
              ctx: tuple[Any, ...]) -> Any:
    """``body(u, ctx)`` (traced) computed ``rows`` rows at a time in a ``lax.map`` inside the
    one compiled call, the last block padded with copies of the chunk's last row, whose
    results are dropped."""
    size = int(u.shape[0])
    blocks = -(-size // rows)
    padded = blocks * rows

    def split(a: Any) -> Any:
        if padded > size:
            a = jnp.concatenate([a, jnp.broadcast_to(a[-1:], (padded - size, *a.shape[1:]))])
        return a.reshape((blocks, rows, *a.shape[1:]))

    out = jax.lax.map(lambda b: body(b[0], b[1]), (split(u), tuple(split(c) for c in ctx)))
    return jax.tree_util.tree_map(lambda o: o.reshape((padded, *o.shape[2:]))[:size], out)


# -- values a traced function bakes in -------------------------------------------------------
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_MAX_VISITS = 2000
#: items of one dict, list or tuple the walk reads (the first ones)
_MAX_ITEMS = 256
#: hops through functions and objects (closure cells, globals, attributes) the walk of
#: :func:`_captured_values` follows; dicts, lists and tuples cost none
_MAX_HOPS = 4
#: nested containers and hops together, at most (Python's recursion stays bounded)
_MAX_NESTING = 64


#: the second-order kinds forward over forward pushes through :mod:`.laplacian`'s rule
#: set (value, ``k`` tangents and the second-order terms in one pass), with their names
FORWARD_RULES = {"laplacian": "a forward Laplacian", "diagonal": "a forward Hessian diagonal",
                 "hessian": "a forward Hessian"}


class JaxSecondKernel(Kernel):
    """A second-order kernel (:data:`~batchjac._backends._base.SecondKind`), compiled ahead of
    time for its chunk shape as :class:`JaxKernel` is (for the forward rules on the CPU, for
    one block of rows, :meth:`_block_rows`), per instance under ``vmap``:

    - forward over reverse: ``jacfwd(jacrev(f))``, the native ``jax.hessian``; ``hvp`` is
      ``jvp(jacrev(f), (x,), (v,))`` (one tangent, no Hessian formed);
    - forward over forward: the rule set of :mod:`.laplacian`, one pass of the value,
      its ``k`` tangents and the second-order terms, the primal and first-order work done
      once: one summed term for the Laplacian (W7: ``k + 2`` matrix products a layer against
      ``2k + 1`` for ``jvp`` of ``jvp``), ``k`` for the diagonal, the ``k(k+1)/2`` pairs of
      the upper triangle for the full Hessian (W6: 21 terms where ``jacfwd(jacrev)`` pushes
      30; bare kernels of 10,000 rows, not the batchjac call, in fresh processes: first call
      261-296 ms against the native ``jit(vmap(hessian))`` 284-346 ms, steady 51-62 against
      67-89 ms; the batchjac calls are in BENCHMARKS.md, W6). Where the
      model has a primitive without a rule there (the note names it): ``jvp`` of ``jvp``
      along each unit tangent ``e_j``, ``vmap``-ed over the ``k`` tangents (the diagonal,
      summed for the Laplacian), ``jacfwd(jacfwd(f))`` (the full Hessian). No race between
      them: the rule set does a subset of the other's work.

    One build, no race (on the CPU without XLA's fusion emitters, and the forward Laplacian
    without YNNPACK's fusions too, :meth:`_compile`). The executable is remembered on disk
    (:mod:`batchjac._backends.jax.executables`).
    """

    def __init__(self, bound: JaxBound, kind: SecondKind, order: Order, chunk_size: int,
                 with_outputs: bool, with_jacobian: bool) -> None:
        self.mode = "forward"  # the outer differentiation, in both orders
        self.kind, self.order = kind, order
        self.chunk_size, self.with_outputs, self.with_jacobian = chunk_size, with_outputs, with_jacobian
        self._bound = bound
        #: why the forward rule set (Laplacian, diagonal or Hessian) could not be used (its
        #: primitive): ``jvp`` of ``jvp`` (the diagonal, the Laplacian) or ``jacfwd(jacfwd)``
        #: (the Hessian) instead
        self.forward_rules_failed = ""
        #: rows of each call of the executable (the chunk's, or a block's: :meth:`__call__`)
        self.block_rows = self._block_rows(kind, order, chunk_size)
        u_spec, ctx_spec = bound._specs(self.block_rows)
        if kind == "hvp":
            ctx_spec = (*ctx_spec, u_spec)  # the tangents follow the model's arrays

        def traced(args: Any, u: Any, ctx: tuple[Any, ...]) -> Any:
            bound.trace_count += 1
            return self._body(args, u, ctx)

        try:
            lowered = jax.jit(traced).lower(bound.args, u_spec, ctx_spec)
            # remembered on disk as the first-order kernels are (a warm process loads it)
            self._fn, loaded = self._compile(lowered)
            bound.compile_count += not loaded
        except Exception as e:
            cause = e.__cause__ if isinstance(e, ModelError) else e  # (the model's call: _call)
            if order == "forward-over-forward" and isinstance(cause, Exception) and \
                    not isinstance(cause, BatchJacError) and _no_forward_rule(cause):
                raise OrderFailedError(
                    f"Second derivatives cannot be computed with mode='forward-over-forward' "
                    f"for this model: it calls a jax.custom_vjp function, which has no "
                    f"forward-mode rule ({first_line(cause)[:200]}). Pass "
                    f"mode='forward-over-reverse' (or 'auto'), which differentiates its vjp "
                    f"rule in forward mode, or define the function with jax.custom_jvp.") from e
            if isinstance(e, (BatchJacError, Warning)):
                raise
            raise bound._explain(e) from e
        self.note = f"{kind}: {order}"
        if kind in FORWARD_RULES and order == "forward-over-forward":
            other = "jacfwd of jacfwd" if kind == "hessian" else "jvp of jvp along each unknown"
            self.note += (f", {other} ({self.forward_rules_failed})" if self.forward_rules_failed
                          else f", {FORWARD_RULES[kind]} (one pass)")

    #: second-order kernels on the CPU compile without XLA's fusion emitters (the older
    #: loop emitter): they compile sooner and run as fast. Fresh processes, first call /
    #: steady call, with the emitters against without: W6 210-240 / 16.0 ms against 175 /
    #: 15.2 ms; W7 400-410 / 174 against 357-390 / 173-178 ms (both without YNNPACK's
    #: fusions); W7H 530-550 / 282 against 500-530 / 278-302 ms
    CPU_OPTIONS: ClassVar[dict[str, str | bool]] = {"xla_cpu_use_fusion_emitters": False}
    #: the forward Laplacian's matrix products, each alone in a YNNPACK call, on the CPU; then,
    #: where an XLA does not know that fusion type, no YNNPACK fusions at all
    LAPLACIAN_YNN: ClassVar[tuple[str, ...]] = ("LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT", "")

    def _options(self) -> list[dict[str, str | bool]]:
        """XLA's options for this kernel, the first an XLA accepts: see :meth:`_compile`."""
        if jax.default_backend() != "cpu":
            return [{}]
        if not (self.uses_forward_rules and self.kind == "laplacian"):
            return [dict(self.CPU_OPTIONS), {}]
        return [{**self.CPU_OPTIONS, "xla_cpu_experimental_ynn_fusion_type": ynn}
                for ynn in self.LAPLACIAN_YNN] + [{}]

    def _compile(self, lowered: Any) -> tuple[Any, bool]:
        """The executable (loaded from the disk cache, or compiled) and whether it was loaded.
        On the CPU without the fusion emitters (:data:`CPU_OPTIONS`). The forward Laplacian
        also without XLA's YNNPACK fusions, which fold its elementwise terms into the matrix
        products badly: W7's kernel (20,000 rows, bare, side by side under load) took 272 ms
        with them, 108 ms without, the native trace of ``jit(vmap(hessian))`` 180 ms (default
        build; 214 ms without them). Its matrix products each alone in a YNNPACK call
        (:data:`LAPLACIAN_YNN`) start sooner than XLA's own, whose first run generates oneDNN's
        matrix kernels (W7, fresh processes: first block 13 against 30 ms, first call 339-354
        against 358-367 ms, steady 176-182 against 183-188 ms). The forward Hessian keeps the
        fusions (W6 steady, one bench run each: 18.4 ms with them, 22.0 without; W6 and W7H
        the same with the products alone). An XLA that refuses an option set compiles with
        the next (:meth:`_options`), the last its defaults."""
        from . import executables as jax_executables

        starting = self._bound.compiling.set
        *preferred, last = self._options()
        for options in preferred:
            try:
                return jax_executables.compile(lowered, options, starting=starting)
            except Exception:  # an XLA without these options: the next ones
                pass
        return jax_executables.compile(lowered, last, starting=starting)

    @property
    def uses_forward_rules(self) -> bool:
        """Whether the kernel pushes the second-order terms forward (:mod:`.laplacian`)."""
        return self.kind in FORWARD_RULES and self.order == "forward-over-forward" and \
            not self.forward_rules_failed

    def _body(self, args: Any, u: Any, ctx: tuple[Any, ...]) -> dict[str, Any]:
        one = self._bound._instance_fn(args)
        ushape = tuple(u.shape[1:])
        k = int(np.prod(ushape, dtype=np.int64))
        kind, order = self.kind, self.order
        found = None
        if kind in FORWARD_RULES and order == "forward-over-forward":
            found = self._forward_rules(one, u, ctx)

        def per_instance(u_i: Any, c_i: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            """``(y, J, result)`` of one instance."""
            if kind == "hvp":
                c_i, v_i = c_i[:-1], c_i[-1]
            f = functools.partial(lambda c, a: one(a, c), c_i)
            if kind in ("diagonal", "laplacian", "hvp") and order == "forward-over-forward":
                basis = jnp.eye(k, dtype=u_i.dtype).reshape((k, *ushape))

                def along(t: Any) -> tuple[Any, Any, Any]:
                    # along e_j twice (diagonal), or along e_j then v: (H v)_j
                    second = v_i if kind == "hvp" else t
                    (y, dy), (_, d2y) = jax.jvp(lambda a: jax.jvp(f, (a,), (t,)), (u_i,), (second,))
                    return y, dy, d2y

                y, dys, d2s = jax.vmap(along, out_axes=(None, 0, 0))(basis)  # (k, *out)
                jac = jnp.moveaxis(dys, 0, -1)
                diag = jnp.moveaxis(d2s, 0, -1)
                if kind == "laplacian":
                    return y, jac.reshape((*y.shape, *ushape)), diag.sum(-1)
                return y, jac.reshape((*y.shape, *ushape)), diag.reshape((*y.shape, *ushape))
            inner = jax.jacrev if order == "forward-over-reverse" else jax.jacfwd

            def jac_y(a: Any) -> tuple[Any, tuple[Any, Any]]:
                j, y = inner(lambda b: (f(b),) * 2, has_aux=True)(a)
                return j, (j, y)

            if kind == "hvp":
                jac, hv, (_, y) = jax.jvp(jac_y, (u_i,), (v_i,), has_aux=True)
                return y, jac, hv
            h, (jac, y) = jax.jacfwd(jac_y, has_aux=True)(u_i)
            if kind == "hessian":
                return y, jac, h
            flat = h.reshape((*y.shape, k, k))
            diag = jnp.diagonal(flat, axis1=-2, axis2=-1)
            if kind == "laplacian":
                return y, jac, diag.sum(-1)
            return y, jac, diag.reshape((*y.shape, *ushape))

        y, jac, second = jax.vmap(per_instance)(u, ctx) if found is None else found
        out = {SECOND_RESULT[kind]: second}
        if self.with_outputs:
            out["outputs"] = y
        if self.with_jacobian:
            out["jacobians"] = jac
        return out

    #: rows of a block of the forward rules' kernels, for chunks at least twice as large:
    #: their temporaries ((k + 2) values per activation for the Laplacian) then stay in
    #: cache. W7, one chunk of 100,000 rows, bare kernels side by side under load, ratio to
    #: the native trace of ``jit(vmap(hessian))``: one block 0.54, blocks of 128 rows 0.34,
    #: 512 0.28, 1,024 0.29, 2,048 0.23, 4,096 0.25. On the CPU only (as :class:`JaxKernel`'s
    #: blocks): a GPU's cache is not what a block of rows would be sized for (unmeasured).
    #: Since compiled a block at a time, each block alone in YNNPACK's products (fresh
    #: processes, first call / steady median): W7 blocks of 1,024 rows 0.36-0.38 / 0.20 s,
    #: 2,048 0.34-0.36 / 0.17-0.18 s, 4,096 0.32-0.34 / 0.17 s, 8,192 0.46-0.47 / 0.28 s
    LAPLACIAN_BLOCK_ROWS = 4096
    #: the same for the diagonal and the Hessian, whose activations carry more values (W7H:
    #: 10 against the Laplacian's 5): W7H at 2,048 rows 0.54 / 0.27 s, 4,096 0.56-0.60 /
    #: 0.27-0.28 s; W6 the same at either
    HESSIAN_BLOCK_ROWS = 2048

    @classmethod
    def _block_rows(cls, kind: SecondKind, order: Order, chunk_size: int) -> int:
        """Rows of one call of the executable: the chunk's, or for the forward rules on the
        CPU a block of about :attr:`LAPLACIAN_BLOCK_ROWS` (:attr:`HESSIAN_BLOCK_ROWS` for the
        diagonal and the Hessian) evened over the chunk, which
        :meth:`__call__` loops over. The executable is then compiled for one block, not for a
        ``lax.map`` over the blocks inside one call: W7 (100,000 rows, fresh processes, this
        machine) compiled in 126-135 ms against 188-199 ms, and ran as fast (0.18-0.20 s both)."""
        limit = cls.LAPLACIAN_BLOCK_ROWS if kind == "laplacian" else cls.HESSIAN_BLOCK_ROWS
        blocked = kind in FORWARD_RULES and order == "forward-over-forward" and \
            chunk_size >= 2 * limit and jax.default_backend() == "cpu"
        if not blocked:
            return chunk_size
        return -(-chunk_size // -(-chunk_size // limit))

    def _forward_rules(self, one: Callable[[Any, tuple[Any, ...]], Any], u: Any,
                       ctx: tuple[Any, ...]) -> tuple[Any, Any, Any] | None:
        """``(y, J, result)`` of the chunk in one pass per instance (:mod:`.laplacian`,
        over the jaxpr of one instance's function, ``vmap``-ed over the rows), or None where
        that jaxpr has a primitive without a rule (``self.forward_rules_failed`` names it; the
        body then computes the same values the other way). Decided here, once, while the
        kernel is traced."""
        from . import laplacian as jax_laplacian

        ushape = tuple(u.shape[1:])
        kind = self.kind
        specs = (jax.ShapeDtypeStruct(ushape, u.dtype),
                 tuple(jax.ShapeDtypeStruct(tuple(c.shape[1:]), c.dtype) for c in ctx))
        closed = jax_laplacian.trace(one, *specs)
        push = {"laplacian": jax_laplacian.run, "diagonal": jax_laplacian.run_diagonal,
                "hessian": jax_laplacian.run_hessian}[kind]

        def per_instance(u_i: Any, c_i: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            y, d, second = push(closed, u_i, *jax.tree_util.tree_leaves(c_i))
            jac = jnp.moveaxis(d, 0, -1).reshape((*y.shape, *ushape))
            if kind == "diagonal":
                second = jnp.moveaxis(second, 0, -1).reshape((*y.shape, *ushape))
            elif kind == "hessian":
                second = jnp.moveaxis(second, (0, 1), (-2, -1)).reshape(
                    (*y.shape, *ushape, *ushape))
            return y, jac, second

        try:
            # the rules' jax.numpy calls inlined into this trace, not each traced as a jit of
            # its own first (the model's jaxpr is walked, not called: its own jits stay): W7's
            # trace 22-27 ms against 28-43 ms, fresh processes side by side
            with jax.disable_jit():
                return jax.vmap(per_instance)(u, ctx)  # type: ignore[no-any-return]
        except jax_laplacian.Unsupported as e:
            self.forward_rules_failed = str(e)
            return None

    # a mapping of named arrays, which the runner takes as it takes a Jacobian kernel's pair
    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]  # type: ignore[override]
                 ) -> dict[str, np.ndarray]:
        from .executables import release, used

        used()
        size, rows = int(u.shape[0]), self.block_rows
        on_device = isinstance(u, jax.Array)  # JAX arrays in: left on their device
        if rows == size:
            out = self._fn(self._bound.args, u, tuple(ctx))
            res = dict(out) if on_device else {name: np.asarray(a) for name, a in out.items()}
        else:  # block by block (all queued before the first is read), the last one padded
            from ..._xp import NUMPY

            xp = JaxOps() if on_device else NUMPY

            def block(a: Any, lo: int) -> Any:
                part = a[lo:lo + rows]
                return part if part.shape[0] == rows else xp.pad_rows(part, rows)

            outs = [self._fn(self._bound.args, block(u, lo), tuple(block(c, lo) for c in ctx))
                    for lo in range(0, size, rows)]
            res = {name: xp.concat([o[name] if on_device else np.asarray(o[name])
                                    for o in outs])[:size] for name in outs[0]}
        release()  # the executable this call compiled is written now, after its result
        return res


def _no_forward_rule(e: Exception) -> bool:
    """Whether ``e`` is JAX refusing forward mode through a ``custom_vjp`` function (directly,
    or its linearised form inside a second forward pass)."""
    text = f"{type(e).__name__}: {e}"
    return ("custom_vjp" in text and "forward-mode" in text) or "'custom_lin'" in text


class _Sites:
    """Where :func:`_captured_values` found each value: (container, key, value) triples and
    container sizes. Re-reading them (:meth:`unchanged`, a few microseconds) tells whether a
    new walk could find anything else: the walk follows the same keys, so if every key holds
    the same object and no walked container changed size, it would find the same values.
    A numpy array is the same object after an in-place change (``W *= 0.9``), which jax.jit,
    having baked its old values in, would not see: each writeable one found is kept with a
    checksum of its contents (:func:`_contents`, CRC-32: ~1 ms a MB), compared too."""

    _MISSING = object()

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
            code = log.read(obj, "__code__", obj.__code__)
            visit_code(code, obj.__globals__, hops, nested)
            for cell in log.read(obj, "__closure__", obj.__closure__) or ():
                with contextlib.suppress(ValueError):  # an empty cell has no contents
                    visit(log.read(cell, "cell_contents", cell.cell_contents), hops + 1, True,
                          nested + 1)
            visit(log.read(obj, "__defaults__", obj.__defaults__) or (), hops + 1, True, nested + 1)
            visit(log.read(obj, "__kwdefaults__", obj.__kwdefaults__) or {}, hops + 1, True,
                  nested + 1)
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

    def visit_code(code: types.CodeType, glb: dict[str, Any], hops: int, nested: int) -> None:
        for name in _global_names(code):
            value = glb.get(name, _Sites._MISSING)
            log.read(glb, name, value)
            if value is not _Sites._MISSING:
                visit(value, hops + 1, True, nested + 1)

    visit(fn, 0, False)
    return found


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names ``code`` and the functions nested in it may look up as globals."""
    names = dict.fromkeys(code.co_names)
    for const in code.co_consts:  # nested functions and lambdas
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(_global_names(const)))
    return tuple(names)


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
        that becomes the JAX result without a copy (:meth:`sealed`). XLA's CPU concatenate joins
        W2's 64 chunks of 156 rows (313 MB) in 170-190 ms, slower than the chunking saves
        (1.0-1.37x the native one-chunk baseline), where a numpy copy of each chunk as it
        comes takes 41 ms in all. Off the CPU, None: the chunks are joined on the device."""
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

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        return jax.device_put(a, device) if device is not None else jnp.asarray(a)

    def to_device(self, a: Any, device: Any) -> Any:
        # committed to it: on the same device that shares the buffer (no copy)
        return a if a.committed and a.devices() == {device} else jax.device_put(a, device)


OPS = JaxOps()


class _HostBuffer:
    """A result written on the host and handed to JAX as it is: ``jax.device_put`` of an
    array aligned to :data:`ALIGN` bytes onto a CPU device takes its memory, with no copy
    (PjRt's zero-copy host buffers; a misaligned one would be copied, 180-200 ms for W2's
    313 MB), and keeps the numpy array alive for as long as the JAX array lives. A large
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


class JaxBackend(Backend):
    name = "jax"

    def bind(self, model: Any, signature: Signature, **options: Any) -> BoundModel:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise InputError(
                f"Unknown JAX backend option(s) {unknown}; the options are {list(_OPTIONS)}: "
                f"'params' for a model f(params, x), 'per_instance' (bool) for a model that "
                f"maps one instance, not a batch."
            )
        per_instance = options.get("per_instance", False)
        if not isinstance(per_instance, (bool, np.bool_)):
            raise InputError(
                f"backend_options['per_instance'] must be True or False; got {per_instance!r}."
            )
        if not callable(model):
            raise InputError(
                f"`model` must be callable (a function of a batch, f(x), or f(params, x) with "
                f"backend_options={{'params': params}}); got {type(model).__name__}."
            )
        _require_x64(signature.dtype)
        kwargs = {"params": options["params"]} if "params" in options else {}
        device = options.get("device")
        if device is not None and not isinstance(device, jax.Device):
            raise InputError(f"backend_options['device'] must be a jax.Device (e.g. "
                             f"jax.devices()[0]); got {device!r}.")
        return JaxBound(model, signature, per_instance=bool(per_instance), device=device,
                        **kwargs)

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
            if name == "params":
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
