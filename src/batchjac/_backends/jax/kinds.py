"""The model kinds JAX users hold, as the JAX engine computes them: a function of a batch,
``f(x)``, or of params and a batch, ``f(params, x)``, with the params as kernel arguments.

- a **Flax NNX** module and an **Equinox** module are pytrees of their arrays: nothing to do
  here, except Equinox's convention of one instance per call (:func:`per_instance`);
- a **Flax Linen** module is ``module.apply`` with its variables as params (given with
  ``backend_options``, or held by a bound module);
- a **Haiku** transformed function is its ``apply`` with params (and ``state``), no RNG;
- a **Keras 3 model on the JAX backend** is its ``stateless_call`` with its variables' values
  as the leaves of a pytree (:class:`KerasStateless`), read again at each call: a weight
  changed (``assign``, ``fit``) gives new kernel arguments, not a new trace.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import jax
import jax.numpy as jnp

from ... import _keras_compat
from ..._errors import InputError


def as_function(model: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``model`` as the JAX engine takes it, and the params to bind it with (``{}``: none,
    ``{"params": p}``). ``options`` are the backend options given (``params``, ``state``)."""
    kwargs = {"params": options["params"]} if "params" in options else {}
    if "state" in options and not _is_haiku(model):
        raise InputError(
            f"backend_options['state'] is for a Haiku function transformed with state "
            f"(hk.transform_with_state); the model is a {type(model).__name__}. Leave it out.")
    keras = _keras_on_jax(model)
    if keras is not None:
        if kwargs:
            raise InputError(
                f"A Keras model ({type(model).__name__}) holds its own variables; "
                f"backend_options['params'] is for a function f(params, x). Leave it out (the "
                f"model's current weights are read at each call).")
        return keras, {}
    if _is_haiku(model):
        return _haiku_apply(model, options)
    return _linen_apply(model, kwargs)


def per_instance(model: Any) -> bool | None:
    """Whether ``model`` maps one instance per call by its kind's convention, so that the
    probe of :meth:`JaxBound.guess_per_instance` decides (None: a batch function, as any
    other callable, unless ``per_instance`` is given)."""
    eqx = sys.modules.get("equinox")
    return True if eqx is not None and isinstance(model, eqx.Module) else None


# -- Keras 3 on the JAX backend ------------------------------------------------------------

def _keras_on_jax(model: Any) -> KerasStateless | None:
    keras = sys.modules.get("keras")
    layer = getattr(getattr(keras, "layers", None), "Layer", None)
    if not isinstance(layer, type) or not isinstance(model, layer):
        return None
    return KerasStateless(model)


@jax.tree_util.register_pytree_node_class
class KerasStateless:
    """A Keras 3 model on the JAX backend as a pytree: its leaves are the values of its
    trainable and non-trainable variables (read from the model when flattened, so the
    engine's check of a mutable pytree, :meth:`_Split.same`, sees an ``assign``), its static
    part the model. A call is ``stateless_call`` with the leaves given (traced, they are the
    kernel's arguments), in inference mode, its inputs passed as Keras takes them: one
    tensor, a list of several, or a dict by name. ``runner`` is the model that computes: the
    model, or its float64 clone (:meth:`widened`), which takes the model's values cast."""

    def __init__(self, model: Any, values: tuple[list[Any], list[Any]] | None = None,
                 runner: Any = None) -> None:
        self.model = model
        self.runner = model if runner is None else runner
        self._values = values

    def values(self) -> tuple[list[Any], list[Any]]:
        if self._values is not None:
            return self._values
        model = self.model
        return ([v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables])

    def tree_flatten(self) -> tuple[tuple[list[Any], list[Any]], Any]:
        return self.values(), (self.model, self.runner)

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> KerasStateless:
        return cls(aux[0], (list(children[0]), list(children[1])), aux[1])

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        trainable, fixed = self.values()
        y, _ = self.runner.stateless_call(trainable, fixed, _keras_inputs(inputs, named),
                                          training=False)
        return y

    def widened(self, sample: tuple[Any, ...], named: dict[str, Any], dtype: str = "float64"
                ) -> KerasStateless:
        """The model computed in ``dtype`` (Keras layers cast their inputs to their own
        dtype, so a float32 model given float64 values still computes in float32, and a
        mixed-precision one in half precision): a clone whose layers are ``dtype``, built on
        ``sample`` (or ``named``), that takes the model's current values, cast, at each
        call. The model itself where it computes in ``dtype`` already."""
        model = self.model
        keras = sys.modules["keras"]
        versions = f"Keras {getattr(keras, '__version__', '?')}, JAX {jax.__version__}"
        wide = self
        if _keras_compat.clone_needed(model, dtype):
            clone = _keras_compat.stateless_clone(
                keras, model, lambda c: c(_keras_inputs(sample, named), training=False), versions,
                dtype)
            wide = KerasStateless(model, None, clone)
        # Keras's own type promotion outside TensorFlow turns 64-bit results into 32-bit ones
        # (keras.backend.result_type: "aligned with JAX's default"): ops such as its tanh
        # compute a float64 tensor in float32. Results that are float64 in name only are
        # refused; a model whose every step stays float64 is computed in float64
        narrow = _narrowing_step(wide, sample, named, dtype)
        if narrow is not None:
            raise InputError(
                f"{dtype} was asked for, but this Keras model on the JAX backend computes in "
                f"a narrower dtype inside even with {dtype} weights and inputs ({narrow}; Keras turns "
                f"64-bit results into 32-bit ones outside TensorFlow: "
                f"keras.backend.result_type; {versions}). Use dtype='float32', or run it with "
                f"KERAS_BACKEND=tensorflow, where Keras computes in float64.")
        return wide


def _narrowing_step(model: KerasStateless, sample: tuple[Any, ...], named: dict[str, Any],
                    dtype: str) -> str | None:
    """The first step of ``model``'s computation, traced on ``dtype`` values, whose result
    is a narrower float (``"tanh to float32"``), or None."""
    values = jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
        model.values())

    def call(values: Any, inputs: Any, named: Any) -> Any:
        return KerasStateless(model.model, values, model.runner)(*inputs, **named)

    jaxpr = jax.make_jaxpr(call)(values, sample, named)
    return _first_narrow(jaxpr.jaxpr, jnp.dtype(dtype).itemsize)


def _first_narrow(jaxpr: Any, width: int) -> str | None:
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            dtype = getattr(getattr(var, "aval", None), "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and \
                    jnp.dtype(dtype).itemsize < width:
                return f"{eqn.primitive.name} to {jnp.dtype(dtype).name}"
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found = _first_narrow(inner, width)
                if found is not None:
                    return found
    return None


def _keras_inputs(inputs: tuple[Any, ...], named: dict[str, Any]) -> Any:
    return named if named else (inputs[0] if len(inputs) == 1 else list(inputs))


# -- Haiku ---------------------------------------------------------------------------------

def _is_haiku(model: Any) -> bool:
    hk = sys.modules.get("haiku")
    kinds = tuple(k for k in (getattr(hk, "Transformed", None),
                              getattr(hk, "TransformedWithState", None)) if isinstance(k, type))
    return bool(kinds) and isinstance(model, kinds)


def _haiku_apply(model: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A Haiku transformed function (``hk.transform(f)``) as its ``apply`` with no RNG; one
    transformed with state takes ``backend_options['state']`` too (its output, not its new
    state, is differentiated)."""
    hk = sys.modules["haiku"]
    with_state = isinstance(model, hk.TransformedWithState)
    name = "hk.transform_with_state" if with_state else "hk.transform"
    if "params" not in options:
        raise InputError(
            f"A Haiku function ({name}) computes with params it does not hold: pass them, "
            f"batchjac.jacobian(f, x, backend_options={{'params': params}}) (what f.init "
            f"returned){' and the state' if with_state else ''}.")
    if with_state:
        if "state" not in options:
            raise InputError(
                "A Haiku function transformed with state (hk.transform_with_state) needs its "
                "state too: backend_options={'params': params, 'state': state} (both from "
                "f.init).")
        apply = model.apply
        rng = (None,) if _takes_rng(apply) else ()

        def stateful(both: Any, *inputs: Any, **named: Any) -> Any:
            return apply(both[0], both[1], *rng, *inputs, **named)[0]

        return stateful, {"params": (options["params"], options["state"])}
    apply = model.apply
    if not _takes_rng(apply):  # (hk.without_apply_rng)
        return apply, {"params": options["params"]}

    def stateless(params: Any, *inputs: Any, **named: Any) -> Any:
        return apply(params, None, *inputs, **named)

    return stateless, {"params": options["params"]}


def _takes_rng(apply: Any) -> bool:
    """Whether a Haiku ``apply`` takes an RNG after its params (and state): not one made by
    ``hk.without_apply_rng``."""
    try:
        names = list(inspect.signature(apply).parameters)
    except (TypeError, ValueError):
        return True
    return "rng" in names


# -- Flax Linen ----------------------------------------------------------------------------

def _linen_apply(model: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A Flax Linen module as the function of its variables and a batch that it is
    (``module.apply``), with its variables as params: given with ``backend_options``, or held
    by a bound module (``module.bind(variables)``). Anything else as it is."""
    linen = sys.modules.get("flax.linen")
    if linen is None or not isinstance(model, linen.Module):
        return model, kwargs
    name = type(model).__name__
    if getattr(model, "scope", None) is not None:  # bound: it holds its variables
        if kwargs:
            raise InputError(
                f"The Flax Linen module {name} is bound to its variables already, and "
                f"backend_options['params'] gives others: pass the unbound module with "
                f"params, or the bound module alone.")
        module, variables = model.unbind()
        return module.apply, {"params": variables}
    if not kwargs:
        raise InputError(
            f"A Flax Linen module ({name}) computes with variables it does not hold: pass "
            f"them, batchjac.jacobian(module, x, backend_options={{'params': variables}}) "
            f"(what {name}.init returned), or the bound module, module.bind(variables).")
    return model.apply, kwargs
