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
    ForwardModeFallbackWarning,
    InputError,
    ModelError,
    ReverseModeFallbackWarning,
    VectorizationFallbackWarning,
    XLAFallbackWarning as XLAFallbackWarning,
)
from .._spec import assemble
from ._base import (
    Backend,
    BoundModel,
    Kernel,
    Mode,
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
    """

    variants: tuple[str, ...] = ("xla", "graph")
    #: below this ratio graph/XLA time, the graph is chosen
    GRAPH_MARGIN = 0.95

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
        self.variant = None
        self.note = ""

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
        self.variants = type(self).variants  # (a path XLA failed for had the graph only)
        self.variant, self.note, self.untimed = None, "", False

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
        if self.failures and self.path is not None:
            note = f"{note}; computed in {_PATH_NAMES[self.path]} ({self._why()})"
        self.variant, self.note = variant, note

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray | None, np.ndarray]:
        if self.variant is None:
            out = self._establish(u, ctx)
        else:
            if self.path is not None and _path_mode(self.path) != self.mode and \
                    not fallback_allowed():  # an earlier call fell back; this one asks the mode
                raise self._asked_failed()
            out = self._call_selected(u, ctx)
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
            if self.variant != "xla" or "graph" not in self.variants:
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
        self.path, self._fns, self.variant, self.note = None, {}, None, ""
        self.variants = type(self).variants

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
        except Exception as xla_error:  # (a trace-time failure fails the graph below as well)
            if isinstance(xla_error, Warning) or _out_of_memory(xla_error):
                raise
            try:
                self._fn("graph")
                self._run("graph", u, ctx)
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
        # the shared race (interleaved rounds of back-to-back calls, medians): two single calls
        # each, as this timed before, once kept the graph for W1 (1.1 vs 1.3 ms just after
        # XLA's compilation) where XLA then ran 0.73 ms a call against the graph's 1.0
        best = race(lambda v: self._run(v, u, ctx), ("xla", "graph"))
        winner = "graph" if best["graph"] < self.GRAPH_MARGIN * best["xla"] else "xla"
        self._select(winner, f"{winner} (timed one chunk: XLA {best['xla'] * 1e3:.1f} ms, "
                             f"graph {best['graph'] * 1e3:.1f} ms)")


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


class TensorFlowBackend(Backend):
    name = "tensorflow"

    def bind(self, model: Any, signature: Signature, **options: Any) -> BoundModel:
        if options:
            raise InputError(f"The TensorFlow backend takes no options; got {sorted(options)}.")
        if not callable(model):
            raise InputError(f"`model` must be callable; got {type(model).__name__}.")
        return TFBound(model, signature)


BACKEND = TensorFlowBackend()
