"""TensorFlow / Keras backend: the adapter (the bound model, the array namespace, the backend).

Reverse mode is ``GradientTape.batch_jacobian`` (one vectorised backward pass per output);
forward mode pushes one batched tangent per unknown feature through
``tf.autodiff.ForwardAccumulator``, vectorised with ``tf.vectorized_map``. Both are compiled
once per chunk shape, with XLA (``jit_compile=True``) and as a plain graph, and the faster of
the two on one chunk is kept (:class:`TFKernel`); they are called through their concrete
function, which skips tf.function's per-call argument matching (~0.2 ms on a small CPU).

The package, by role: this module, the adapter; :mod:`.builds`, the first-order builds and
their kernel; :mod:`.second`, the second-order kernel; :mod:`.laplacian`, the forward rules
over the model's graph; :mod:`.keras`, what is read from a Keras model's layers and its
float64 clone; :mod:`.compat`, every private or version-specific TensorFlow and Keras name,
each guarded.
"""

from __future__ import annotations

import os
import threading
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TF's C++ start-up chatter off stderr

import numpy as np
import tensorflow as tf

from ..._errors import InputError, ModelError, XLAFallbackWarning as XLAFallbackWarning
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
)
from . import compat
from .builds import PATHS as PATHS, TFKernel as TFKernel
from .keras import float64_copy, output_shape as keras_output_shape
from .second import TFSecondKernel as TFSecondKernel

# a differentiable call inside the caller's tf.function: batchjac's Python runs as it is
compat.not_converted(__name__.split(".")[0])

#: (the float64 clone under the name tests and earlier callers use)
_float64_copy = float64_copy


class TFBound(BoundModel):
    reductions_over_forward = False  # (see BoundModel; measured: docs/thresholds.md)
    #: a forward-mode kernel traces the model under ``pfor`` of a ForwardAccumulator, mostly
    #: in Python: its making takes about three times a reverse one's (docs/thresholds.md)
    forward_build_cost = 3.0
    #: a race's kernel is made beside the calls, traced there by a first run on rows of its
    #: chunk's shape: the tracing holds Python's lock, yet the calls go on meanwhile (their
    #: graphs run outside it), where a race's first call waited the whole making
    #: (docs/thresholds.md)
    builds_beside = True

    def beside_settings(self) -> Any:
        """The device the calling thread's ops are placed on (``tf.device`` scopes are the
        thread's own): a kernel made on another thread is this thread's only where equal."""
        return tf.constant(0.0).device

    def made_beside(self, settings: Any, mode: Mode, chunk_size: int, with_outputs: bool,
                    budget: CallBudget, variant: str | None = None) -> Any:
        if tf.constant(0.0).device != settings:
            return None  # (a tf.device scope of the calling thread: made there)
        kernel = super().made_beside(settings, mode, chunk_size, with_outputs, budget, variant)
        if kernel is None:
            return None
        # TensorFlow traces a kernel on its first run: here, on rows of halves and ones
        sig = self.signature
        u = np.full((chunk_size, *sig.unknown_shape), 0.5, sig.dtype)
        ctx = tuple(np.ones((chunk_size, *shape), dt) for shape, dt in sig.ctx)
        try:
            kernel.call(u, ctx, budget)
        except Exception:  # the call that needs it makes it again and reports the failure
            self.forget_kernel(mode, chunk_size, with_outputs)
            return None
        return kernel

    def __init__(self, model: Any, signature: Signature) -> None:
        super().__init__(signature)
        self.original = model
        self.is_keras = is_keras(model)
        if self.is_keras:
            keras = compat.keras_module()
            if keras is not None and keras.backend.backend() != "tensorflow":
                raise InputError(
                    f"This Keras model runs on the {keras.backend.backend()!r} Keras backend, "
                    f"and backend='tensorflow' was asked for: pass "
                    f"backend={keras.backend.backend()!r}, or leave `backend` out (batchjac "
                    f"computes a Keras model in the framework Keras runs on)."
                )
        self.tf_dtype = tf.as_dtype(signature.dtype)
        self.synced = False  # whether self.model is a widened copy to keep in step
        if self.is_keras:
            # float64 asked for, or a model computing in half precision (a mixed policy):
            # its clone in the compute dtype, whose weights follow the model's (refresh)
            self.model = model  # (the clone is built on a sample by way of it)
            self.model = float64_copy(model, self._build_sample, np.dtype(signature.dtype).name)
            self.synced = self.model is not model
        elif compat.is_tf_function(model):
            self.model = model
        else:
            # A plain Python callable: let AutoGraph convert its control flow, as tf.function
            # would; batchjac's own wrappers are built with autograph=False.
            self.model = tf.function(model)
        self._graph_forward: Any = None
        #: the differentiable calls' functions, by (kind, order, outputs, Jacobians): kept, so
        #: that an eager training loop traces each once (:mod:`.differentiable`)
        self.differentiable_runs: dict[tuple[str, str, bool, bool], Any] = {}
        self._xla_warned = False
        #: held while a kernel of this model finds its path (traces it): one at a time, as
        #: kernels of several chunk sizes traced the one ``tf.function`` of the model
        #: concurrently (threads), and pfor then failed on one of them, rarely, as if the
        #: model could not be vectorised (its path is remembered for every size: below)
        self.tracing = threading.RLock()
        #: paths (see PATHS) that failed to build for this model where another one worked:
        #: kernels of other chunk sizes go straight past them
        self.failed: dict[str, str] = {}
        #: the fallback warnings given for this model (one of each kind)
        self.warned: set[type[Warning]] = set()

    def _build_sample(self, clone: Any) -> None:
        """Call a fresh clone once on a 2-row float64 sample (builds subclassed models)."""
        sig = self.signature
        u = tf.ones((2, *sig.unknown_shape), self.tf_dtype) * 0.5
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

    def accumulation(self) -> Any:
        """The Keras model's chain and its bracketing where mixed mode is offered, read once
        from its layers (:mod:`batchjac._backends.tensorflow.chain`), else None."""
        if "_accumulation" not in self.__dict__:
            from . import chain

            self._accumulation = chain.read(self)
        return self._accumulation

    def linear_head(self) -> Any:
        """The Keras model's linear head (:mod:`batchjac._backends.tensorflow.head`), else
        None."""
        if "_linear_head" not in self.__dict__:
            from . import head

            self._linear_head = head.read(self, _explain_model_failure)
        return self._linear_head

    def drop_accumulation(self, why: str) -> None:
        """No mixed mode for this model: its pieces failed to build (``why``)."""
        self._accumulation, self.mixed_failure = None, why

    #: why the mixed path failed for this model, where it did
    mixed_failure = ""

    # -- model call --------------------------------------------------------------------------
    def apply(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], twice: bool = False,
              model: Any = None) -> tf.Tensor:
        """``twice``: the inputs are assembled with ops that differentiate twice inside XLA
        (the second-order kernels: see :func:`.compat.twice_concat`). ``model``: call this instead
        of the bound model (the same computation, e.g. its Python function: threads sharing
        the bound model keep theirs)."""
        lay = self.signature.layout
        fn = self.model if model is None else model
        if twice:
            inputs = assemble(lay, u, ctx, concat=compat.twice_concat, take=compat.twice_take)
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

    def product(self, kind: str, u: Any, ctx: tuple[Any, ...], t: Any) -> tuple[Any, Any]:
        from . import products

        return products.product(self, kind, u, ctx, t)

    # -- probes ------------------------------------------------------------------------------
    def forward(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        if self._graph_forward is None:
            # probes, checks and solvers call this with many batch sizes: one trace for all
            fn = tf.function(lambda u, *ctx: self.apply(u, ctx), autograph=False,
                             reduce_retracing=True)
            # one such function per bound model, by design: TensorFlow's detector of frequent
            # retracing keys them all by this lambda's code, and would warn about traces that
            # are batchjac's choice, naming its internals (TFBound.forward.<locals>.<lambda>)
            compat.quiet_retracing(fn)
            self._graph_forward = fn
        return self._graph_forward(u, *ctx).numpy()

    def rows_apart(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        """Read from the Keras model's layers (:mod:`.keras`): no
        call, so none of the graph traces the probes' passes would cost (:mod:`.keras`)."""
        return self.output_shape_of(u, ctx) is not None

    def output_shape_of(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[int, ...] | None:
        """Only for a Keras model proven to keep its rows apart (then the probes need no call
        and may run beside the first kernel); None otherwise: the probes call the model."""
        if not self.is_keras or self.signature.layout.kind not in ("single", "concat"):
            return None
        if not hasattr(self, "_proven"):
            # the per-row shape the model is given must be the one it declares: where it is
            # not, the probes' call fails, and its error is explained (batchjac._probes.diagnose)
            x = assemble(self.signature.layout, u[:1], tuple(c[:1] for c in ctx),
                         concat=lambda xs: np.concatenate(xs, axis=-1),
                         take=lambda a, idx: np.take(a, list(idx), axis=-1))[0]
            self._proven = keras_output_shape(self.model, tuple(x.shape[1:]))
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

    # -- derivatives that carry gradients ----------------------------------------------------
    def differentiable(self, kind: str, how: str, *, with_outputs: bool, with_jacobian: bool,
                       recomputed: bool = False) -> Any:  # (each of its builds recomputes)
        from .differentiable import derivatives

        key = (kind, how, with_outputs, with_jacobian)
        if key not in self.differentiable_runs:
            self.differentiable_runs[key] = derivatives(self, kind, how, with_outputs,
                                                        with_jacobian)
        return self.differentiable_runs[key]

    def rematerialized(self, fn: Any) -> Any:
        from .differentiable import recomputed

        return recomputed(fn)

    def differentiable_output_shape(self, u: Any, ctx: tuple[Any, ...]) -> tuple[int, ...]:
        """Read from a one-input Keras model's layers where they tell it (:mod:`.keras`: no
        trace, as the probes'); else from a trace of the model on the arrays' specs."""
        if self.is_keras and self.signature.layout.kind == "single":
            found = keras_output_shape(self.model, tuple(int(d) for d in u.shape[1:]))
            if found is not None:
                return tuple(found)
        specs = [tf.TensorSpec(a.shape, a.dtype) for a in (u, *ctx)]
        y = tf.function(lambda u, *c: self.apply(u, c), autograph=False) \
            .get_concrete_function(*specs).structured_outputs
        return tuple(int(d) for d in y.shape[1:])

    # -- kernels -----------------------------------------------------------------------------
    def build_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool,
                     budget: CallBudget = UNTUNED) -> Kernel:
        return TFKernel(self, mode, chunk_size, with_outputs, budget)

    def build_second_kernel(self, kind: SecondKind, order: Order, chunk_size: int,
                            with_outputs: bool, with_jacobian: bool) -> Kernel:
        return TFSecondKernel(self, kind, order, chunk_size, with_outputs, with_jacobian)


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
    used = compat.gpu_memory_used("GPU:0")
    if used is None:  # (a TensorFlow that cannot tell: no device budget)
        return None
    return max(0, limit - used)


_LIMIT: list[int | None] = []


def _gpu_limit() -> int | None:
    """The memory TensorFlow's allocator may use on GPU:0 (its device attributes; read once)."""
    if not _LIMIT:
        _LIMIT.append(compat.gpu_memory_limit())
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

    def is_traced(self, a: Any) -> bool:
        return not tf.executing_eagerly() or not hasattr(a, "numpy")

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
