"""TensorFlow / Keras backend.

Reverse mode is ``GradientTape.batch_jacobian`` (one vectorised backward pass per output);
forward mode pushes one batched tangent per unknown feature through
``tf.autodiff.ForwardAccumulator``, vectorised with ``tf.vectorized_map``. Both are compiled
once per chunk shape, with XLA (``jit_compile=True``) and as a plain graph, and the faster of
the two on one chunk is kept (:class:`TFKernel`); they are called through their concrete
function, which skips tf.function's per-call argument matching (~0.2 ms on a small CPU).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TF's C++ start-up chatter off stderr

import numpy as np
import tensorflow as tf

from .._errors import (
    BatchJacError,
    ForwardModeFallbackWarning,
    InputError,
    ModelError,
    ReverseModeFallbackWarning,
    VectorizationFallbackWarning,
    XLAFallbackWarning as XLAFallbackWarning,
)
from .._spec import assemble
from ._base import (
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


def _keras_module() -> Any | None:
    try:
        import keras
    except ImportError:  # pragma: no cover - keras ships with tensorflow>=2.16
        return None
    return keras


def _is_keras(model: Any) -> bool:
    return any((c.__module__ or "").split(".")[0] in ("keras", "tf_keras")
               for c in type(model).__mro__)


def _widen(cfg: Any) -> Any:
    """A Keras config with every dtype (layers' policies, Input layers, tensors) set to float64."""
    if isinstance(cfg, dict):
        out = {k: _widen(v) for k, v in cfg.items()}
        if isinstance(out.get("dtype"), (str, dict)):
            out["dtype"] = "float64"
        return out
    if isinstance(cfg, list):
        return [_widen(v) for v in cfg]
    return cfg


def _float64_copy(model: Any, build: Callable[[Any], None]) -> Any:
    """A float64 clone of a Keras model with the same weights, or raise InputError.

    Rebuilt from its config with every dtype widened, so Input layers are float64 too (a
    float32 Input would round the inputs before the first layer). ``build`` calls the clone
    once on a float64 sample, which builds subclassed models.
    """
    keras = _keras_module()
    assert keras is not None
    if all(w.dtype == "float64" for w in model.weights):
        return model
    old_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float64")  # sublayers made in a subclass's __init__
    try:
        try:
            clone = keras.saving.deserialize_keras_object(
                _widen(keras.saving.serialize_keras_object(model)))
        except Exception:
            clone = type(model).from_config(_widen(model.get_config()))
        build(clone)
        clone.set_weights([np.asarray(w, np.float64) if np.asarray(w).dtype.kind == "f" else w
                           for w in model.get_weights()])
    except Exception as e:
        raise InputError(
            f"float64 was asked for (dtype='float64' or float64 inputs), but this Keras model "
            f"({type(model).__name__}) could not be cloned in float64: {type(e).__name__}: {e}. "
            f"Build the model with dtype='float64', make it serialisable (get_config/"
            f"from_config), or compute in float32 with dtype='float32'."
        ) from e
    finally:
        keras.config.set_dtype_policy(old_policy)
    if any(str(w.dtype).startswith("float") and w.dtype != "float64" for w in clone.weights):
        raise InputError(
            f"float64 was asked for, but the float64 clone of {type(model).__name__} still has "
            f"float32 weights (its layers pin their dtype). Build it with dtype='float64' or "
            f"use dtype='float32'."
        )
    return clone


class TFBound(BoundModel):
    reductions_over_forward = False  # (see BoundModel: measured 1.8-1.9x)
    def __init__(self, model: Any, signature: Signature) -> None:
        super().__init__(signature)
        self.original = model
        self.is_keras = _is_keras(model)
        if self.is_keras:
            keras = _keras_module()
            if keras is not None and keras.backend.backend() != "tensorflow":
                raise InputError(
                    f"This Keras model runs on the {keras.backend.backend()!r} Keras backend; "
                    f"the TensorFlow backend needs KERAS_BACKEND=tensorflow. For JAX, pass "
                    f"the model's stateless function to batchjac with backend='jax'."
                )
        self.tf_dtype = tf.as_dtype(signature.dtype)
        self.synced = False  # whether self.model is a float64 copy to keep in step
        if self.is_keras:
            self.model = model
            if signature.dtype == np.float64:
                self.model = _float64_copy(model, self._build_sample)
                self.synced = self.model is not model
        elif isinstance(model, tf.types.experimental.PolymorphicFunction):
            self.model = model
        else:
            # A plain Python callable: let AutoGraph convert its control flow, as tf.function
            # would; batchjac's own wrappers are built with autograph=False.
            self.model = tf.function(model)
        self._graph_forward: Any = None
        self._xla_warned = False
        #: paths (see PATHS) that failed to build for this model where another one worked:
        #: kernels of other chunk sizes go straight past them
        self.failed: dict[str, str] = {}
        #: the fallback warnings given for this model (one of each kind)
        self.warned: set[type[Warning]] = set()

    def _build_sample(self, clone: Any) -> None:
        """Call a fresh clone once on a 2-row float64 sample (builds subclassed models)."""
        sig = self.signature
        u = tf.ones((2, *sig.unknown_shape), tf.float64) * 0.5
        ctx = tuple(tf.ones((2, *shape), tf.as_dtype(dt)) for shape, dt in sig.ctx)
        model, self.model = self.model, clone
        try:
            self.apply(u, ctx)
        finally:
            self.model = model

    def refresh(self) -> bool:
        if self.synced:  # keep the float64 copy in step with the user's (trained) weights
            for dst, src in zip(self.model.weights, self.original.weights):
                dst.assign(tf.cast(src, dst.dtype))
        return False  # the kernels read the variables: none is stale

    # -- model call --------------------------------------------------------------------------
    def apply(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], twice: bool = False,
              model: Any = None) -> tf.Tensor:
        """``twice``: the inputs are assembled with ops that differentiate twice inside XLA
        (the second-order kernels: see :func:`_matmul_concat`). ``model``: call this instead
        of the bound model (the same computation, e.g. its Python function: threads sharing
        the bound model keep theirs)."""
        lay = self.signature.layout
        fn = self.model if model is None else model
        if twice:
            inputs = assemble(lay, u, ctx, concat=_matmul_concat, take=_matmul_take)
        else:
            inputs = assemble(lay, u, ctx, concat=lambda xs: tf.concat(xs, axis=-1),
                              take=lambda x, idx: tf.gather(x, list(idx), axis=-1))
        try:
            if lay.kind in ("single", "concat"):
                y = fn(inputs[0], training=False) if self.is_keras else fn(inputs[0])
            elif lay.kind == "tuple":
                y = fn(list(inputs), training=False) if self.is_keras else fn(*inputs)
            else:
                assert lay.keys is not None
                d = dict(zip(lay.keys, inputs))
                y = fn(d, training=False) if self.is_keras else fn(**d)
        except ModelError:
            raise
        except Exception as e:
            raise _explain_model_failure(e, self.signature) from e
        if isinstance(y, tf.IndexedSlices):  # e.g. a gradient through a gather: a dense tensor
            y = tf.convert_to_tensor(y)
        if isinstance(y, (list, tuple, dict)):
            raise ModelError(
                f"The model returned a {type(y).__name__} of {len(y)} outputs; batchjac "
                f"differentiates one output array. Wrap the model to return one tensor, e.g. "
                f"tf.concat(outputs, axis=-1), or pick the output you need."
            )
        if not tf.is_tensor(y):
            raise ModelError(
                f"The model returned a {type(y).__name__}, not a TensorFlow tensor: its output was "
                f"computed outside TensorFlow (numpy, .numpy(), model.predict), so no gradient "
                f"can reach the unknowns. This is the pitfall where GradientTape returns None. "
                f"Compute the output with TensorFlow ops on the tensors the model receives."
            )
        if not y.dtype.is_floating:
            raise ModelError(f"The model output has dtype {y.dtype.name}; it must be floating.")
        return tf.cast(y, self.tf_dtype)

    def device_free_memory(self) -> int | None:
        """Free bytes of the first GPU TensorFlow sees, where it computes by default (None
        without one)."""
        return _gpu_free_bytes()

    def _specs(self, rows: int | None) -> list[tf.TensorSpec]:
        sig = self.signature
        specs = [tf.TensorSpec((rows, *sig.unknown_shape), self.tf_dtype)]
        specs += [tf.TensorSpec((rows, *shape), tf.as_dtype(dt)) for shape, dt in sig.ctx]
        return specs

    # -- probes ------------------------------------------------------------------------------
    def forward(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        if self._graph_forward is None:
            # probes, checks and solvers call this with many batch sizes: one trace for all
            fn = tf.function(lambda u, *ctx: self.apply(u, ctx), autograph=False,
                             reduce_retracing=True)
            # one such function per bound model, by design: TensorFlow's detector of frequent
            # retracing keys them all by this lambda's code, and would warn about traces that
            # are batchjac's choice, naming its internals (TFBound.forward.<locals>.<lambda>)
            if hasattr(fn, "_omit_frequent_tracing_warning"):
                fn._omit_frequent_tracing_warning = True
            self._graph_forward = fn
        return self._graph_forward(u, *ctx).numpy()

    def rows_apart(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        """Read from the Keras model's layers (:mod:`batchjac._backends.keras_rows`): no
        call, so none of the graph traces the probes' passes would cost (W1: 115-120 ms)."""
        return self.output_shape_of(u, ctx) is not None

    def output_shape_of(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[int, ...] | None:
        """Only for a Keras model proven to keep its rows apart (then the probes need no call
        and may run beside the first kernel); None otherwise: the probes call the model."""
        if not self.is_keras or self.signature.layout.kind not in ("single", "concat"):
            return None
        if not hasattr(self, "_proven"):
            from . import keras_rows

            # the per-row shape the model is given must be the one it declares: where it is
            # not, the probes' call fails, and its error is explained (batchjac._probes.diagnose)
            x = assemble(self.signature.layout, u[:1], tuple(c[:1] for c in ctx),
                         concat=lambda xs: np.concatenate(xs, axis=-1),
                         take=lambda a, idx: np.take(a, list(idx), axis=-1))[0]
            self._proven = keras_rows.output_shape(self.model, tuple(x.shape[1:]))
        return self._proven

    def connected(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        if self.output_shape_of(u, ctx) is not None:
            return True  # one input, and every output computed from it by Keras layers
        found: dict[str, bool] = {}

        def probe(u: tf.Tensor, *ctx: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                tape.watch(u)
                y = self.apply(u, ctx)
            found["connected"] = tape.gradient(y, u) is not None
            return y

        tf.function(probe, autograph=False).get_concrete_function(*self._specs(u.shape[0]))
        return found["connected"]

    # -- kernels -----------------------------------------------------------------------------
    def jac_reverse(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], pfor: bool = True
                    ) -> tuple[tf.Tensor, tf.Tensor]:
        """``pfor=False``: batch_jacobian's while loop over the outputs, for models whose
        gradient pfor cannot vectorise."""
        # batch_jacobian wants a target and a source of rank >= 2: a scalar output per
        # instance, (N,), is exactly where mode="auto" picks reverse mode. Both are flattened
        # to (N, m) and (N, k) (reshapes, which change no value) and J is shaped back.
        ushape = self.signature.unknown_shape
        k = int(np.prod(ushape, dtype=np.int64))
        rows = tf.shape(u)[0]
        flat_u = tf.reshape(u, (-1, k))
        with tf.GradientTape() as tape:
            tape.watch(flat_u)
            y = self.apply(tf.reshape(flat_u, tf.shape(u)), ctx)
            m = y.shape[1:].num_elements()
            flat_y = tf.reshape(y, (rows, -1 if m is None else m))
        jac = tape.batch_jacobian(flat_y, flat_u, unconnected_gradients=tf.UnconnectedGradients.ZERO,
                                  experimental_use_pfor=pfor)
        return y, tf.reshape(jac, tf.concat([tf.shape(y), list(ushape)], axis=0))

    def jac_forward(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], pfor: bool = True
                    ) -> tuple[tf.Tensor, tf.Tensor]:
        """``pfor=False``: a ``tf.map_fn`` (while loop) over the tangents instead of
        ``tf.vectorized_map``, for models whose forward mode pfor cannot vectorise."""
        ushape = self.signature.unknown_shape
        k = int(np.prod(ushape, dtype=np.int64))
        if k == 0:  # no unknown feature: no tangent to push (vectorized_map of none fails)
            y = self.apply(u, ctx)
            return y, tf.zeros(tf.concat([tf.shape(y), list(ushape)], axis=0), self.tf_dtype)
        basis = tf.reshape(tf.eye(k, dtype=self.tf_dtype), (k, *ushape))

        def one(tangent: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            with tf.autodiff.ForwardAccumulator(u, tf.broadcast_to(tangent, tf.shape(u))) as acc:
                y = self.apply(u, ctx)
            return y, acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)

        if pfor:
            ys, jvps = tf.vectorized_map(one, basis)  # (k, B, *out)
        else:
            ys, jvps = tf.map_fn(one, basis, fn_output_signature=(self.tf_dtype, self.tf_dtype))
        y = ys[0]
        rows = tf.shape(u)[0]
        out_shape = tf.shape(y)[1:]
        jac = tf.transpose(tf.reshape(jvps, (k, rows, -1)), (1, 2, 0))
        jac = tf.reshape(jac, tf.concat([[rows], out_shape, list(ushape)], axis=0))
        return y, jac

    def jacobian_fn(self, path: str) -> Callable[[tf.Tensor, tuple[tf.Tensor, ...]],
                                                 tuple[tf.Tensor, tf.Tensor]]:
        """``(u, ctx) -> (y, J)`` for one of :data:`PATHS`."""
        jac = self.jac_forward if _path_mode(path) == "forward" else self.jac_reverse
        pfor = not path.endswith("-loop")
        return lambda u, ctx: jac(u, ctx, pfor)

    def build_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool) -> Kernel:
        return TFKernel(self, mode, chunk_size, with_outputs)

    def build_second_kernel(self, kind: SecondKind, order: Order, chunk_size: int,
                            with_outputs: bool, with_jacobian: bool) -> Kernel:
        return TFSecondKernel(self, kind, order, chunk_size, with_outputs, with_jacobian)


#: the ways a kernel can compute the Jacobians: a mode, vectorised by pfor (vectorized_map,
#: batch_jacobian), or in a while loop over the basis where pfor cannot vectorise the model
PATHS = ("forward", "reverse", "forward-loop", "reverse-loop")


_PATH_NAMES = {"forward": "forward mode", "reverse": "reverse mode",
               "forward-loop": "forward mode in a loop", "reverse-loop": "reverse mode in a loop"}


def _path_mode(path: str) -> Mode:
    return "forward" if path.startswith("forward") else "reverse"


#: why forward mode fails in TensorFlow, for the fallback's warning and error
_FORWARD_CAUSE = ("Usual cause: control flow (while loops, tf.foldl, tf.map_fn, tf.cond) or "
                  "variables read inside it, which TensorFlow's forward-mode accumulator cannot "
                  "trace, or an output that is not a plain tensor.")
_REVERSE_CAUSE = "Usual cause: an operation without a registered gradient."
_PFOR_CAUSE = ("Usual cause: control flow (tf.map_fn, while loops, tf.cond) that TensorFlow's "
               "vectoriser, pfor, has no rule for.")


class _PforNoise(logging.Filter):
    """Drops the ERROR records pfor logs (pages of op definitions) when it cannot vectorise:
    batchjac then computes the Jacobians another way, and says so in one warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "parallel_for" in record.pathname)


@contextlib.contextmanager
def _quiet_pfor() -> Iterator[None]:
    logger, noise = tf.get_logger(), _PforNoise()
    logger.addFilter(noise)
    try:
        yield
    finally:
        logger.removeFilter(noise)


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, tf.errors.ResourceExhaustedError))


def _at_run_time(e: BaseException | None) -> bool:
    """Whether a failure happened while the graph ran (an op's error, which may depend on the
    values), not while it was built (the same for any rows)."""
    while e is not None:
        if isinstance(e, tf.errors.OpError):
            return True
        e = e.__cause__
    return False


#: what a model XLA cannot compile raises when its XLA build first runs
_XLA_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.InternalError)


class TFKernel(Kernel):
    """XLA (``jit_compile=True``) or a plain TensorFlow graph, whichever is faster here.

    Neither always wins on a CPU: XLA removes per-op dispatch, which dominates small chunks,
    while TensorFlow's own (oneDNN) kernels for large matrix products and convolutions beat
    XLA's: measured here, W4's reverse-mode chunk takes 610 ms with XLA and 295 ms as a graph,
    W2's 400 and 285 ms, W1's (1,000 rows) is faster with XLA. So the first call compiles
    both and times one chunk in each (interleaved, the minimum of a few), unless a variant
    was fixed with :meth:`use`.

    A chunk of at least :data:`BLOCKED_CHUNK` rows has a third build, ``"xla/blocks"``: XLA
    over blocks of about :data:`BLOCK_ROWS` rows in a ``tf.map_fn``, whose temporaries stay
    in cache. Raced only, never the untimed first. Measured here (steady, one process, the
    Jacobians of W1 in reverse mode under XLA): 100,000 rows in one piece 65 ms, in blocks of
    1,024 rows 58 ms, 2,048 48 ms, 4,096 42 ms, 8,192 42 ms; 10,000 rows 4.8 ms in one piece
    and 6.0-7.3 ms in blocks; W2's 10,000 rows 413 ms in one piece, 446-463 in blocks.
    """

    variants: tuple[str, ...] = ("xla", "graph")
    @property
    def cheap_first(self) -> str | None:
        return "graph"  # built sooner than XLA compiles (see _first_call)
    #: below this ratio graph/XLA time, the graph is chosen
    GRAPH_MARGIN = 0.95
    #: rows of a block of "xla/blocks" (evened over the chunk), and the least chunk that has it
    BLOCK_ROWS, BLOCKED_CHUNK = 4096, 16384
    #: below this ratio of times to the faster of the others, "xla/blocks" is chosen
    BLOCK_MARGIN = 0.95

    def __init__(self, bound: TFBound, mode: Mode, chunk_size: int, with_outputs: bool) -> None:
        self.mode, self.chunk_size, self.with_outputs = mode, chunk_size, with_outputs
        self._bound = bound
        self._specs = bound._specs(chunk_size)
        #: how the Jacobians are computed (one of PATHS), chosen by the first call: ``mode``,
        #: unless it fails for this model (see :meth:`_establish`)
        self.path: str | None = None
        #: why the paths before ``path`` failed (empty when ``path`` is ``mode``)
        self.failures: list[tuple[str, str]] = []
        self._fns: dict[str, Any] = {}
        self.variants = self._builds()
        self.variant = None
        self.note = ""
        #: ``(variant, result)`` of the first call's run, its answer (:meth:`_kept_result`)
        self._kept: tuple[str, Any] | None = None

    def _builds(self) -> tuple[str, ...]:
        """XLA and the graph, and on the CPU XLA in blocks for a chunk of :data:`BLOCKED_CHUNK`
        rows (a GPU's memory is not a CPU's cache: not offered there)."""
        blocked = ("xla/blocks",) if self.chunk_size >= self.BLOCKED_CHUNK and \
            not tf.config.list_logical_devices("GPU") else ()
        return (*type(self).variants, *blocked)

    @property
    def computes(self) -> Mode:
        return self.mode if self.path is None else _path_mode(self.path)

    def _enter(self, path: str) -> None:
        """Compute by ``path`` from now on; nothing is traced until it is used (the untimed
        first call traces the plain graph only)."""
        bound, with_outputs = self._bound, self.with_outputs
        jac = bound.jacobian_fn(path)

        def traced(u: tf.Tensor, *ctx: tf.Tensor) -> Any:
            bound.trace_count += 1
            y, j = jac(u, ctx)
            return (y, j) if with_outputs else j

        self._traced = traced
        self.path = path
        self._fns = {}
        self.variants = self._builds()  # (a path XLA failed for had the graph only)
        self.variant, self.note, self.untimed = None, "", False

    def _fn(self, variant: str) -> Any:
        if variant not in self._fns:
            traced = self._in_blocks() if variant == "xla/blocks" else self._traced
            self._fns[variant] = tf.function(traced, jit_compile=variant.startswith("xla"),
                                             autograph=False).get_concrete_function(*self._specs)
        return self._fns[variant]

    def _in_blocks(self) -> Callable[..., Any]:
        """The traced Jacobians over blocks of the chunk (:data:`BLOCK_ROWS`, evened), in a
        ``tf.map_fn`` (:func:`_map_blocks`)."""
        bound, traced = self._bound, self._traced
        assert bound.output_shape is not None
        block = _evened(self.chunk_size, self.BLOCK_ROWS)
        out_shape, ushape = tuple(bound.output_shape), tuple(bound.signature.unknown_shape)
        jac = tf.TensorSpec((block, *out_shape, *ushape), bound.tf_dtype)
        signature = (tf.TensorSpec((block, *out_shape), bound.tf_dtype), jac) \
            if self.with_outputs else jac
        return lambda u, *ctx: _map_blocks(traced, (u, *ctx), block, signature)

    def _select(self, variant: str, note: str) -> None:
        fn = self._fn(variant)
        # ConcreteFunction._call_flat skips re-binding the arguments to the signature (~0.15 ms
        # per call, a quarter of a small chunk); fall back to the public call if it goes away.
        flat = getattr(fn, "_call_flat", None)
        captured = fn.captured_inputs
        if flat is None:
            self._call = lambda *args: fn(*args)
        else:  # (tensors, the native path of batchjac._arrays, go in as they are)
            self._call = lambda *args: flat([a if _is_tensor(a) else tf.constant(a)
                                             for a in args], captured)
        if self.failures and self.path is not None:
            note = f"{note}; computed in {_PATH_NAMES[self.path]} ({self._why()})"
        self.variant, self.note = variant, note

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray | None, np.ndarray]:
        established = None
        if self.variant is None:
            with self.building:  # (threads sharing the kernel: one establishes it)
                if self.variant is None:
                    established = (self._establish(u, ctx),)
        if established is not None:
            out = established[0]
        else:
            if self.path is not None and _path_mode(self.path) != self.mode and \
                    not fallback_allowed():  # an earlier call fell back; this one asks the mode
                raise self._asked_failed()
            out = self._call_selected(u, ctx)
        if _is_tensor(u):  # tensors in, tensors out, where TensorFlow computed them
            return (out[0], out[1]) if self.with_outputs else (None, out)
        # The Jacobians as a read-only view of TensorFlow's buffer: ``.numpy()`` would copy
        # them (78 ms of W2's 370 ms). Read-only because TensorFlow may hand out one buffer
        # twice (a constant-folded Jacobian); the runner copies chunks into the result anyway.
        if self.with_outputs:
            return out[0].numpy(), np.asarray(out[1])
        return None, np.asarray(out)

    def _call_selected(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> Any:
        try:
            return self._call(u, *ctx)
        except _XLA_ERRORS as e:
            if not str(self.variant).startswith("xla") or "graph" not in self.variants:
                raise
            self._xla_failed(e)  # XLA fixed (use) on a kernel that ran the graph until then
            return self._call(u, *ctx)

    def _paths(self) -> list[str]:
        """The paths to try, best first: the kernel's mode, vectorised, then in a loop (which
        runs min(k, m) passes, the number the mode was chosen for), then the other mode
        likewise."""
        other = other_mode(self.mode)
        return [self.mode, f"{self.mode}-loop", other, f"{other}-loop"]

    def _establish(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> Any:
        """The first call: build and run the first path of :meth:`_paths` that works for this
        model (one warning if it is not the first), and keep it. Where only the other mode
        works and the call asked for this one, it raises a ModelError naming the other mode;
        where every path fails, the error of the first (the model's failure, not a mode's).
        Nothing of a path that failed is kept; a failure to build where a later path worked is
        remembered by the bound model (it is the same for every chunk size), one while running
        is not (it may depend on the rows, e.g. an assertion in the model)."""
        bound = self._bound
        own = [self.mode, f"{self.mode}-loop"]
        if not fallback_allowed() and all(p in bound.failed for p in own):
            self.failures = [(p, bound.failed[p]) for p in own]
            raise self._asked_failed()
        failures: list[tuple[str, str]] = []
        errors: list[tuple[str, Exception]] = []  # the paths tried by this call that failed
        for path in self._paths():
            if path in bound.failed:
                failures.append((path, bound.failed[path]))
                continue
            self._enter(path)
            try:
                with _quiet_pfor():
                    self._first_call(u, ctx)
                    out = self._kept_result()
                    if out is None:
                        out = self._call_selected(u, ctx)
            except Exception as e:
                if isinstance(e, Warning) or _out_of_memory(e):  # warnings as errors, OOM
                    self._reset()
                    raise
                failures.append((path, first_line(e)))
                errors.append((path, e))
                continue
            for failed, error in errors:
                if not _at_run_time(error):
                    bound.failed[failed] = first_line(error)
            self.failures = failures
            if _path_mode(path) != self.mode and not fallback_allowed():
                self._reset()  # (the other mode only showed that the failure is the mode's)
                raise self._asked_failed() from (errors[0][1] if errors else None)
            self._warn_fallback()
            return out
        self._reset()
        if errors:
            raise errors[0][1]
        raise ModelError(f"Every way of computing the Jacobians failed for this model: "
                         f"{self._why(failures)}.")

    def _reset(self) -> None:
        """Back to the state before the first call (the next call tries again)."""
        self.path, self._fns, self.variant, self.note, self._kept = None, {}, None, "", None
        self.variants = self._builds()

    def _why(self, failures: list[tuple[str, str]] | None = None) -> str:
        failures = self.failures if failures is None else failures
        merged: list[tuple[list[str], str]] = []  # one entry for paths that failed alike
        for path, why in failures:
            if merged and merged[-1][1] == why:
                merged[-1][0].append(_PATH_NAMES[path])
            else:
                merged.append(([_PATH_NAMES[path]], why))
        return "; ".join(f"{' and '.join(names)}: {why}" for names, why in merged)

    def _asked_failed(self) -> Exception:
        cause = _FORWARD_CAUSE if self.mode == "forward" else _REVERSE_CAUSE
        why = self._why([(p, w) for p, w in self.failures if _path_mode(p) == self.mode])
        return asked_mode_failed(self.mode, why, cause)

    def _warn_fallback(self) -> None:
        """One warning per bound model and kind when the path in use is not the first."""
        if not self.failures or self.path is None or in_mode_race():
            return
        bound = self._bound
        used = _path_mode(self.path)
        loop = " (unvectorised: in a while loop)" if self.path.endswith("-loop") else ""
        if used != self.mode:
            kind: type[Warning] = ForwardModeFallbackWarning if self.mode == "forward" \
                else ReverseModeFallbackWarning
            cause = _FORWARD_CAUSE if self.mode == "forward" else _REVERSE_CAUSE
            text = fallback_message(self.mode, self._why(), cause)
            text = text.replace(f"in {used} mode instead", f"in {used} mode{loop} instead")
        else:
            kind = VectorizationFallbackWarning
            over = "unknowns" if used == "forward" else "outputs"
            text = (f"TensorFlow could not vectorise the {used}-mode Jacobians of this model "
                    f"({self._why()}); batchjac computes them in a while loop over the {over} "
                    f"instead, which gives the same values but is slower. {_PFOR_CAUSE}")
        if kind in bound.warned:
            return
        bound.warned.add(kind)
        warnings.warn(text, kind, stacklevel=user_stacklevel())

    def _run(self, variant: str, u: np.ndarray, ctx: tuple[np.ndarray, ...], *,
             keep: bool = False) -> float:
        """Seconds of one call of ``variant`` on the chunk; with ``keep``, its result is kept
        for :meth:`_kept_result` (the first call's answer: W2's first call computed its
        Jacobians twice, 0.3 s of 1.2, before it was)."""
        self._kept = None  # (a race's calls keep none: their results would double the peak)
        start = time.perf_counter()
        out = self._fn(variant)(u, *ctx)
        jac = out[1] if self.with_outputs else out
        if _is_tensor(u):  # tensors in: wait for one number, not a copy of J to the host
            tf.reduce_sum(jac[:1]).numpy()
        else:
            np.asarray(jac)
        if keep:
            self._kept = (variant, out)
        return time.perf_counter() - start

    def _kept_result(self) -> Any:
        """The result :meth:`_run` kept, if it came from the variant now selected (once)."""
        kept, self._kept = self._kept, None
        return kept[1] if kept is not None and kept[0] == self.variant else None

    def _first_call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        from .._config import autotune_enabled
        from ._base import race_allowed, untimed_note

        if self._forced == "graph":  # no need to compile XLA at all
            self._select("graph", "graph (fixed)")
            return
        # (with BATCHJAC_AUTOTUNE=off, the first implementation, XLA, as stores use)
        if self._forced is None and not race_allowed() and autotune_enabled():
            # untimed: the plain graph, which is built sooner than XLA compiles (measured here,
            # first calls W1 0.10 s vs 0.14, W2 0.52 vs 0.57, W4 0.40 vs 0.79); XLA is tried
            # against it once the work repays a race (retune)
            try:
                self._run("graph", u, ctx, keep=True)
            except tf.errors.OpError:
                pass  # the graph fails where XLA may not: take the XLA path below
            else:
                self._select("graph", f"graph ({untimed_note()})")
                self.untimed = True
                return
        build = self._forced if self._forced == "xla/blocks" else "xla"  # (one XLA build)
        try:
            first = self._run(build, u, ctx, keep=True)
        except Exception as xla_error:  # (a trace-time failure fails the graph below as well)
            if isinstance(xla_error, Warning) or _out_of_memory(xla_error):
                raise
            try:
                self._fn("graph")
                self._run("graph", u, ctx, keep=True)
            except tf.errors.OpError as e:
                raise ModelError(f"The model failed while computing the Jacobian: {e.message}") from e
            self._xla_failed(xla_error)
            return
        if self._forced is not None:
            self._select(self._forced, f"{self._forced} ({self._forced_why})")
            return
        if not race_allowed():  # autotune off, or the plain graph failed above: XLA, untimed
            self._select("xla", f"xla ({untimed_note()})")
            return
        self._race_builds(u, ctx, first)

    def _xla_failed(self, xla_error: Exception) -> None:
        """XLA cannot compile this model: the plain graph from now on, with one warning."""
        if not self._bound._xla_warned:
            self._bound._xla_warned = True
            text = str(getattr(xla_error, "message", xla_error)).strip().splitlines()[0][:300]
            warnings.warn(
                f"XLA could not compile this model ({text}); batchjac runs it as a plain "
                f"TensorFlow graph instead, which is correct but can be slower.",
                XLAFallbackWarning, stacklevel=user_stacklevel(),
            )
        self.variants = ("graph",)
        self._select("graph", "graph (XLA could not compile the model)")

    def retune(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        if not self.untimed or self._forced is not None or "xla" not in self.variants:
            return
        self.untimed = False
        try:
            first = self._run("xla", u, ctx)
        except Exception as e:  # the graph runs: a race is optional, never a failure
            if isinstance(e, Warning):
                raise
            if not _out_of_memory(e):
                self._xla_failed(e)
            return
        self._race_builds(u, ctx, first)

    def _race_builds(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], first: float) -> None:
        try:
            self._run("graph", u, ctx)  # trace and warm up
        except Exception as e:  # XLA runs it but the graph does not: keep XLA
            if isinstance(e, Warning):
                raise
            self._select("xla", "xla (the plain graph failed)")
            return
        del first
        names = ["xla", "graph"]
        if "xla/blocks" in self.variants:
            try:
                self._run("xla/blocks", u, ctx)  # trace, compile and warm up
            except Exception as e:  # (XLA ran the chunk whole: the blocks are optional)
                if isinstance(e, Warning) or _out_of_memory(e):
                    raise
                self.variants = tuple(v for v in self.variants if v != "xla/blocks")
            else:
                names.append("xla/blocks")
        # the shared race (interleaved rounds of back-to-back calls, medians): two single calls
        # each, as this timed before, once kept the graph for W1 (1.1 vs 1.3 ms just after
        # XLA's compilation) where XLA then ran 0.73 ms a call against the graph's 1.0
        best = race(lambda v: self._run(v, u, ctx), tuple(names))
        winner = "graph" if best["graph"] < self.GRAPH_MARGIN * best["xla"] else "xla"
        if "xla/blocks" in best and best["xla/blocks"] < self.BLOCK_MARGIN * best[winner]:
            winner = "xla/blocks"
        timed = f"XLA {best['xla'] * 1e3:.1f} ms, graph {best['graph'] * 1e3:.1f} ms"
        if "xla/blocks" in best:
            timed += f", XLA in blocks {best['xla/blocks'] * 1e3:.1f} ms"
        self._select(winner, f"{winner} (timed one chunk: {timed})")


def _evened(rows: int, limit: int) -> int:
    """Rows of each block when ``rows`` are cut into blocks of at most ``limit``, evened."""
    return -(-rows // -(-rows // limit))


def _map_blocks(fn: Callable[..., Any], arrays: tuple[tf.Tensor, ...], block: int,
                signature: Any) -> Any:
    """``fn`` over blocks of ``block`` rows of ``arrays`` (cut alike) in a ``tf.map_fn``,
    whose results (``signature``: one block's) are joined and cut back to the rows; the last
    block is padded with copies of the last row."""
    rows = int(arrays[0].shape[0])
    blocks = -(-rows // block)
    padded = blocks * block

    def split(a: tf.Tensor) -> tf.Tensor:
        if padded > rows:
            a = tf.concat([a, tf.repeat(a[-1:], padded - rows, axis=0)], 0)
        return tf.reshape(a, (blocks, block, *a.shape[1:]))

    outs = tf.map_fn(lambda args: fn(*args), tuple(split(a) for a in arrays),
                     fn_output_signature=signature)
    return tf.nest.map_structure(lambda o: tf.reshape(o, (padded, *o.shape[2:]))[:rows], outs)


def _is_tensor(a: Any) -> bool:
    """``tf.is_tensor``, answered at once for a numpy array: ``tf.is_tensor`` checks a
    runtime Protocol (~27 us a call), three times a call of a kernel on numpy chunks: 0.08 ms
    of W1's 0.9 ms steady call at 1,000 rows."""
    return not isinstance(a, np.ndarray) and tf.is_tensor(a)


def _selector(rows: int, cols: int, pairs: list[tuple[int, int]], dtype: Any) -> tf.Tensor:
    eye = np.zeros((rows, cols), dtype=np.dtype(dtype.as_numpy_dtype))
    for r, c in pairs:
        eye[r, c] = 1
    return tf.constant(eye)


def _matmul_concat(xs: list[tf.Tensor]) -> tf.Tensor:
    """``tf.concat(xs, -1)`` as products with 0/1 selector matrices. Inside an XLA function
    the gradients of ``concat``, ``slice`` and ``pad`` are ``XlaDynamicUpdateSlice`` ops,
    which have no gradient of their own, so a ``ForwardAccumulator`` over a tape fails to
    trace through them; matrix products differentiate any number of times, and the
    selectors are as wide as the model's input row."""
    widths = [int(x.shape[-1]) for x in xs]
    total, before, out = sum(widths), 0, None
    for x, w in zip(xs, widths):
        part = tf.linalg.matmul(x, _selector(w, total, [(i, before + i) for i in range(w)], x.dtype)) \
            if len(x.shape) == 2 else tf.einsum("...i,ij->...j", x, _selector(
                w, total, [(i, before + i) for i in range(w)], x.dtype))
        out = part if out is None else out + part
        before += w
    assert out is not None
    return out


def _matmul_take(x: tf.Tensor, idx: tuple[int, ...]) -> tf.Tensor:
    """``tf.gather(x, idx, axis=-1)`` as a product with a 0/1 selector (see
    :func:`_matmul_concat`)."""
    sel = _selector(int(x.shape[-1]), len(idx), [(src, pos) for pos, src in enumerate(idx)], x.dtype)
    return tf.einsum("...i,ij->...j", x, sel)


#: the builds of :mod:`.tf_laplacian`'s rule set, by what they push forward
_FORWARD_RULES = {"forward-laplacian": "forward Laplacian", "forward-hessian": "forward Hessian"}


class TFSecondKernel(Kernel):
    """A second-order kernel (:data:`~batchjac._backends._base.SecondKind`) in one compiled
    function (XLA; a plain graph where XLA cannot compile the model, with the warning of
    :class:`TFKernel`).

    The chunk is repeated once per pair of basis vectors the result needs (rows are
    independent, which the probes check), so that one pass of plain tapes computes them all,
    without ``pfor`` (which nested tapes defeat) and without the ``None`` gradients of nested
    ``batch_jacobian`` tapes:

    - forward over reverse: block ``(a, j)`` is seeded with the cotangent ``e_a`` (a
      ``GradientTape`` inside a ``ForwardAccumulator``) and the tangent ``e_j``: the
      accumulator's ``jvp`` of the gradient is ``H[:, a, :, j]``; ``m k`` blocks, or ``m`` with
      the caller's tangents ``v`` (``hvp``);
    - forward over forward: two nested ``ForwardAccumulator`` s, block ``(i, j)`` pushed along
      ``e_i`` inside and ``e_j`` outside (``k^2`` blocks), or along ``e_j`` twice for the
      diagonal and the Laplacian (``k`` blocks, no ``k x k`` block per output).

    The tiled blocks repeat the model's forward and reverse pass once per block. Where the
    Hessian is taken over the reverse-mode Jacobian (forward over reverse, not ``hvp``), a
    third build, ``"tapes"``, is TensorFlow's own answer: ``batch_jacobian`` of
    ``batch_jacobian`` in a plain graph, whose vectoriser (pfor) runs the forward pass once
    and batches the derivatives. Measured side by side in one process (10,000 rows, a loaded
    2-core CPU): W7H (3 unknowns, 1 output) tapes 25 ms, tiled graph 52 ms, tiled XLA 50 ms;
    W6 (5 unknowns, 4 outputs, 20 blocks) tapes 166 ms, tiled graph 148 ms, tiled XLA 104 ms.
    So an untimed first call takes the tapes for one output (every block of the tiled builds
    is a repeated forward and reverse pass there) and the tiled graph otherwise; a race (the
    tuning policy's, where the work repays it) times all three. Not under XLA: the nested
    tapes compile once per input *value* there (see :mod:`batchjac._bench.second`).

    A Laplacian kernel has a fourth build, ``"forward-laplacian"`` (:mod:`.tf_laplacian`: one
    pass over the model's graph carrying the tangents and the summed second derivatives, under
    XLA, in blocks of :attr:`LAPLACIAN_BLOCK_ROWS`), its untimed first choice; where the model
    has an operation without a rule (or XLA cannot compile it) the next build. A Hessian
    kernel's fourth build, ``"forward-hessian"``, carries the second derivatives along every
    pair of unit tangents instead (blocks of :attr:`HESSIAN_BLOCK_ROWS`): the untimed first
    choice for at most 8 unknowns an output (:meth:`forward_hessian_first`; W7H, one process,
    20,000 rows: built and run once in 0.52 s against the tapes' 0.47 s, then 52.6 against
    68.6 ms; 100,000 rows: 0.77-1.0 s against 2.8 s, then 289-345 against 360 ms), else raced
    only.
    """

    def __init__(self, bound: TFBound, kind: SecondKind, order: Order, chunk_size: int,
                 with_outputs: bool, with_jacobian: bool) -> None:
        self.mode = "forward"  # the outer differentiation, in both orders
        self.kind, self.order = kind, order
        self.chunk_size, self.with_outputs, self.with_jacobian = chunk_size, with_outputs, with_jacobian
        self._bound = bound
        specs = bound._specs(chunk_size)
        if kind == "hvp":
            specs.append(specs[0])  # the tangents follow the model's arrays
        self._specs = specs
        self._fns: dict[str, Any] = {}
        self._n_ctx = len(specs) - 1
        self._seed_arrays = self._seed_values()
        self._specs += [tf.TensorSpec(a.shape, bound.tf_dtype) for a in self._seed_arrays]
        self._seed_inputs: dict[tuple[Any, ...], tf.Tensor] = {}
        self.variants = ("graph", "xla")
        if order == "forward-over-reverse" and kind != "hvp":
            one_output = int(np.prod(bound.output_shape or ())) == 1
            self.variants = ("tapes", "graph", "xla") if one_output else ("graph", "xla", "tapes")
        if kind == "laplacian":
            # the untimed first too: under XLA in blocks it is built quicker than the nested
            # tapes and runs faster (W7, 100,000 rows: built and run in 0.5-0.7 s against
            # 2.2 s, then 0.24-0.46x their time); where it cannot be built, the next build
            self.variants = ("forward-laplacian", *self.variants)
        if kind == "hessian" and self.forward_hessian_first(bound):
            self.variants = ("forward-hessian", *self.variants)  # the untimed first (see the class)
        elif kind == "hessian":
            self.variants = (*self.variants, "forward-hessian")  # (raced)
        #: why the nested tapes or the forward Laplacian could not be built for this model
        #: (they were dropped)
        self.tapes_failed = ""
        self.variant = None
        self.note = ""

    #: the forward Hessian is the untimed first build for at most this many unknowns an output
    FORWARD_HESSIAN_UNKNOWNS_PER_OUTPUT = 8

    @classmethod
    def forward_hessian_first(cls, bound: TFBound) -> bool:
        """Whether the forward Hessian is the first build: its second-order terms grow as
        ``k^2`` a row for all outputs at once, the other builds' as ``k`` per output (``m k``
        tiled blocks, or the tapes' ``k`` reverse passes of one output). Raced, steady, chunks
        of a Keras MLP k-64-64-m (tanh), 4,000 rows, forward Hessian against the best other
        build (ms): one output k=5 7.4 / 8.0 (tapes), k=8 11.4 / 11.8, k=12 24.7 / 18.1, k=16
        38.3 / 21.7, k=30 154 / 47; two outputs k=40 26.3 / 11.3; four k=5 3.8 / 10.1 (XLA),
        k=10 8.4 / 20.8, k=20 6.5 / 9.7, k=60 27.3 / 21.8; ten k=40 16.4 / 31.6; twenty k=10
        3.3 / 16.6. It wins where ``k <= 8 m``, every case above on its side of that line.
        W6 (k=5, m=4), first call in fresh processes: 0.38-0.39 s against 0.74-0.77 s with
        the tiled graph first."""
        k = int(np.prod(bound.signature.unknown_shape or (), dtype=np.int64))
        m = int(np.prod(bound.output_shape or (), dtype=np.int64))
        return k <= cls.FORWARD_HESSIAN_UNKNOWNS_PER_OUTPUT * m

    def _fn(self, variant: str) -> Any:
        if variant not in self._fns:
            def traced(u: tf.Tensor, *rest: tf.Tensor) -> dict[str, tf.Tensor]:
                self._bound.trace_count += 1
                ctx, seeds = rest[:self._n_ctx], rest[self._n_ctx:]
                self._seed_inputs = dict(zip(self._seed_keys(), seeds))
                return self._body(u, ctx, tapes=variant == "tapes",
                                  forward=variant in _FORWARD_RULES)

            with _quiet_pfor():  # (the tapes: pfor logs pages where it cannot vectorise)
                self._fns[variant] = tf.function(
                    traced, jit_compile=variant == "xla" or variant in _FORWARD_RULES,
                    autograph=False).get_concrete_function(*self._specs)
        return self._fns[variant]

    def _tapes_work(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], variant: str = "tapes"
                    ) -> bool:
        """Whether the nested tapes (or the forward Laplacian) build and run for this model;
        if not, they are dropped from the variants (the tiled builds compute the same)."""
        if variant not in self.variants:
            return False
        try:
            # the result kept: a first call that takes this build returns it, not a second run
            self._tried = (variant, u, self._run(variant, u, ctx))
        except (BatchJacError, Warning):
            raise
        except Exception as e:
            if _out_of_memory(e):
                raise
            self._fns.pop(variant, None)
            self.variants = tuple(v for v in self.variants if v != variant)
            text = str(getattr(e, "message", e)).strip().splitlines()
            what = "nested tapes" if variant == "tapes" else _FORWARD_RULES[variant]
            why = f"{what} failed: {text[0][:200] if text else type(e).__name__}"
            self.tapes_failed = f"{self.tapes_failed}; {why}" if self.tapes_failed else why
            return False
        return True

    # a mapping of named arrays, which the runner takes as it takes a Jacobian kernel's pair
    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]  # type: ignore[override]
                 ) -> dict[str, np.ndarray]:
        if self.variant is None:
            with self.building:  # (threads sharing the kernel: one chooses its build)
                if self.variant is None:
                    self._first_call(u, ctx)
        assert self.variant is not None
        tried, self._tried = self._tried, None
        try:
            if tried is not None and tried[0] == self.variant and tried[1] is u:
                out = tried[2]  # (computed on these rows by the check that the build works)
            else:
                out = self._fn(self.variant)(u, *ctx, *self._seed_arrays)
        except _XLA_ERRORS as e:
            if self.variant != "xla" or _out_of_memory(e):
                raise
            self._fallback(e)
            out = self._fn("graph")(u, *ctx, *self._seed_arrays)
        if not self._twice_checked:
            self._check_twice(u, ctx, out)  # (raises on every call of a kernel that fails it)
            self._twice_checked = True
        if _is_tensor(u):  # tensors in, tensors out, where TensorFlow computed them
            return dict(out)
        return {name: np.asarray(a) for name, a in out.items()}

    #: whether the first chunk's result was checked for second derivatives lost to a
    #: gradient TensorFlow cannot differentiate (:meth:`_check_twice`)
    _twice_checked = False
    #: rows of the check's eager tapes
    TWICE_CHECK_ROWS = 4

    def _check_twice(self, u: Any, ctx: tuple[Any, ...], out: Any) -> None:
        """Every build reads a second derivative TensorFlow finds no path for as zero (what a
        constant gradient gives). So does a gradient that changes with the inputs but that
        TensorFlow cannot differentiate: a ``tf.custom_gradient`` whose gradient function stops
        the gradient or computes with numpy (``tf.numpy_function``). For an output whose
        second derivatives are all zero on the first chunk, eager tapes on a few of its rows
        tell the two apart: its gradient has no path back to the inputs, yet its values at
        other inputs differ. Then a ModelError, not zeros."""
        bound = self._bound
        m = int(np.prod(bound.output_shape or (), dtype=np.int64))
        second = tf.convert_to_tensor(out[SECOND_RESULT[self.kind]])
        rows = int(second.shape[0])
        if rows == 0 or m == 0:
            return
        nonzero = tf.reduce_any(tf.not_equal(tf.reshape(second, (rows, m, -1)), 0), axis=(0, 2))
        zero = [int(o) for o in np.flatnonzero(~np.asarray(nonzero))]
        if not zero:
            return
        if self.kind == "hvp":
            ctx = ctx[:-1]  # (the tangents)
        try:
            lost = self._lost_second(u, ctx, zero, m)
        except (BatchJacError, Warning):
            raise
        except Exception:  # (the model does not run eagerly: the check cannot tell)
            return
        if lost:
            shown = ", ".join(str(o) for o in lost[:5]) + (" ..." if len(lost) > 5 else "")
            raise ModelError(
                f"The model is not twice differentiable: the gradient of output "
                f"{'(flat index) ' if m > 1 else ''}{shown} changes with the inputs, but "
                f"TensorFlow finds no path from it back to them, so its second derivatives "
                f"would come out as zeros. Usual cause: a tf.custom_gradient whose gradient "
                f"function is not differentiable (it uses tf.stop_gradient, numpy or "
                f"tf.numpy_function). Write the gradient function with TensorFlow operations "
                f"of the inputs it depends on; batchjac.jacobian (first derivatives) works with "
                f"the model as it is.")

    def _lost_second(self, u: Any, ctx: tuple[Any, ...], outputs: list[int], m: int
                     ) -> list[int]:
        """The ``outputs`` whose gradient TensorFlow cannot differentiate though it varies
        (see :meth:`_check_twice`), on the first :attr:`TWICE_CHECK_ROWS` rows."""
        bound = self._bound
        n = min(self.TWICE_CHECK_ROWS, int(u.shape[0]))
        x = tf.cast(tf.convert_to_tensor(u[:n]), bound.tf_dtype)
        c = tuple(tf.convert_to_tensor(a[:n]) for a in ctx)
        # a tf.function's Python function (no trace of the model for these shapes)
        python = getattr(bound.model, "python_function", None)
        own = python if python is not None and not bound.is_keras else None

        def gradients(at: tf.Tensor, outer: Any = None) -> dict[int, Any]:
            with tf.GradientTape(persistent=True) as inner:
                inner.watch(at)
                y = tf.reshape(bound.apply(at, c, model=own), (n, m))
            return {o: inner.gradient(y, at, output_gradients=tf.one_hot(
                tf.fill((n,), o), m, dtype=y.dtype)) for o in outputs}

        with tf.GradientTape(persistent=True) as outer:
            outer.watch(x)
            grads = gradients(x)
        unconnected = [o for o, g in grads.items()
                       if g is not None and outer.gradient(g, x) is None]
        if not unconnected:
            return []
        elsewhere = gradients(x * 1.5 + 0.25)
        lost = []
        for o in unconnected:
            a, b = np.asarray(grads[o]), elsewhere[o]
            b = np.zeros_like(a) if b is None else np.asarray(b)
            scale = max(float(np.max(np.abs(a), initial=0.0)), 1.0)
            if not np.allclose(a, b, rtol=1e-5, atol=1e-6 * scale):
                lost.append(o)
        return lost

    def _run(self, variant: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> Any:
        out = self._fn(variant)(u, *ctx, *self._seed_arrays)
        np.asarray(next(iter(out.values())))
        return out

    #: (build, rows, result) of the last check that a build works (see :meth:`_tapes_work`)
    _tried: tuple[str, Any, Any] | None = None

    def _select(self, variant: str, note: str) -> None:
        if variant == "tapes":
            note = f"{note}: nested batch_jacobian tapes"
        elif variant in _FORWARD_RULES:
            note = f"{note}: a {_FORWARD_RULES[variant]} (one pass)"
        if self.tapes_failed and variant not in _FORWARD_RULES:  # (why not the other builds)
            note = f"{note}; {self.tapes_failed}"
        self.variant, self.note = variant, f"{self.kind}: {self.order}, {note}"

    def _first_call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        """The plain graph, untimed, unless the work at hand repays compiling XLA too and
        timing both (the tuning policy, :mod:`batchjac._tuning`); a fixed variant (stores)
        as it is. Measured here (10,000 rows, under load): W6's graph is built in 1.5 s and
        runs in 0.33 s, XLA takes 17 s (constant folding of the tangents' zero products) and
        0.28 s; W7's graph 1.6 s and 0.20 s, XLA 1.0 s and 0.13 s."""
        from ._base import race_allowed, untimed_note

        chosen = self._bound.__dict__.get("_second_builds", {}).get((self.kind, self.order))
        if self._forced is None and chosen in self.variants:
            # as a race chose for another chunk size of this model: the ladder of chunk sizes
            # compares sizes on one build, and each size's race would compile every build
            self._forced, self._forced_why = chosen, "as timed for another chunk size"
        if self._forced is not None:
            forced = self._forced
            if forced in ("tapes", *_FORWARD_RULES) and not self._tapes_work(u, ctx, forced):
                forced = "graph"  # the same values without pfor, on a machine where it failed
            self._select(forced, f"{forced} ({self._forced_why})")
        elif race_allowed():
            self._race(u, ctx)
        else:
            # the first build that works (the tapes and the forward Laplacian may not)
            first = next((v for v in self.variants
                          if v not in ("tapes", *_FORWARD_RULES) or self._tapes_work(u, ctx, v)),
                         "graph")
            self._select(first, f"{first} ({untimed_note()})")
            self.untimed = True

    def retune(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        if not self.untimed or self._forced is not None or "xla" not in self.variants:
            return
        self.untimed = False
        self._race(u, ctx)

    def _race(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        self._tapes_work(u, ctx)
        self._tapes_work(u, ctx, "forward-laplacian")
        self._tapes_work(u, ctx, "forward-hessian")
        if "xla" in self.variants:
            try:
                self._run("xla", u, ctx)
            except Exception as e:
                if isinstance(e, Warning) or _out_of_memory(e):
                    raise
                self._fallback(e)
        if len(self.variants) < 2:  # (XLA failed and the tapes too: the graph, said so)
            return
        names = sorted(self.variants, key=("graph", "xla", "tapes", *_FORWARD_RULES).index)
        times = race(lambda v: self._run(v, u, ctx), names)
        best = min(times, key=lambda v: times[v])
        timed = ", ".join(f"{v} {times[v] * 1e3:.1f} ms" for v in names)
        self._select(best, f"{best} (timed one chunk: {timed})")
        self._bound.__dict__.setdefault("_second_builds", {})[(self.kind, self.order)] = best

    def _fallback(self, xla_error: Exception) -> None:
        bound = self._bound
        if not bound._xla_warned:
            bound._xla_warned = True
            text = str(getattr(xla_error, "message", xla_error)).strip().splitlines()[0][:300]
            warnings.warn(f"XLA could not compile this model ({text}); batchjac runs it as a "
                          f"plain TensorFlow graph instead, which is correct but can be slower.",
                          XLAFallbackWarning, stacklevel=user_stacklevel())
        self.variants = tuple(v for v in self.variants if v != "xla")
        self.variant = "graph" if self.variant in (None, "xla") else self.variant
        self.note = f"{self.kind}: {self.order}, {self.variant} (XLA could not compile the model)"

    # -- the computations (traced) -----------------------------------------------------------
    def _body(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], tapes: bool = False,
              forward: bool = False) -> dict[str, tf.Tensor]:
        bound = self._bound
        assert bound.output_shape is not None
        out_shape, ushape = bound.output_shape, bound.signature.unknown_shape
        m, k, rows = int(np.prod(out_shape)), int(np.prod(ushape)), self.chunk_size
        v = None
        if self.kind == "hvp":
            ctx, v = ctx[:-1], ctx[-1]
        if forward:
            y, jac, second = self._forward_rules(u, ctx, m, k, rows)
        elif tapes:
            y, jac, second = self._nested_tapes(u, ctx, m, k, rows)
        elif self.order == "forward-over-reverse":
            y, jac, second = self._over_reverse(u, ctx, v, m, k, rows)
        else:
            y, jac, second = self._over_forward(u, ctx, v, m, k, rows)
        # second: (rows, m, k) for diagonal/hvp, (rows, m, k, k) for the Hessian
        if self.kind == "laplacian":
            if not forward:  # (the forward Laplacian's is the sum already)
                second = tf.reduce_sum(second if len(second.shape) == 3 else
                                       tf.linalg.diag_part(second), -1)
            second = tf.reshape(second, (rows, *out_shape))
        elif self.kind == "hessian":
            second = tf.reshape(second, (rows, *out_shape, *ushape, *ushape))
        else:
            if len(second.shape) == 4:
                second = tf.linalg.diag_part(second)
            second = tf.reshape(second, (rows, *out_shape, *ushape))
        out = {SECOND_RESULT[self.kind]: second}
        if self.with_outputs:
            out["outputs"] = tf.reshape(y, (rows, *out_shape))
        if self.with_jacobian:
            out["jacobians"] = tf.reshape(jac, (rows, *out_shape, *ushape))
        return out

    def _nested_tapes(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], m: int, k: int, rows: int
                      ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """``batch_jacobian`` of ``batch_jacobian`` (pfor): ``(y, J (rows, m, k), H (rows, m,
        k, k))``. Unconnected gradients are zeros, not the ``None`` of the plain tapes."""
        flat_u = tf.reshape(u, (rows, k))
        zero = tf.UnconnectedGradients.ZERO
        with tf.GradientTape() as outer:
            outer.watch(flat_u)
            with tf.GradientTape() as inner:
                inner.watch(flat_u)
                y = self._bound.apply(tf.reshape(flat_u, tf.shape(u)), ctx)
                flat_y = tf.reshape(y, (rows, m))
            jac = inner.batch_jacobian(flat_y, flat_u, unconnected_gradients=zero)
        hess = outer.batch_jacobian(jac, flat_u, unconnected_gradients=zero)
        return y, jac, hess

    #: rows of a block of the forward Laplacian, for chunks at least twice as large: the chunk
    #: in a ``tf.map_fn`` of blocks under XLA, whose temporaries ((k + 2) values per activation)
    #: stay in cache. W7, 100,000 rows, side by side in one process under load, ratio to the
    #: nested tapes: one chunk in a graph 0.68-0.71, under XLA 0.41-0.61; blocks of 500 rows
    #: under XLA 0.37, 1,000 0.24, 2,000 0.28-0.46 (in a graph: 0.36, 0.50, 0.40-0.51)
    LAPLACIAN_BLOCK_ROWS = 2048
    #: the same for the forward Hessian, whose activations carry ``1 + k + k(k+1)/2`` values
    #: (W7H: 10, the Laplacian's 5): W7H, one chunk of 100,000 rows, one process, steady
    #: blocks of 2,048 rows 345 ms, 1,024 323 ms, 512 289 ms, the nested tapes 360 ms
    HESSIAN_BLOCK_ROWS = 512

    def _forward_rules(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], m: int, k: int,
                       rows: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """``(y, J (rows, m, k), Laplacian (rows, m))``, or the Hessian ``(rows, m, k, k)``
        for a Hessian kernel, in one pass (:mod:`.tf_laplacian`) over the model's own graph,
        traced here for the chunk's shapes."""
        from . import tf_laplacian

        bound = self._bound
        ushape = tuple(bound.signature.unknown_shape)
        model = bound.model
        # a plain callable is wrapped in a tf.function, whose graph would hold one call op:
        # trace its Python function, so that the graph holds the model's own operations
        inner = getattr(model, "python_function", None)

        own = inner if inner is not None and not bound.is_keras else None

        flat = tf.reshape(u, (rows, k))
        hessian = self.kind == "hessian"
        limit = self.HESSIAN_BLOCK_ROWS if hessian else self.LAPLACIAN_BLOCK_ROWS
        block = _evened(rows, limit) if rows >= 2 * limit else rows
        specs = [tf.TensorSpec((block, k), bound.tf_dtype),
                 *(tf.TensorSpec((block, *s.shape[1:]), s.dtype) for s in self._specs[1:1 + len(ctx)])]

        def apply(flat_u: tf.Tensor, *c: tf.Tensor) -> tf.Tensor:
            y = bound.apply(tf.reshape(flat_u, (block, *ushape)), c, model=own)
            return tf.reshape(y, (block, m))

        concrete = tf_laplacian.traced_model(apply, specs)
        push = tf_laplacian.run_hessian if hessian else tf_laplacian.run

        def one_pass(flat_u: tf.Tensor, c: tuple[tf.Tensor, ...]
                     ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            y, d, second = push(concrete, flat_u, c)
            if hessian:  # (k, k, rows, m) -> (rows, m, k, k)
                second = tf.transpose(second, (2, 3, 0, 1))
            return y, tf.transpose(d, (1, 2, 0)), second

        if block == rows:
            return one_pass(flat, ctx)
        dtype = bound.tf_dtype
        y, jac, lap = _map_blocks(lambda fu, *c: one_pass(fu, c), (flat, *ctx), block,
                                  (tf.TensorSpec((block, m), dtype),
                                   tf.TensorSpec((block, m, k), dtype),
                                   tf.TensorSpec((block, m, k, k) if hessian else (block, m),
                                                 dtype)))
        return y, jac, lap

    def _tiled(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], blocks: int
               ) -> tuple[tf.Tensor, tuple[tf.Tensor, ...]]:
        def tile(a: tf.Tensor) -> tf.Tensor:
            return tf.tile(a, [blocks] + [1] * (len(a.shape) - 1))
        return tile(u), tuple(tile(c) for c in ctx)

    def _seed_keys(self) -> list[tuple[Any, ...]]:
        """The unit-vector seeds the body uses (see :meth:`_seeds`): ``(index, width, shape)``,
        block ``b`` seeded with ``e_{index[b]}`` of ``shape``."""
        bound = self._bound
        assert bound.output_shape is not None
        out_shape, ushape = tuple(bound.output_shape), tuple(bound.signature.unknown_shape)
        m, k = int(np.prod(out_shape)), int(np.prod(ushape))
        if self.order == "forward-over-reverse":
            per = 1 if self.kind == "hvp" else k
            keys = [(tuple(np.repeat(np.arange(m), per).tolist()), m, out_shape)]
            if self.kind != "hvp":
                keys.append((tuple(np.tile(np.arange(k), m).tolist()), k, ushape))
            return keys
        full = self.kind == "hessian"
        inner = np.repeat(np.arange(k), k) if full else np.arange(k)
        keys = [(tuple(inner.tolist()), k, ushape)]
        if self.kind != "hvp":
            outer = np.tile(np.arange(k), k) if full else np.arange(k)
            keys.append((tuple(outer.tolist()), k, ushape))
        return keys

    def _seed_values(self) -> list[np.ndarray]:
        rows, dtype = self.chunk_size, self._bound.signature.dtype
        values = []
        for index, width, shape in self._seed_keys():
            eye = np.eye(width, dtype=dtype)[list(index)]  # (blocks, width)
            values.append(np.repeat(eye, rows, axis=0).reshape((len(index) * rows, *shape)))
        return values

    def _seeds(self, index: np.ndarray, width: int, rows: int, shape: tuple[int, ...]) -> tf.Tensor:
        """Block ``b`` (``rows`` rows) holds the unit vector ``e_{index[b]}`` of ``shape``.

        The seeds are arguments of the compiled function, not constants: XLA constant-folds
        the products of the weights with constant seeds (each ``(blocks * rows, width)``),
        which took 22 s of W6's first call (10,000 rows, 20 blocks; the native nested tape
        compiles in 13 s), and it folded them read from a variable too."""
        return self._seed_inputs[(tuple(int(i) for i in index), width, tuple(shape))]

    def _over_reverse(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], v: tf.Tensor | None,
                      m: int, k: int, rows: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        bound = self._bound
        out_shape, ushape = bound.output_shape or (), bound.signature.unknown_shape
        tangents_per = 1 if v is not None else k
        blocks = m * tangents_per
        uu, cc = self._tiled(u, ctx, blocks)
        cot = self._seeds(np.repeat(np.arange(m), tangents_per), m, rows, tuple(out_shape))
        if v is None:
            tan = self._seeds(np.tile(np.arange(k), m), k, rows, tuple(ushape))
        else:
            tan = tf.tile(v, [m] + [1] * (len(v.shape) - 1))
        with tf.autodiff.ForwardAccumulator(uu, tan) as acc:
            with tf.GradientTape() as tape:
                tape.watch(uu)
                y = bound.apply(uu, cc, twice=True)
            grad = tape.gradient(y, uu, output_gradients=cot,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        dgrad = acc.jvp(grad, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # grad, dgrad: (m, tangents, rows, k): block (a, j) holds J[:, a, :] and H[:, a, :, j]
        jac = tf.transpose(tf.reshape(grad, (m, tangents_per, rows, k))[:, 0], (1, 0, 2))
        d = tf.reshape(dgrad, (m, tangents_per, rows, k))
        second = tf.transpose(d[:, 0], (1, 0, 2)) if v is not None else tf.transpose(d, (2, 0, 3, 1))
        return y[:rows], jac, second

    def _over_forward(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], v: tf.Tensor | None,
                      m: int, k: int, rows: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        bound = self._bound
        ushape = tuple(bound.signature.unknown_shape)
        full = self.kind == "hessian"
        blocks = k * k if full else k
        uu, cc = self._tiled(u, ctx, blocks)
        inner_i = np.repeat(np.arange(k), k) if full else np.arange(k)
        outer_j = np.tile(np.arange(k), k) if full else np.arange(k)
        # hvp: block i pushed along e_i inside and v outside, (H v)_i
        outer_t = self._seeds(outer_j, k, rows, ushape) if v is None else \
            tf.tile(v, [k] + [1] * (len(v.shape) - 1))
        with tf.autodiff.ForwardAccumulator(uu, outer_t) as outer:
            with tf.autodiff.ForwardAccumulator(uu, self._seeds(inner_i, k, rows, ushape)) as inner:
                y = bound.apply(uu, cc, twice=True)
            dy = inner.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        d2y = outer.jvp(dy, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        if full:  # block (i, j): dy = J[:, :, i], d2y = H[:, :, i, j]
            jac = tf.transpose(tf.reshape(dy, (k, k, rows, m))[:, 0], (1, 2, 0))
            return y[:rows], jac, tf.transpose(tf.reshape(d2y, (k, k, rows, m)), (2, 3, 0, 1))
        jac = tf.transpose(tf.reshape(dy, (k, rows, m)), (1, 2, 0))
        return y[:rows], jac, tf.transpose(tf.reshape(d2y, (k, rows, m)), (1, 2, 0))


def _explain_model_failure(e: Exception, sig: Signature) -> ModelError:
    text = f"{type(e).__name__}: {e}"
    # Keras 3's model.predict on a graph tensor: "'SymbolicTensor' object has no attribute 'numpy'"
    if "numpy()" in text or "attribute 'numpy'" in text or "EagerTensor" in text or \
            "eager execution" in text or ("predict" in text and "tf.function" in text):
        return ModelError(
            f"The model could not run inside a TensorFlow graph ({text.splitlines()[0][:300]}). "
            f"It leaves TensorFlow (.numpy(), numpy functions or model.predict), so gradients "
            f"cannot flow through it: the pitfall where GradientTape returns None. Write the "
            f"model with TensorFlow ops only."
        )
    dtype_hint = ""
    if sig.dtype == np.float64 and ("float" in text and ("double" in text or "float64" in text)):
        dtype_hint = " It may hold float32 variables: use dtype='float32', or build it in float64."
    return ModelError(f"Calling the model failed: {text.strip()[:2000]}.{dtype_hint}")


def _gpu_free_bytes() -> int | None:
    if not tf.config.list_logical_devices("GPU"):
        return None
    limit = _gpu_limit()
    if limit is None:
        return None
    try:
        used = int(tf.config.experimental.get_memory_info("GPU:0")["current"])
    except (ValueError, RuntimeError):
        used = 0
    return max(0, limit - used)


_LIMIT: list[int | None] = []


def _gpu_limit() -> int | None:
    """The memory TensorFlow's allocator may use on GPU:0 (its device attributes; read once)."""
    if not _LIMIT:
        try:
            from tensorflow.python.client import device_lib

            found = [d.memory_limit for d in device_lib.list_local_devices()
                     if d.device_type == "GPU"]
            _LIMIT.append(int(found[0]) if found else None)
        except Exception:  # a TensorFlow without that module: no device budget
            _LIMIT.append(None)
    return _LIMIT[0]


class TensorFlowOps:
    """TensorFlow tensors as the pipeline's arrays (:class:`batchjac._xp.ArrayOps`): what
    ``jacobian`` works with when tensors go into a TensorFlow model."""

    kind = "tensorflow"

    def is_native(self, a: Any) -> bool:
        return tf.is_tensor(a) or isinstance(a, tf.Variable)

    def dtype_of(self, a: Any) -> np.dtype:
        return np.dtype(a.dtype.as_numpy_dtype)

    def device_of(self, a: Any) -> Any:
        return getattr(a, "device", None) or None

    def cast(self, a: Any, dtype: np.dtype) -> Any:
        return tf.cast(a, tf.as_dtype(dtype))

    def contiguous(self, a: Any) -> Any:
        return tf.convert_to_tensor(a)

    def take(self, a: Any, cols: tuple[int, ...]) -> Any:
        return tf.gather(a, list(cols), axis=-1)

    def pad_rows(self, a: Any, rows: int) -> Any:
        return tf.concat([a, tf.repeat(a[-1:], rows - int(a.shape[0]), axis=0)], axis=0)

    def concat(self, parts: list[Any]) -> Any:
        return tf.concat(parts, axis=0)

    def buffer(self, like: Any, shape: tuple[int, ...], host: Any) -> Any | None:
        return None  # tensors are immutable: the chunks are joined with one tf.concat

    def write(self, buffer: Any, lo: int, a: Any) -> None:
        raise NotImplementedError("TensorFlow tensors have no buffer to write into")

    def sealed(self, buffer: Any) -> Any:
        raise NotImplementedError("TensorFlow tensors have no buffer to write into")

    def all_finite(self, a: Any) -> bool:
        # one reduction, as TorchOps.all_finite (a finite sum proves every entry finite)
        return not a.dtype.is_floating or bool(tf.math.is_finite(tf.reduce_sum(a))) or \
            bool(tf.reduce_all(tf.math.is_finite(a)))

    def any_nonzero(self, a: Any) -> bool:
        return bool(tf.reduce_any(tf.not_equal(a, 0)))

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a.numpy())

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        if device is None:
            return tf.convert_to_tensor(a)
        with tf.device(device):
            return tf.identity(tf.convert_to_tensor(a))

    def to_device(self, a: Any, device: Any) -> Any:
        if getattr(a, "device", None) == device:
            return a
        with tf.device(device):
            return tf.identity(a)


OPS = TensorFlowOps()


class TensorFlowBackend(Backend):
    name = "tensorflow"

    def bind(self, model: Any, signature: Signature, **options: Any) -> BoundModel:
        if options:
            raise InputError(f"The TensorFlow backend takes no options; got {sorted(options)}.")
        if not callable(model):
            raise InputError(f"`model` must be callable; got {type(model).__name__}.")
        return TFBound(model, signature)


BACKEND = TensorFlowBackend()
