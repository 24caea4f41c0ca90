"""TensorFlow / Keras backend.

Reverse mode is ``GradientTape.batch_jacobian`` (one vectorised backward pass per output);
forward mode pushes one batched tangent per unknown feature through
``tf.autodiff.ForwardAccumulator``, vectorised with ``tf.vectorized_map``. Both are compiled
once per chunk shape, with XLA (``jit_compile=True``) and as a plain graph, and the faster of
the two on one chunk is kept (:class:`TFKernel`); they are called through their concrete
function, which skips tf.function's per-call argument matching (~0.2 ms on a small CPU).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TF's C++ start-up chatter off stderr

import numpy as np
import tensorflow as tf

from .._errors import InputError, ModelError, XLAFallbackWarning as XLAFallbackWarning
from .._spec import assemble
from ._base import Backend, BoundModel, Kernel, Mode, Signature


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
    def apply(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...]) -> tf.Tensor:
        lay = self.signature.layout
        inputs = assemble(lay, u, ctx, concat=lambda xs: tf.concat(xs, axis=-1),
                          take=lambda x, idx: tf.gather(x, list(idx), axis=-1))
        try:
            if lay.kind in ("single", "concat"):
                y = self.model(inputs[0], training=False) if self.is_keras else self.model(inputs[0])
            elif lay.kind == "tuple":
                y = self.model(list(inputs), training=False) if self.is_keras else self.model(*inputs)
            else:
                assert lay.keys is not None
                d = dict(zip(lay.keys, inputs))
                y = self.model(d, training=False) if self.is_keras else self.model(**d)
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

    def _specs(self, rows: int | None) -> list[tf.TensorSpec]:
        sig = self.signature
        specs = [tf.TensorSpec((rows, *sig.unknown_shape), self.tf_dtype)]
        specs += [tf.TensorSpec((rows, *shape), tf.as_dtype(dt)) for shape, dt in sig.ctx]
        return specs

    # -- probes ------------------------------------------------------------------------------
    def forward(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        if self._graph_forward is None:
            # probes, checks and solvers call this with many batch sizes: one trace for all
            self._graph_forward = tf.function(lambda u, *ctx: self.apply(u, ctx), autograph=False,
                                              reduce_retracing=True)
        return self._graph_forward(u, *ctx).numpy()

    def connected(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
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
    def jac_reverse(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...]) -> tuple[tf.Tensor, tf.Tensor]:
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
        jac = tape.batch_jacobian(flat_y, flat_u, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return y, tf.reshape(jac, tf.concat([tf.shape(y), list(ushape)], axis=0))

    def jac_forward(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...]) -> tuple[tf.Tensor, tf.Tensor]:
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

        ys, jvps = tf.vectorized_map(one, basis)  # (k, B, *out)
        y = ys[0]
        rows = tf.shape(u)[0]
        out_shape = tf.shape(y)[1:]
        jac = tf.transpose(tf.reshape(jvps, (k, rows, -1)), (1, 2, 0))
        jac = tf.reshape(jac, tf.concat([[rows], out_shape, list(ushape)], axis=0))
        return y, jac

    def build_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool) -> Kernel:
        return TFKernel(self, mode, chunk_size, with_outputs)


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
    """

    variants: tuple[str, ...] = ("xla", "graph")
    #: below this ratio graph/XLA time, the graph is chosen
    GRAPH_MARGIN = 0.95

    def __init__(self, bound: TFBound, mode: Mode, chunk_size: int, with_outputs: bool) -> None:
        self.mode, self.chunk_size, self.with_outputs = mode, chunk_size, with_outputs
        self._bound = bound
        jac = bound.jac_reverse if mode == "reverse" else bound.jac_forward

        def traced(u: tf.Tensor, *ctx: tf.Tensor) -> Any:
            bound.trace_count += 1
            y, j = jac(u, ctx)
            return (y, j) if with_outputs else j

        self._traced = traced
        self._specs = bound._specs(chunk_size)
        self._fns: dict[str, Any] = {}  # traced when first used: the untimed first call
        self.variant = None           # traces the plain graph only
        self.note = ""

    def _fn(self, variant: str) -> Any:
        if variant not in self._fns:
            self._fns[variant] = tf.function(self._traced, jit_compile=variant == "xla",
                                             autograph=False).get_concrete_function(*self._specs)
        return self._fns[variant]

    def _select(self, variant: str, note: str) -> None:
        fn = self._fn(variant)
        # ConcreteFunction._call_flat skips re-binding the arguments to the signature (~0.15 ms
        # per call, a quarter of a small chunk); fall back to the public call if it goes away.
        flat = getattr(fn, "_call_flat", None)
        captured = fn.captured_inputs
        if flat is None:
            self._call = lambda *args: fn(*args)
        else:
            self._call = lambda *args: flat([tf.constant(a) for a in args], captured)
        self.variant, self.note = variant, note

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray | None, np.ndarray]:
        if self.variant is None:
            self._first_call(u, ctx)
        try:
            out = self._call(u, *ctx)
        except _XLA_ERRORS as e:
            if self.variant != "xla" or "graph" not in self.variants:
                raise
            self._xla_failed(e)  # XLA fixed (use) on a kernel that ran the graph until then
            out = self._call(u, *ctx)
        # The Jacobians as a read-only view of TensorFlow's buffer: ``.numpy()`` would copy
        # them (78 ms of W2's 370 ms). Read-only because TensorFlow may hand out one buffer
        # twice (a constant-folded Jacobian); the runner copies chunks into the result anyway.
        if self.with_outputs:
            return out[0].numpy(), np.asarray(out[1])
        return None, np.asarray(out)

    def _run(self, variant: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> float:
        start = time.perf_counter()
        out = self._fn(variant)(u, *ctx)
        np.asarray(out[1] if self.with_outputs else out)
        return time.perf_counter() - start

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
                self._run("graph", u, ctx)
            except tf.errors.OpError:
                pass  # the graph fails where XLA may not: take the XLA path below
            else:
                self._select("graph", f"graph ({untimed_note()})")
                self.untimed = True
                return
        try:
            first = self._run("xla", u, ctx)
        except _XLA_ERRORS as xla_error:
            try:
                self._fn("graph")
                self._run("graph", u, ctx)
            except tf.errors.OpError as e:
                raise ModelError(f"The model failed while computing the Jacobian: {e.message}") from e
            self._xla_failed(xla_error)
            return
        if self._forced is not None:
            self._select(self._forced, f"{self._forced} (fixed)")
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
                XLAFallbackWarning, stacklevel=5,
            )
        self.variants = ("graph",)
        self._select("graph", "graph (XLA could not compile the model)")

    def retune(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        if not self.untimed or self._forced is not None or "xla" not in self.variants:
            return
        self.untimed = False
        try:
            first = self._run("xla", u, ctx)
        except _XLA_ERRORS as e:
            self._xla_failed(e)
            return
        self._race_builds(u, ctx, first)

    def _race_builds(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], first: float) -> None:
        self._fn("graph")
        try:
            self._run("graph", u, ctx)  # trace and warm up
        except tf.errors.OpError:  # XLA runs it but the graph does not: keep XLA
            self._select("xla", "xla (the plain graph failed)")
            return
        rounds = 2 if first < 1.0 else 1
        best = {"xla": float("inf"), "graph": float("inf")}
        for _ in range(rounds):  # interleaved, minimum: robust to a busy machine
            for variant in best:
                best[variant] = min(best[variant], self._run(variant, u, ctx))
        winner = "graph" if best["graph"] < self.GRAPH_MARGIN * best["xla"] else "xla"
        self._select(winner, f"{winner} (timed one chunk: XLA {best['xla'] * 1e3:.1f} ms, "
                             f"graph {best['graph'] * 1e3:.1f} ms)")


def _explain_model_failure(e: Exception, sig: Signature) -> ModelError:
    text = f"{type(e).__name__}: {e}"
    if "numpy()" in text or "EagerTensor" in text or "eager execution" in text or \
            ("predict" in text and "tf.function" in text):
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


class TensorFlowBackend(Backend):
    name = "tensorflow"

    def bind(self, model: Any, signature: Signature, **options: Any) -> BoundModel:
        if options:
            raise InputError(f"The TensorFlow backend takes no options; got {sorted(options)}.")
        if not callable(model):
            raise InputError(f"`model` must be callable; got {type(model).__name__}.")
        return TFBound(model, signature)


BACKEND = TensorFlowBackend()
