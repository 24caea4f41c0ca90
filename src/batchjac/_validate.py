"""Validation and normalisation of the public call forms into a :class:`BatchSpec`.

All checks that need no model run here, first, before any framework is touched. Messages name
the argument, say what was received, and how to fix it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ._errors import InputError, InputTypeError
from ._spec import BatchSpec, InputKind, Layout, check_finite_rows
from ._xp import NUMPY, ArrayOps

NanPolicy = Literal["raise", "propagate"]
DTypeLike = Any

_VALID_DTYPES = ("float32", "float64")


class LabelledArray(np.ndarray):
    """A numpy array that keeps the column names of the table it was made from (a pandas
    DataFrame), so that ``wrt`` can name columns and a store can label the unknowns. Only the
    whole array has them: slices are plain arrays with ``columns`` None."""

    columns: tuple[str, ...] | None = None


def _is_table(obj: Any) -> bool:
    """A pandas-like DataFrame, recognised without importing pandas."""
    return (hasattr(obj, "columns") and hasattr(obj, "dtypes") and callable(getattr(obj, "to_numpy", None))
            and not is_lazy(obj))


def _table_to_numpy(obj: Any, name: str) -> np.ndarray:
    """A DataFrame as a 2-D array of its numbers, its column names kept (see LabelledArray)."""
    columns = [str(c) for c in obj.columns]
    bad = [c for c, dt in zip(columns, obj.dtypes) if getattr(dt, "kind", "O") not in "fiub"]
    if bad:
        shown = bad[:10] + (["..."] if len(bad) > 10 else [])
        raise InputTypeError(
            f"`{name}` is a table whose column(s) {shown} are not numeric; batchjac reads "
            f"numbers only. Drop or encode them first, e.g. {name}.drop(columns={bad[:3]!r}) or "
            f"pandas.get_dummies({name})."
        )
    arr = np.asarray(obj.to_numpy())
    if arr.dtype.kind not in "fiub":  # nullable integer/float columns holding missing values
        arr = np.asarray(obj.to_numpy(dtype=np.float64, na_value=np.nan))
    out = arr.view(LabelledArray)
    out.columns = tuple(columns) if arr.ndim == 2 and len(columns) == arr.shape[1] else None
    return out


#: element types that have no numpy dtype of their own (ml_dtypes', torch's, TensorFlow's
#: names): batchjac computes in float32/float64; bfloat16 is widened to float32 on entry (exact,
#: as float16 is), the narrower ones are refused
_LOW_PRECISION = re.compile(r"\b(bfloat16|float8_\w+|float6_\w+|float4_\w+)\b")

#: how to make a float32 array of one framework's array ("numpy" for anything else)
_CAST_HINT = {"torch": "{n}.float()", "jax": "{n}.astype(jnp.float32)",
              "tensorflow": "tf.cast({n}, tf.float32)", "numpy": "{n}.astype(np.float32)"}

#: symbolic values (a shape and a dtype, no numbers): the type names of JAX's, TensorFlow's
#: and Keras's
_SYMBOLIC = ("ShapeDtypeStruct", "TensorSpec", "KerasTensor")


_FRAMEWORKS = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "tensorflow": "tensorflow",
               "keras": "tensorflow", "tf_keras": "tensorflow"}


def _framework(obj: Any) -> str:
    """ "torch", "jax", "tensorflow" (Keras too) or "numpy", by the module of ``obj``'s type."""
    return _FRAMEWORKS.get((type(obj).__module__ or "").split(".", 1)[0], "numpy")


def _as_code(name: str) -> str:
    """An argument's name as it would be written in code (``x``, ``inputs['h']``)."""
    return name.split(" (", 1)[0]


def _what(obj: Any) -> str:
    """``obj`` in a message: its type and, where it has one, its shape."""
    shape = getattr(obj, "shape", None)
    try:
        shown = f" of shape {tuple(int(d) for d in shape)}" if shape is not None else ""
    except (TypeError, ValueError):  # symbolic dimensions
        shown = f" of shape {shape}"
    return f"a {type(obj).__module__.split('.', 1)[0]}.{type(obj).__name__}{shown}"


def _low_precision(dtype: Any) -> str | None:
    """The name of a half-precision (or narrower) float type without a numpy dtype of its own
    (bfloat16, the float8s...), or None; float16 is numpy's and taken (computed in float32)."""
    found = _LOW_PRECISION.search(str(dtype)) if dtype is not None else None
    return found.group(1) if found else None


def _refuse_low_precision(obj: Any, dtype_name: str, name: str) -> None:
    cast = _CAST_HINT[_framework(obj)].format(n=_as_code(name))
    raise InputTypeError(
        f"`{name}` is {dtype_name} ({_what(obj)}); batchjac computes in float32 or float64 "
        f"and takes float16 and bfloat16 inputs (computed in float32) but not {dtype_name} "
        f"ones. Widen it first, which is exact: {cast}. A model of any precision is differentiated in "
        f"float32 (its half-precision weights and layers widened).")


def _not_dense(obj: Any) -> tuple[str, str] | None:
    """(what it is, how to make a dense array of it) when ``obj`` is a sparse or ragged array
    of a known kind: torch's sparse layouts and nested tensors, TensorFlow's SparseTensor and
    RaggedTensor, JAX's BCOO and BCSR, SciPy's and pydata's sparse arrays; None otherwise."""
    layout = getattr(obj, "layout", None)
    padded = ", if rows padded with zeros are what the model takes"
    if getattr(obj, "is_sparse", False) is True or (
            layout is not None and "sparse" in str(layout)):  # COO, CSR, CSC, BSR, BSC
        return f"a sparse tensor of layout {layout}", "{n}.to_dense()"
    if getattr(obj, "is_nested", False) is True:
        return "a nested (ragged) tensor", "torch.nested.to_padded_tensor({n}, 0.0)" + padded
    if all(hasattr(obj, a) for a in ("dense_shape", "indices", "values")):
        return "a sparse tensor", "tf.sparse.to_dense({n})"
    if hasattr(obj, "row_splits") and callable(getattr(obj, "to_tensor", None)):
        return "a ragged tensor", "{n}.to_tensor()" + padded
    if hasattr(obj, "nse") and callable(getattr(obj, "todense", None)):
        return "a sparse array", "{n}.todense()"
    if hasattr(obj, "nnz") and callable(getattr(obj, "toarray", None)):
        return "a sparse matrix", "{n}.toarray()"
    if hasattr(obj, "nnz") and callable(getattr(obj, "todense", None)):
        return "a sparse array", "{n}.todense()"
    return None


def _variable_value(obj: Any) -> Any:
    """The value of a TensorFlow or Keras variable as the framework's tensor (what
    tf.convert_to_tensor gives); None for anything else. A variable is not a tensor: its
    shape and dtype are not numpy's, and slicing it is not TensorFlow's everywhere."""
    if _framework(obj) != "tensorflow" or not callable(getattr(obj, "assign", None)):
        return None
    read = getattr(obj, "read_value", None)
    if callable(read):  # tf.Variable
        return read()
    value = getattr(obj, "value", None)  # keras.Variable: a property, the backend's tensor
    return value if value is not None and not callable(value) and hasattr(value, "shape") else None


def examine(obj: Any, name: str) -> Any:
    """The first look at one input, before anything converts it: what batchjac cannot take
    is refused here, by name, with what was received and the fix (a sparse, ragged,
    quantized or meta-device tensor, a symbolic value, an array of float8), and a
    TensorFlow/Keras variable becomes its value. Everything else is returned as it is.
    Recognised without importing a framework (attributes and dtype names)."""
    if isinstance(obj, np.ndarray) and obj.dtype.kind != "V":
        return obj  # the common case, at once
    if isinstance(obj, (str, os.PathLike, list, tuple)) or _is_table(obj) or is_lazy(obj):
        return obj  # (files, lists and tables are read by to_numpy and checked there)
    if getattr(obj, "is_meta", False) is True:
        raise InputTypeError(
            f"`{name}` is a tensor on the 'meta' device ({_what(obj)}): it has a shape and a "
            f"dtype but no values, and a Jacobian is taken at values. Give a tensor that holds "
            f"the inputs, on the CPU or a GPU (a module built on 'meta' gets its weights with "
            f"module.to_empty(device='cpu') and load_state_dict).")
    if type(obj).__name__ in _SYMBOLIC:
        raise InputTypeError(
            f"`{name}` is {_what(obj)}: a symbolic value, with a shape and a dtype but no "
            f"numbers, and a Jacobian is taken at numbers. Give the input array itself.")
    found = _not_dense(obj)
    if found is not None:
        kind, fix = found
        raise InputTypeError(
            f"`{name}` is {kind} ({_what(obj)}); batchjac takes dense arrays, one row per "
            f"instance. Make it dense first: {fix.format(n=_as_code(name))}.")
    if getattr(obj, "is_quantized", False) is True:
        raise InputTypeError(
            f"`{name}` is a quantized tensor ({_what(obj)}, {getattr(obj, 'dtype', '?')}); "
            f"batchjac differentiates real numbers. Give {_as_code(name)}.dequantize() instead.")
    value = _variable_value(obj)
    if value is not None:
        obj = value
    low = _low_precision(getattr(obj, "dtype", None))
    if low == "bfloat16":  # widened where it lives (a tensor stays a tensor), which is exact
        from ._arrays import ops_of

        return ops_of(obj).cast(obj, np.dtype(np.float32))
    if low is not None:
        _refuse_low_precision(obj, low, name)
    return obj


def to_numpy(obj: Any, name: str) -> np.ndarray:
    """Convert numpy arrays, nested lists, tables (pandas DataFrames, column names kept) and
    framework tensors to numpy, without importing any framework (tensors and tables are
    recognised by their methods). What cannot be an input is refused first (:func:`examine`)."""
    obj = examine(obj, name)
    if isinstance(obj, np.ndarray):
        arr = obj
    elif _is_table(obj):
        arr = _table_to_numpy(obj, name)
    elif hasattr(obj, "detach") and hasattr(obj, "cpu"):  # torch.Tensor, on any device
        arr = obj.detach().cpu().numpy()
    elif hasattr(obj, "numpy") and callable(obj.numpy) and not isinstance(obj, (list, tuple)):
        arr = np.asarray(obj.numpy())  # tf.Tensor
    else:
        try:
            arr = np.asarray(obj)
        except ValueError as e:  # ragged nested lists
            raise InputError(
                f"`{name}` could not be read as an array (ragged rows? {e}). Give a numpy array, a framework "
                f"tensor or nested lists with one equal-length row per instance."
            ) from None
    if _low_precision(arr.dtype) == "bfloat16":  # nested lists of ml_dtypes' scalars: exact
        arr = arr.astype(np.float32)
    _check_array(arr.dtype, arr.ndim, name)
    return arr


def _check_array(dtype: np.dtype, ndim: int, name: str) -> None:
    low = _low_precision(dtype)
    if low is not None:  # nested lists of ml_dtypes' float8 scalars, say
        raise InputTypeError(
            f"`{name}` holds {low} numbers; batchjac computes in float32 or float64 and takes "
            f"float16 and bfloat16 inputs but not {low} ones. Cast them first: "
            f"np.asarray({_as_code(name)}, dtype=np.float32).")
    if dtype.kind not in "fiub":
        hint = " (ragged rows?)" if dtype == np.dtype(object) else ""
        raise InputTypeError(
            f"`{name}` must hold real numbers; got dtype {dtype}{hint}. Convert it with "
            f"np.asarray({name}, dtype=np.float32) after removing non-numeric columns."
        )
    if ndim == 0:
        raise InputError(
            f"`{name}` is a scalar; it needs a leading axis with one row per instance, "
            f"shape (N, ...). For one instance use x[None]."
        )


def as_native(obj: Any, name: str, xp: ArrayOps, device: Any) -> Any:
    """An input as an array of kind ``xp`` (see :mod:`batchjac._arrays`): one of that kind as
    it is, on its device; anything else read as numpy (:func:`as_input`, a file whole) and
    converted once, onto ``device``."""
    obj = examine(obj, name)
    if xp.is_native(obj):
        _check_array(xp.dtype_of(obj), len(obj.shape), name)
        return obj
    arr = as_input(obj, name)
    if is_lazy(arr):
        arr = np.asarray(arr[0:arr.shape[0]])
    return xp.from_numpy(arr, device)


def is_lazy(obj: Any) -> bool:
    """Whether ``obj`` is an array read from disk by rows: a batchjac file reader, an h5py
    dataset, a Zarr array or an ``np.memmap`` (recognised without importing h5py or zarr)."""
    if isinstance(obj, np.memmap) or getattr(type(obj), "__batchjac_reader__", False):
        return True
    top = (type(obj).__module__ or "").split(".", 1)[0]
    return top in ("h5py", "zarr") and hasattr(obj, "shape") and hasattr(obj, "dtype")


def as_input(obj: Any, name: str) -> Any:
    """An input as numpy, or as a lazy array (see :func:`is_lazy`) left on disk. A path
    (``str`` or ``os.PathLike``) is opened with :func:`batchjac._io.open_input`."""
    if isinstance(obj, (str, os.PathLike)):
        from ._io import open_input

        obj = open_input(obj)
    if not is_lazy(obj):
        return to_numpy(obj, name)
    dt = np.dtype(obj.dtype)
    if dt.kind not in "fiub":
        raise InputTypeError(f"`{name}` must hold real numbers; got dtype {dt}.")
    if len(obj.shape) == 0:
        raise InputError(f"`{name}` is a scalar; it needs a leading axis with one row per instance.")
    return obj


def _label(obj: Any, name: str) -> str:
    """The name used in messages: the file it comes from, when it comes from one."""
    source = getattr(obj, "source", None) if is_lazy(obj) else None
    if source is None and isinstance(obj, (str, os.PathLike)):
        source = os.fspath(obj)
    return f"{name} ({source})" if source else name


def resolve_dtype(dtype: DTypeLike, arrays: Sequence[Any]) -> np.dtype:
    """The compute dtype: ``dtype``, else float64 when an array (or a dtype in ``arrays``) is
    float64, else float32."""
    if dtype is None:
        wide = any(getattr(a, "dtype", a) == np.float64 for a in arrays)
        return np.dtype(np.float64 if wide else np.float32)
    try:
        dt = np.dtype(getattr(dtype, "name", dtype) if not isinstance(dtype, (type, np.dtype)) else dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in _VALID_DTYPES:
        raise InputError(
            f"`dtype` must be one of {_VALID_DTYPES} (or None: float32, or float64 when the "
            f"inputs are float64); got {dtype!r}."
        )
    return dt


def _columns(wrt: Any, width: int, name: str) -> tuple[int, ...] | None:
    """Normalise a column selection (ints, slice, bool mask) over ``width`` columns."""
    if isinstance(wrt, slice):
        cols = list(range(width))[wrt]
        if not cols:
            raise InputError(
                f"`wrt={wrt!r}` selects no column of `{name}`, which has {width} feature "
                f"columns. Give a non-empty slice such as slice(0, {min(width, 5)})."
            )
        return _whole_or(tuple(cols), width)
    if isinstance(wrt, (bool, np.bool_, str, bytes)):
        raise InputTypeError(
            f"`wrt` must be column indices, a slice or a boolean mask for `{name}`; got {wrt!r}."
        )
    arr = np.asarray(wrt)
    if arr.dtype == bool:
        if arr.shape != (width,):
            raise InputError(
                f"`wrt` as a boolean mask must have one entry per column of `{name}` "
                f"({width}); got shape {arr.shape}."
            )
        arr = np.flatnonzero(arr)
    if arr.ndim == 0:
        arr = arr[None]
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InputTypeError(
            f"`wrt` must be integer column indices of `{name}` (e.g. [0, 1, 4]), a slice or "
            f"a boolean mask; got {wrt!r}."
        )
    if arr.size == 0:
        raise InputError(f"`wrt` is empty: name at least one unknown column of `{name}`.")
    bad = arr[(arr < -width) | (arr >= width)]
    if bad.size:
        raise InputError(
            f"`wrt` column {int(bad[0])} is out of range: `{name}` has {width} feature columns "
            f"(valid indices 0..{width - 1}, or negative from the end)."
        )
    picked = tuple(int(c) % width for c in arr)
    if len(set(picked)) != len(picked):
        dup = sorted({c for c in picked if picked.count(c) > 1})
        raise InputError(f"`wrt` names column(s) {dup} more than once; list each unknown once.")
    return _whole_or(picked, width)


def _whole_or(cols: tuple[int, ...], width: int) -> tuple[int, ...] | None:
    return None if cols == tuple(range(width)) else cols


def _perm(cols: tuple[int, ...], width: int) -> tuple[int, ...] | None:
    if cols == tuple(range(len(cols))):
        return None
    known = [c for c in range(width) if c not in set(cols)]
    pos = {c: i for i, c in enumerate(cols)}
    pos.update({c: len(cols) + i for i, c in enumerate(known)})
    return tuple(pos[c] for c in range(width))


def _split_inputs(inputs: tuple[Any, ...]) -> tuple[InputKind, list[Any], tuple[str, ...] | None]:
    if not inputs:
        raise InputError(
            "jacobian() needs the model's inputs: jacobian(model, x), jacobian(model, unknown, "
            "known), or jacobian(model, {'x': X, 'h': H}, wrt='x')."
        )
    if len(inputs) == 2:
        return "concat", list(inputs), None
    if len(inputs) > 2:
        raise InputError(
            f"jacobian() got {len(inputs)} input arrays; it takes one (x), two (unknown, known) "
            f"or one tuple/dict for a multi-input model, e.g. jacobian(model, (X, H), wrt=0)."
        )
    x = inputs[0]
    if isinstance(x, Mapping):
        if not x:
            raise InputError("`inputs` is an empty dict; give one array per model input.")
        keys = tuple(x.keys())
        for key in keys:
            if not isinstance(key, str):
                raise InputTypeError(f"dict inputs need string keys; got key {key!r}.")
        return "dict", [x[k] for k in keys], keys
    if isinstance(x, tuple) or (
        isinstance(x, list) and x and all(hasattr(e, "shape") and np.ndim(e) >= 1 for e in x)
    ):
        if len(x) == 0:
            raise InputError("`inputs` is an empty tuple; give one array per model input.")
        return "tuple", list(x), None
    return "single", [x], None


def normalize(
    inputs: tuple[Any, ...],
    *,
    wrt: Any,
    dtype: DTypeLike,
    nan_policy: NanPolicy,
    xp: ArrayOps = NUMPY,
    device: Any = None,
) -> BatchSpec:
    """Validate the call and return the batch spec. Raises :class:`InputError` subclasses.

    With ``xp`` a framework's array kind, the spec holds arrays of that kind (inputs of
    another kind converted once, onto ``device``), checked where they live."""
    if nan_policy not in ("raise", "propagate"):
        raise InputError(f"`nan_policy` must be 'raise' or 'propagate'; got {nan_policy!r}.")
    kind, raw, keys = _split_inputs(inputs)
    names = _input_names(kind, raw, keys)
    if xp.kind == "numpy":
        arrays = [as_input(a, n) for a, n in zip(raw, names)]
    else:
        arrays = [as_native(a, n, xp, device) for a, n in zip(raw, names)]
    lazy = tuple(is_lazy(a) for a in arrays)
    n = _row_count(arrays, names)
    if kind == "concat":
        layout, unknown_shape = _concat_layout(wrt, arrays)
    else:
        layout, unknown_shape = _selected_layout(kind, wrt, arrays, names, keys)
    if xp.dtype_of(arrays[0 if kind == "concat" else layout.wrt_index]).kind == "b":
        raise InputTypeError("The unknown input is boolean; unknowns must be real numbers.")

    # nested Python lists carry no dtype intent (their floats are doubles): only arrays and
    # tensors that are float64 make float64 the default
    # (nor does text: CSV numbers are read as float64 whatever precision they were written in)
    dt = resolve_dtype(dtype, [xp.dtype_of(a) for a, r in zip(arrays, raw)
                               if not isinstance(r, (list, tuple))
                               and getattr(a, "carries_dtype", True)])
    if nan_policy == "raise":
        _check_finite([a for a, lz in zip(arrays, lazy) if not lz],
                      tuple(nm for nm, lz in zip(names, lazy) if not lz), xp)
    return BatchSpec(arrays=arrays, layout=layout, dtype=dt, n=n,
                     unknown_shape=tuple(int(d) for d in unknown_shape), names=names,
                     finite_check=tuple(lz and nan_policy == "raise" for lz in lazy), xp=xp)


def _input_names(kind: InputKind, raw: list[Any], keys: tuple[str, ...] | None
                 ) -> tuple[str, ...]:
    """The name of each input in messages: the argument or the input's place, and its file."""
    if kind == "concat":
        names: tuple[str, ...] = ("unknown", "known")
    elif kind == "single":
        names = ("x",)
    elif kind == "dict":
        assert keys is not None
        names = tuple(f"inputs[{k!r}]" for k in keys)
    else:
        names = tuple(f"inputs[{i}]" for i in range(len(raw)))
    return tuple(_label(a, n) for a, n in zip(raw, names))


def _row_count(arrays: list[Any], names: tuple[str, ...]) -> int:
    """The number of instances: the rows of every input, which must agree."""
    n = int(arrays[0].shape[0])
    for a, name in zip(arrays[1:], names[1:]):
        if a.shape[0] != n:
            raise InputError(
                f"`{name}` has {a.shape[0]} rows but `{names[0]}` has {n}; they must have one "
                f"row per instance."
            )
    return n


def _concat_layout(wrt: Any, arrays: list[Any]) -> tuple[Layout, tuple[int, ...]]:
    """The (unknown, known) call form: the model takes ``concat([unknown, known], -1)``."""
    if wrt is not None:
        raise InputError(
            "`wrt` cannot be combined with the (unknown, known) call form: there every column "
            "of `unknown` is unknown. Either drop `wrt`, or pass one array with "
            "jacobian(model, x, wrt=[...])."
        )
    u, h = arrays
    if u.ndim < 2 or h.ndim < 2 or u.shape[1:-1] != h.shape[1:-1]:
        raise InputError(
            f"`unknown` {u.shape} and `known` {h.shape} must both be (N, ..., features) with "
            f"equal middle axes, since the model takes concat([unknown, known], axis=-1)."
        )
    return Layout(kind="concat", n_inputs=1), u.shape[1:]


def _selected_layout(kind: InputKind, wrt: Any, arrays: list[Any], names: tuple[str, ...],
                     keys: tuple[str, ...] | None) -> tuple[Layout, tuple[int, ...]]:
    """The model's own inputs, one of them (or some of its columns) unknown, named by ``wrt``."""
    wrt_index, cols_sel = _resolve_wrt(kind, wrt, arrays, names, keys)
    target = arrays[wrt_index]
    cols = None
    if cols_sel is not None:
        if target.ndim < 2:
            raise InputError(
                f"`wrt` selects columns, but `{names[wrt_index]}` has shape {target.shape}, "
                f"with no feature axis. Give it shape (N, features)."
            )
        cols_sel = _named_columns(cols_sel, target, names[wrt_index])
        cols = _columns(cols_sel, target.shape[-1], names[wrt_index])
    if cols is None:
        layout = Layout(kind=kind, n_inputs=len(arrays), wrt_index=wrt_index, keys=keys)
        return layout, target.shape[1:]
    layout = Layout(
        kind=kind, n_inputs=len(arrays), wrt_index=wrt_index, keys=keys,
        columns=cols, perm=_perm(cols, target.shape[-1]),
    )
    return layout, (*target.shape[1:-1], len(cols))


def _named_columns(sel: Any, target: Any, name: str) -> Any:
    """Column names in ``wrt`` → indices, for inputs that have column names (CSV, Parquet...)."""
    names = getattr(target, "columns", None)
    if isinstance(sel, str):
        if names is None:
            return sel  # _columns explains that columns are selected by index
        sel = [sel]
    elif not isinstance(sel, (list, tuple)) or not any(isinstance(c, str) for c in sel):
        return sel
    from ._io import column_indices

    return column_indices(names, list(sel), name)


def _resolve_wrt(kind: str, wrt: Any, arrays: list[np.ndarray], names: tuple[str, ...],
                 keys: tuple[str, ...] | None) -> tuple[int, Any]:
    """Return (index of the input holding the unknowns, column selection or None)."""
    if kind == "single":
        return 0, wrt
    if wrt is None:
        which = f"one of {list(keys)}" if keys else f"an index 0..{len(arrays) - 1}"
        raise InputError(
            f"The model has {len(arrays)} inputs; say which is unknown with `wrt` ({which}), "
            f"or (input, columns) for some of its columns, e.g. wrt=({(keys or (0,))[0]!r}, [0, 1])."
        )
    sel = None
    if isinstance(wrt, tuple) and len(wrt) == 2 and not isinstance(wrt[0], (tuple, list)):
        wrt, sel = wrt
    if kind == "dict":
        assert keys is not None
        if wrt not in keys:
            raise InputError(f"`wrt={wrt!r}` names no input; the inputs are {list(keys)}.")
        return keys.index(wrt), sel
    if isinstance(wrt, (bool, np.bool_)) or not isinstance(wrt, (int, np.integer)):
        raise InputTypeError(
            f"With a tuple of inputs, `wrt` is the index of the unknown input (or (index, "
            f"columns)); got {wrt!r}."
        )
    if not -len(arrays) <= int(wrt) < len(arrays):
        raise InputError(
            f"`wrt={wrt}` is out of range: there are {len(arrays)} inputs (0..{len(arrays) - 1})."
        )
    return int(wrt) % len(arrays), sel


def _check_finite(arrays: list[np.ndarray], names: tuple[str, ...], xp: ArrayOps = NUMPY) -> None:
    for a, name in zip(arrays, names):
        if xp.kind == "numpy":
            check_finite_rows(a, name, 0, whole=True)
        elif not xp.all_finite(a):  # checked on the device; the host copy only to say where
            check_finite_rows(xp.to_numpy(a), name, 0, whole=True)
