"""One-off checks of a model for a batch signature, run before the first real chunk and cached
on the bound model: output shape, connection to the unknowns, determinism, and independence of
rows. Also what can be told from the model object alone (:func:`check_model`), and a better
explanation of a first call that failed (:func:`diagnose`)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import numpy as np

from ._backends import BoundModel
from ._errors import BatchJacError, InputError, ModelError, NotConnectedError, RowInteractionError
from ._keras_compat import flattened, is_keras as _is_keras
from ._spec import BatchSpec

PROBE_ROWS = 4
#: the first rows of the user's data read to find PROBE_ROWS finite ones among them
PROBE_READ_ROWS = 64


def _probe_batch(spec: BatchSpec) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Up to PROBE_ROWS finite rows of the user's data (the known inputs matter), at least 2."""
    u, ctx = spec.chunk(0, min(spec.n, PROBE_READ_ROWS))
    if spec.n:
        finite = np.isfinite(u.reshape(len(u), -1)).all(axis=1)
        for c in ctx:
            if c.dtype.kind == "f":
                finite &= np.isfinite(c.reshape(len(c), -1)).all(axis=1)
        rows = np.flatnonzero(finite)[:PROBE_ROWS]
    else:
        rows = np.array([], dtype=int)
    if rows.size == 0:  # no usable data (N = 0, or all NaN): synthetic rows of the right shape
        rng = np.random.default_rng(0)
        u = rng.standard_normal((2, *spec.unknown_shape)).astype(spec.dtype)
        ctx = tuple(np.zeros((2, *c.shape[1:]), c.dtype) + (0.5 if c.dtype.kind == "f" else 0)
                    for c in ctx)
        return u, ctx
    if rows.size == 1:
        rows = np.array([rows[0], rows[0]])
    return u[rows], tuple(c[rows] for c in ctx)


def run_probes(bound: BoundModel, spec: BatchSpec, name: str) -> None:
    u, ctx = _probe_batch(spec)
    rows = u.shape[0]
    if bound.rows_apart(u, ctx):
        # deterministic, rows kept apart, output rows at axis 0, all proven without values
        # (JAX's jaxpr): only the connection is left to check, as abstractly
        shape = bound.output_shape_of(u, ctx)
        if shape is not None:
            _check_connected(bound, spec, name, u, ctx)
            bound.output_shape = shape
            if bound.row_bytes is None:
                bound.row_bytes = bound.row_working_set(u, ctx)
            bound.probed = True
            return
    y0 = bound.forward(u, ctx)
    if y0.ndim == 0 or y0.shape[0] != rows:
        raise ModelError(
            f"For a batch of {rows} rows the model returned shape {y0.shape}; it must map a batch "
            f"(N, ...) to outputs (N, ...), one row per instance. If it handles one instance at "
            f"a time, vectorise it (e.g. jax.vmap) or use the backend's per-instance option."
        )
    _check_connected(bound, spec, name, u, ctx)
    if spec.n >= 1:
        _check_rows_independent(bound, u, ctx, y0)
    bound.output_shape = tuple(int(s) for s in y0.shape[1:])
    if bound.row_bytes is None:  # (PyTorch: counted in that forward pass)
        bound.row_bytes = bound.row_working_set(u, ctx)
    bound.probed = True


def _check_connected(bound: BoundModel, spec: BatchSpec, name: str, u: np.ndarray,
                     ctx: tuple[np.ndarray, ...]) -> None:
    if not bound.connected(u, ctx):
        raise NotConnectedError(
            f"The model's output does not depend on the unknowns (`{name}`, per-instance shape "
            f"{spec.unknown_shape}): autodiff finds no path from them to the output. This is "
            f"why GradientTape.jacobian returns None. Usual causes: the output is computed "
            f"outside the differentiable graph (model.predict, .numpy(), numpy functions), or "
            f"the model never reads the unknown input. (Unknown features that are merely unused "
            f"get zero columns; this error means none is used.)"
        )


def _check_rows_independent(bound: BoundModel, u: np.ndarray, ctx: tuple[np.ndarray, ...],
                            y0: np.ndarray) -> None:
    """Change row 0's inputs; every other row's output must stay the same (tensorflow#38428:
    batch statistics make each instance's output depend on the whole batch, and then
    per-instance Jacobians are silently wrong). First the same batch again: a model whose
    outputs change by themselves (random) would otherwise be blamed on its rows."""
    again = bound.forward(u, ctx)
    changed, diff, scale = _compare(y0, again)
    if changed.any():
        raise ModelError(
            f"The model is not deterministic: two calls on the same {len(u)} rows returned "
            f"different outputs (by up to {diff:.3g}, output scale {scale:.3g}), so it has no "
            f"per-instance Jacobian to compute (each call would differentiate another random "
            f"draw). Usual causes: dropout in training mode (Dropout(...)(x, training=True), "
            f"F.dropout(x, training=True)), noise layers (GaussianNoise, random augmentation), "
            f"random draws inside the model (tf.random, torch.randn, np.random), or a stateful "
            f"RNN carrying its state from call to call. Run the model in inference mode "
            f"(training=False, model.eval()), or take the randomness out of it: draw the noise "
            f"once, with a seed, and pass it as a known input."
        )
    rng = np.random.default_rng(1234)
    u1 = u.copy()
    u1[0] = u[0] + (0.5 * np.abs(u[0]) + 0.5) * rng.standard_normal(u[0].shape).astype(u.dtype)
    ctx1 = []
    for c in ctx:
        c1 = c.copy()
        if c.dtype.kind == "f" and c.shape[0]:
            c1[0] = c[0] + (0.5 * np.abs(c[0]) + 0.5) * rng.standard_normal(c[0].shape).astype(c.dtype)
        ctx1.append(c1)
    y1 = bound.forward(u1, tuple(ctx1))
    changed, diff, scale = _compare(y0[1:], y1[1:])
    if changed.any():
        raise RowInteractionError(
            f"The rows of a batch interact: changing instance 0's inputs changed the outputs of "
            f"other instances (by up to {diff:.3g}, output scale {scale:.3g}). Per-instance "
            f"Jacobians would then be silently wrong (see tensorflow#38428). Usual cause: batch "
            f"statistics, e.g. BatchNormalization in training mode or normalising over the "
            f"batch axis. Run the model in inference mode, or make each row's output depend "
            f"only on its own inputs."
        )


def _compare(y0: np.ndarray, y1: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Where two outputs differ by more than rounding (sqrt(eps) of the output scale), the
    largest difference and that scale."""
    a, b = y0.astype(np.float64), y1.astype(np.float64)
    both = np.isfinite(a) & np.isfinite(b)
    scale = max(float(np.abs(a[both]).max()) if both.any() else 1.0, 1e-30)
    tol = np.sqrt(np.finfo(y0.dtype if y0.dtype.kind == "f" else np.float32).eps) * scale
    changed = (np.abs(a - b) > tol) & both | (np.isfinite(a) != np.isfinite(b))
    diff = float(np.abs(a - b)[both].max()) if both.any() else float("nan")
    return changed, diff, scale


# -- what the model object tells before it is called -------------------------------------------

def _keras_layers(model: Any) -> list[Any]:
    layers = flattened(model, include_self=False)
    if layers is not None:
        return layers
    try:  # a Keras that cannot list its nested layers: its top-level ones
        return list(getattr(model, "layers", None) or [])
    except Exception:
        return []


def _keras_input_shape(model: Any) -> tuple[int | None, ...] | None:
    """A single-input Keras model's input shape, batch axis first; None when it has none yet
    (a subclassed or unbuilt model) or several inputs."""
    try:
        shape = model.input_shape
    except Exception:
        return None
    if isinstance(shape, list) and len(shape) == 1:
        shape = shape[0]
    if isinstance(shape, tuple) and shape and all(d is None or isinstance(d, int) for d in shape):
        return shape
    return None


#: models check_model found fine (weakly held: the check runs once per model object)
_CHECKED: weakref.WeakSet[Any] = weakref.WeakSet()


def check_model(model: Any) -> None:
    """Refuse what the model object alone shows cannot have per-instance Jacobians: a Keras
    stateful RNN (its state carries from batch to batch, and its batch size is fixed). Runs
    before the model is bound or called, once per model object."""
    if not _is_keras(model):
        return
    try:
        if model in _CHECKED:
            return
    except TypeError:  # not hashable or weakly referenceable: check it every time
        pass
    for layer in _keras_layers(model):
        if getattr(layer, "stateful", False) is True:
            shape = _keras_input_shape(model)
            batch = f" ({shape[0]} rows)" if shape and shape[0] is not None else ""
            raise ModelError(
                f"The model has a stateful recurrent layer ({type(layer).__name__} "
                f"{getattr(layer, 'name', '')!r}, stateful=True): it carries its state from "
                f"one batch to the next and takes batches of one fixed size{batch} only, so "
                f"an instance's output depends on the rows before it and per-instance "
                f"Jacobians are not defined. Rebuild the model with stateful=False and copy "
                f"the weights (new.set_weights(model.get_weights())); to differentiate "
                f"through a sequence, give each whole sequence as one instance, shape (N, "
                f"timesteps, features)."
            )
    with contextlib.suppress(TypeError):
        _CHECKED.add(model)


# -- a first call that failed ------------------------------------------------------------------

def _argument(spec: BatchSpec, i: int) -> str:
    """How a message names input ``i``: the command-line option it came from (``--inputs
    (x.npy)``), else the argument in backquotes."""
    what = getattr(spec.arrays[i], "what", "")
    if isinstance(what, str) and what.startswith("--"):
        return f"{what} ({spec.arrays[i].source})"
    return f"`{spec.names[i]}`"


def _shape(per_row: tuple[Any, ...]) -> str:
    return "(" + ", ".join(["N", *("None" if d is None else str(d) for d in per_row)]) + ")"


def diagnose(model: Any, spec: BatchSpec, error: BatchJacError) -> BatchJacError | None:
    """A clearer error for a model that failed on its first call, when the inputs' shapes
    explain it: inputs that do not have the width (or rank) a Keras model declares (an
    InputError: the inputs, not the model, are wrong), or a 1-D input where the model may take
    (N, features) (the framework's error, with that hint). None when nothing better can be
    said."""
    if not (type(error) is ModelError or isinstance(error.__cause__, ModelError)):
        return None  # a verdict of the probes, or an error that is not a failed call
    lay = spec.layout
    expected = _keras_input_shape(model) if _is_keras(model) else None
    if expected is not None and lay.kind in ("single", "concat"):
        found = _keras_mismatch(spec, tuple(expected[1:]))
        if found is not None:  # the model is fine: the inputs do not fit it
            return InputError(found)
    flat = [i for i, a in enumerate(spec.arrays) if len(a.shape) == 1 and lay.kind != "concat"]
    if not flat:
        return None
    i = flat[0]
    what = _argument(spec, i)
    return type(error)(
        f"{error} ({what} is 1-D, shape {tuple(spec.arrays[i].shape)}: one number per instance. "
        f"If the model takes feature vectors, give it shape (N, features), e.g. x[:, None] for "
        f"one feature.)"
    )


def _keras_mismatch(spec: BatchSpec, want: tuple[int | None, ...]) -> str | None:
    """What is wrong with the one model input, against a Keras model's declared per-row shape."""
    lay = spec.layout
    if lay.kind == "concat":
        u, h = spec.arrays
        given: tuple[int, ...] = (*u.shape[1:-1], u.shape[-1] + h.shape[-1])
        what = f"{_argument(spec, 0)} has {u.shape[-1]} and {_argument(spec, 1)} {h.shape[-1]}"
    else:
        given = tuple(spec.arrays[0].shape[1:])
        what = _argument(spec, 0)
    if not want:
        return None
    if not given:
        width = "" if want[-1] is None else f"{want[-1]} "
        hint = " (x[:, None] for one feature)" if want[-1] == 1 else ""
        return (f"{what} has shape {tuple(spec.arrays[0].shape)}, one number per instance, but "
                f"the model takes {_shape(want)} inputs: (N, features) expected. Give one row "
                f"of {width}features per instance{hint}.")
    if len(given) != len(want) or any(w is not None and g != w for g, w in zip(given[:-1], want[:-1])):
        return (f"The model takes inputs of shape {_shape(want)}, but {what} gives "
                f"{_shape(given)}: reshape the inputs to the model's per-instance shape.")
    if want[-1] is None or given[-1] == want[-1]:
        return None
    if lay.kind == "concat":
        need = want[-1] - spec.arrays[0].shape[-1]
        fix = (f"the known inputs must be the other {need} columns" if need > 0 else
               f"the unknowns alone are {spec.arrays[0].shape[-1]} columns: give fewer")
        return (f"The model takes {want[-1]} input columns, but {what}: {given[-1]} in all (the "
                f"model takes concat([unknown, known], -1)); {fix}.")
    cli = isinstance(getattr(spec.arrays[0], "what", None), str) and \
        spec.arrays[0].what.startswith("--")
    if given[-1] < want[-1]:
        fix = ("forgot --known? Give the other columns with --known FILE (the model takes "
               "concat([inputs, known], -1))" if cli else
               "forgot the known inputs? Pass them as jacobian(model, unknown, known): the "
               "model then takes concat([unknown, known], -1)")
        return f"The model takes {want[-1]} input columns, {what} has {given[-1]}; {fix}."
    return (f"The model takes {want[-1]} input columns, {what} has {given[-1]}: give only the "
            f"columns the model reads (the unknowns are chosen among them with "
            f"{'--wrt' if cli else 'wrt='}).")
