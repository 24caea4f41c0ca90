"""Every private or version-specific TensorFlow and Keras name the backend uses, each guarded.

The rest of the backend reaches TensorFlow's and Keras's internals only through this module
(tests/test_architecture.py checks the imports). Each use has a fallback where the internal
is missing or has changed: batchjac then runs slower, or less quietly, and stays right (never
a ModelError blamed on the model); where no fallback can exist, the error names the version.
tests/test_compat_tensorflow.py removes or renames each one and checks the numbers.

The sites (the numbers of the fragility census in the engine review):

1. :func:`keras_layers`: Keras's ``model._flatten_layers``; without it, no layer list, and
   the probes call the model (:mod:`.keras`).
2. :func:`is_keras_class`: the row-wise layer allowlist names Keras's classes; a layer counts
   only if its class *is* the class its Keras exports under that name, so a renamed, moved,
   subclassed or unknown class means "call the model", never "skip the probes".
3. :func:`fast_call`: ``ConcreteFunction._call_flat(args, captured)``; absent, or with
   another signature, or refusing the arguments with a TypeError: the public call.
4. :func:`gpu_memory_limit`: ``tensorflow.python.client.device_lib``; without it, no device
   budget (the host's is used).
5. :func:`gpu_memory_used`: ``tf.config.experimental.get_memory_info``; without it, no
   device budget.
6. :func:`batch_jacobian`: ``GradientTape.batch_jacobian(experimental_use_pfor=)``; without
   the keyword, the vectorised call as it is, and the loop computed by the caller.
7. :func:`is_tf_function`: ``tf.types.experimental.PolymorphicFunction``; without it, a
   ``tf.function`` is told by its public attributes.
8. :func:`quiet_pfor`, :func:`quiet_retracing`: the filter of pfor's log records (by the
   path of its module) and tf.function's ``_omit_frequent_tracing_warning``; without them,
   TensorFlow's own log lines and warnings show (cosmetic).
9. :func:`widen_config`, :func:`clone_from_config`, :func:`dtype_policy`: the Keras config
   schema and the global dtype policy for the float64 clone; where a Keras cannot be cloned
   in float64 (the clone would keep float32 weights or Input layers), an InputError that names
   the versions and offers float32.
10. :func:`rebuild_op`: ``Graph.create_op(op.type, attrs=op.node_def.attr)`` for the forward
    Laplacian; where it is missing or refuses, ``NotImplementedError``: the kernel keeps its
    other builds.
11. :func:`op_type` and the op-type tables (:data:`AFFINE`, :data:`MULTILINEAR`,
    :data:`RESHAPES`, :data:`SKIP`): an operation whose type is in no table has no rule, and
    the forward Laplacian raises ``NotImplementedError`` (the kernel's other builds: nested
    tapes); no name is matched by prefix or pattern.
12. :func:`twice_concat`, :func:`twice_take`: a workaround, in public operations, for XLA's
    missing gradient of ``XlaDynamicUpdateSlice``; a second-order XLA build that still meets
    such a gap while it is traced (:data:`XLA_GRADIENT_GAP`) falls back to the plain graph,
    with an :class:`~batchjac.XLAFallbackWarning`.
13. :func:`not_converted`: AutoGraph's ``config.CONVERSION_RULES``, to which batchjac adds
    itself as a library AutoGraph does not convert (as TensorFlow lists numpy and Keras), so
    that a differentiable call inside the caller's ``tf.function`` runs batchjac's Python as
    it is; without it, AutoGraph tries each of batchjac's functions and logs why it could not
    convert some (cosmetic: it then calls them unconverted).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from ... import _keras_compat
from .._base import first_line


def framework_versions() -> str:
    """``TensorFlow 2.21.0, Keras 3.15.1``: for errors where a version lacks what is needed."""
    names = [f"TensorFlow {getattr(tf, '__version__', '?')}"]
    keras = keras_module()
    if keras is not None:
        names.append(f"Keras {getattr(keras, '__version__', '?')}")
    return ", ".join(names)


def keras_module() -> Any | None:
    try:
        import keras
    except ImportError:  # pragma: no cover - keras ships with tensorflow>=2.16
        return None
    return keras


# -- 1, 2: the Keras layer walk and the row-wise allowlist ------------------------------------

#: the private method of Keras models that lists every nested layer
FLATTEN_LAYERS = _keras_compat.FLATTEN_LAYERS


def keras_layers(model: Any) -> list[Any] | None:
    """Every layer nested in a Keras model (itself left out), or None where this Keras cannot
    list them (the caller then knows nothing of the layers)."""
    return _keras_compat.flattened(model, include_self=False, name=FLATTEN_LAYERS)


def is_keras_class(obj: Any, name: str) -> bool:
    """Whether ``obj``'s class is exactly the class ``name`` of the Keras it comes from, as
    that Keras exports it (``keras.layers.Dense``, ``keras.Sequential``; ``tf_keras``
    likewise); False where that Keras has no class of that name there (renamed, moved,
    removed) or ``obj`` is of a subclass, which may compute otherwise."""
    cls = type(obj)
    root = (getattr(cls, "__module__", "") or "").split(".")[0]
    if root not in _HOMES or cls.__name__ != name:
        return False
    return any(_exported(home, name) is cls for home in _HOMES[root].get(name, _HOMES[root][""]))


#: where each Keras exports the classes the allowlist names: its public modules, and for the
#: functional model's class, which no Keras makes public, the private module that defines it
_HOMES: dict[str, dict[str, tuple[str, ...]]] = {
    "keras": {"": ("keras.layers", "keras", "keras.models"),
              "Functional": ("keras.src.models.functional",)},
    "tf_keras": {"": ("tf_keras.layers", "tf_keras", "tf_keras.models"),
                 "Functional": ("tf_keras.src.engine.functional",)},
}


@functools.cache
def _exported(home: str, name: str) -> Any:
    try:
        module = importlib.import_module(home)
    except Exception:
        return None
    return getattr(module, name, None)


# -- 3: the flat call of a concrete function -------------------------------------------------

#: the private method of ConcreteFunction that calls it on a flat list of tensors
CALL_FLAT = "_call_flat"


@functools.cache
def _flat_signature_known(method: Any) -> bool:
    """Whether ``_call_flat`` takes ``(tensor_inputs, captured_inputs)``, as it has since
    TensorFlow 2.x began."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                             p.VAR_KEYWORD)]
    return len(positional) == 3 and len(required) == 3  # (self, tensors, captured)


def fast_call(fn: Any) -> Callable[..., Any]:
    """A call of the ConcreteFunction ``fn``: its ``_call_flat``, which skips binding the
    arguments to the signature (a quarter of a small chunk's time); the public call where
    that method is gone, takes other arguments, or refuses these with a TypeError (from then
    on). Tensors go in as they are, arrays as constants."""
    flat = getattr(fn, CALL_FLAT, None)
    if flat is None or not _flat_signature_known(getattr(type(fn), CALL_FLAT, None)):
        return lambda *args: fn(*args)
    captured = fn.captured_inputs
    use = [flat]

    def call(*args: Any) -> Any:
        flat = use[0]
        if flat is not None:
            try:
                return flat([a if not isinstance(a, np.ndarray) and tf.is_tensor(a)
                             else tf.constant(a) for a in args], captured)
            except TypeError:  # another TensorFlow's private call: the public one from now on
                use[0] = None
        return fn(*args)

    return call


# -- 4, 5: the GPU's memory ------------------------------------------------------------------

def gpu_memory_limit() -> int | None:
    """The memory TensorFlow's allocator may use on the first GPU (its device attributes), or
    None (no GPU, or a TensorFlow without ``device_lib``)."""
    try:
        from tensorflow.python.client import device_lib

        found = [d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU"]
        return int(found[0]) if found else None
    except Exception:  # a TensorFlow without that module: no device budget
        return None


def gpu_memory_used(device: str = "GPU:0") -> int | None:
    """Bytes TensorFlow holds on ``device`` now; 0 where it cannot say for this device, None
    where this TensorFlow has no ``get_memory_info`` (then no device budget)."""
    info = getattr(getattr(tf.config, "experimental", None), "get_memory_info", None)
    if not callable(info):
        return None
    try:
        return int(info(device)["current"])
    except (ValueError, RuntimeError):
        return 0
    except Exception:  # another signature or result: no device budget
        return None


# -- 6: batch_jacobian without pfor ----------------------------------------------------------

@functools.cache
def _takes(method: Any, keyword: str) -> bool:
    try:
        return keyword in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def batch_jacobian(tape: tf.GradientTape, target: tf.Tensor, source: tf.Tensor, *,
                   pfor: bool) -> tf.Tensor | None:
    """``tape.batch_jacobian(target, source)``, unconnected gradients as zeros, vectorised by
    pfor or (``pfor=False``) in a while loop over the outputs; None for the loop where this
    TensorFlow's ``batch_jacobian`` has no ``experimental_use_pfor`` (the caller computes it)."""
    zero = tf.UnconnectedGradients.ZERO
    if _takes(type(tape).batch_jacobian, "experimental_use_pfor"):
        return tape.batch_jacobian(target, source, unconnected_gradients=zero,
                                   experimental_use_pfor=pfor)
    if not pfor:
        return None
    return tape.batch_jacobian(target, source, unconnected_gradients=zero)


# -- 7: what a tf.function is ----------------------------------------------------------------

def is_tf_function(obj: Any) -> bool:
    """Whether ``obj`` is a ``tf.function`` (``tf.types.experimental.PolymorphicFunction``, or
    ``GenericFunction`` in TensorFlows that name it so); where neither exists, told by the
    public attributes every tf.function has."""
    experimental = getattr(getattr(tf, "types", None), "experimental", None)
    kinds = tuple(t for t in (getattr(experimental, n, None) for n in
                              ("PolymorphicFunction", "GenericFunction")) if isinstance(t, type))
    if kinds:
        return isinstance(obj, kinds)
    return callable(getattr(obj, "get_concrete_function", None)) and \
        callable(getattr(obj, "python_function", None))


# -- 8: TensorFlow's noise -------------------------------------------------------------------

#: the part of the path of pfor's modules that marks its log records
PFOR_PATH = "parallel_for"


class _PforNoise(logging.Filter):
    """Drops the ERROR records pfor logs (pages of op definitions) when it cannot vectorise:
    batchjac then computes the Jacobians another way, and says so in one warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and PFOR_PATH in record.pathname)


@contextlib.contextmanager
def quiet_pfor() -> Iterator[None]:
    logger, noise = tf.get_logger(), _PforNoise()
    logger.addFilter(noise)
    try:
        yield
    finally:
        logger.removeFilter(noise)


#: tf.function's private switch of its detector of frequent retracing
OMIT_RETRACING_WARNING = "_omit_frequent_tracing_warning"


def quiet_retracing(fn: Any) -> None:
    """Keep ``fn``'s traces out of TensorFlow's frequent-retracing warning (they are
    batchjac's choice); nothing where this TensorFlow has no such switch."""
    if hasattr(fn, OMIT_RETRACING_WARNING):
        with contextlib.suppress(Exception):
            setattr(fn, OMIT_RETRACING_WARNING, True)


#: AutoGraph's table of the modules it converts or not (a tuple of rules)
AUTOGRAPH_CONFIG = "tensorflow.python.autograph.core.config"


def not_converted(package: str) -> None:
    """AutoGraph leaves ``package``'s functions unconverted (see the module's docstring, 13);
    nothing where this TensorFlow has no such table."""
    with contextlib.suppress(Exception):
        config: Any = importlib.import_module(AUTOGRAPH_CONFIG)
        rules = config.CONVERSION_RULES
        if not any(getattr(r, "_prefix", None) == package for r in rules):
            config.CONVERSION_RULES = (config.DoNotConvert(package), *rules)


# -- 9: the Keras float64 clone --------------------------------------------------------------

# (the Keras config schema and the global dtype policy are Keras's, whatever its backend:
# batchjac._keras_compat, where the JAX backend's Keras models use them too)
widen_config = _keras_compat.widen_config
clone_from_config = _keras_compat.clone_from_config
dtype_policy = _keras_compat.dtype_policy


# -- 10, 11: re-creating graph operations, and the op-type tables ----------------------------

#: affine in the floating inputs that vary: the tangent is the operation applied to the
#: tangents, with every other floating input as zeros (integer inputs: shapes, axes, indices)
AFFINE = frozenset({
    "ConcatV2", "Pack", "AddV2", "Add", "Sub", "BiasAdd", "Identity", "Reshape", "Squeeze",
    "ExpandDims", "Transpose", "Sum", "Mean", "StridedSlice", "Slice", "GatherV2", "Cast",
    "Neg", "Tile", "Pad", "PadV2", "SelectV2", "Select", "AddN", "Unpack", "Split", "SplitV",
    "EnsureShape",
})
#: linear in each floating input: linear while only one varies (the others kept)
MULTILINEAR = frozenset({"MatMul", "BatchMatMulV2", "BatchMatMulV3", "Mul", "Einsum", "Conv2D",
                         "RealDiv", "DepthwiseConv2dNative"})
#: affine operations that only move or relabel their first input's elements: their tangents
#: are moved alike
RESHAPES = frozenset({"Identity", "EnsureShape", "Reshape", "Squeeze", "ExpandDims", "Cast"})
#: operations that compute nothing the derivatives need
SKIP = frozenset({"NoOp"})


def op_type(op: tf.Operation) -> str:
    """The type of a graph operation, as the rules and the tables name it (the name of its
    registered op definition, which a TensorFlow may rename: then no rule matches)."""
    return str(op.type)


#: the method of TensorFlow's graphs that adds an operation by its type and attributes
CREATE_OP = "create_op"


def rebuild_op(op: tf.Operation, inputs: list[tf.Tensor]) -> list[tf.Tensor]:
    """``op`` created again in the current graph on ``inputs`` (its attributes as they were);
    ``NotImplementedError`` where this TensorFlow cannot (no ``create_op``, or one that takes
    other arguments): the forward Laplacian is then not built, and the kernel keeps its
    other builds."""
    graph = tf.compat.v1.get_default_graph()
    create = getattr(graph, CREATE_OP, None)
    if not callable(create):
        raise NotImplementedError(
            f"this TensorFlow cannot re-create graph operations (no Graph.create_op; "
            f"{framework_versions()})")
    try:
        attrs = dict(op.node_def.attr.items())
        new = create(op.type, inputs, dtypes=[o.dtype for o in op.outputs], attrs=attrs)
    except (AttributeError, TypeError) as e:
        raise NotImplementedError(
            f"this TensorFlow cannot re-create the operation {op.type} "
            f"({first_line(e)}; {framework_versions()})") from e
    return list(new.outputs)


# -- 12: the inputs of second-order builds, assembled twice-differentiably under XLA ---------

#: what tracing a second-order XLA build raises where an operation XLA put in has no gradient
#: registered (``LookupError: gradient registry has no entry for: XlaDynamicUpdateSlice``),
#: a gap :func:`twice_concat` does not cover: the kernel then runs the plain graph
XLA_GRADIENT_GAP: tuple[type[Exception], ...] = (LookupError,)


def _selector(rows: int, cols: int, pairs: list[tuple[int, int]], dtype: Any) -> tf.Tensor:
    eye = np.zeros((rows, cols), dtype=np.dtype(dtype.as_numpy_dtype))
    for r, c in pairs:
        eye[r, c] = 1
    return tf.constant(eye)


def twice_concat(xs: list[tf.Tensor]) -> tf.Tensor:
    """``tf.concat(xs, -1)`` as products with 0/1 selector matrices. Inside an XLA function
    the gradients of ``concat``, ``slice`` and ``pad`` are ``XlaDynamicUpdateSlice`` ops,
    which have no gradient of their own, so a ``ForwardAccumulator`` over a tape fails to
    trace through them; matrix products differentiate any number of times, and the
    selectors are as wide as the model's input row. Public operations only, and needed
    whether or not a TensorFlow closes that gap: without them, TensorFlow's forward mode
    reuses what it traced for one kind of build in the other, so a failed XLA trace can fail
    the plain graph's too."""
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


def twice_take(x: tf.Tensor, idx: tuple[int, ...]) -> tf.Tensor:
    """``tf.gather(x, idx, axis=-1)`` as a product with a 0/1 selector (see
    :func:`twice_concat`)."""
    sel = _selector(int(x.shape[-1]), len(idx), [(src, pos) for pos, src in enumerate(idx)], x.dtype)
    return tf.einsum("...i,ij->...j", x, sel)
