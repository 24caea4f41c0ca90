"""Validation of call forms and bad input: all of it happens before any framework is used,
so these tests use a model that must never be called."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac._spec import Layout, assemble
from batchjac._validate import normalize

from .helpers import assert_jac_close


def never_called(*args: Any, **kw: Any) -> Any:
    raise AssertionError("validation should have failed before the model was called")


def jac(*inputs: Any, **kw: Any) -> Any:
    return batchjac.jacobian(never_called, *inputs, backend="tensorflow", **kw)


@pytest.fixture
def x() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(10, 8)).astype(np.float32)


def test_row_count_mismatch(x: np.ndarray) -> None:
    with pytest.raises(batchjac.InputError, match="`known` has 9 rows but `unknown` has 10"):
        jac(x[:, :5], x[:9, 5:])
    with pytest.raises(batchjac.InputError, match=r"`inputs\['h'\]` has 3 rows but `inputs\['x'\]` has 10"):
        jac({"x": x, "h": x[:3]}, wrt="x")


def test_scalar_and_rank(x: np.ndarray) -> None:
    with pytest.raises(batchjac.InputError, match="scalar; it needs a leading axis"):
        jac(np.float32(3.0))
    with pytest.raises(batchjac.InputError, match=r"must both be \(N, ..., features\)"):
        jac(x[:, 0], x[:, 1:])
    with pytest.raises(batchjac.InputError, match="no feature axis"):
        jac(x[:, 0], wrt=[0])


def test_non_numeric_dtype() -> None:
    with pytest.raises(batchjac.InputTypeError, match="must hold real numbers; got dtype <U"):
        jac(np.array([["a", "b"], ["c", "d"]]))
    with pytest.raises(batchjac.InputError, match="ragged"):
        jac([[1.0, 2.0], [3.0]])
    with pytest.raises(batchjac.InputTypeError, match="unknowns must be real numbers"):
        jac(np.ones((3, 2), bool))


@pytest.mark.parametrize(
    ("wrt", "message"),
    [
        ([0, 8], "column 8 is out of range: `x` has 8 feature columns"),
        ([-9], "column -9 is out of range"),
        ([1, 1, 2], r"names column\(s\) \[1\] more than once"),
        ([], "`wrt` is empty"),
        (slice(8, 10), "selects no column"),
        ("h", "must be column indices"),
        (True, "must be column indices"),
        ([0.5], "must be integer column indices"),
        (np.array([True, False]), "one entry per column"),
    ],
)
def test_bad_wrt_columns(x: np.ndarray, wrt: Any, message: str) -> None:
    with pytest.raises(batchjac.InputError, match=message):
        jac(x, wrt=wrt)


def test_bad_wrt_for_multi_input(x: np.ndarray) -> None:
    with pytest.raises(batchjac.InputError, match=r"say which is unknown with `wrt` \(one of \['x', 'h'\]\)"):
        jac({"x": x, "h": x})
    with pytest.raises(batchjac.InputError, match=r"`wrt='z'` names no input; the inputs are \['x', 'h'\]"):
        jac({"x": x, "h": x}, wrt="z")
    with pytest.raises(batchjac.InputError, match="`wrt=2` is out of range: there are 2 inputs"):
        jac((x, x), wrt=2)
    with pytest.raises(batchjac.InputTypeError, match="index of the unknown input"):
        jac((x, x), wrt="x")
    with pytest.raises(batchjac.InputError, match="cannot be combined with the \\(unknown, known\\)"):
        jac(x[:, :5], x[:, 5:], wrt=[0])
    with pytest.raises(batchjac.InputError, match="got 3 input arrays"):
        jac(x, x, x)
    with pytest.raises(batchjac.InputError, match="needs the model's inputs"):
        batchjac.jacobian(never_called)


def test_nan_reports_first_bad_row(x: np.ndarray) -> None:
    x[4, 2] = np.inf
    x[6, 0] = np.nan
    msg = r"`x` has a non-finite value \(inf\) in row 4 at \(2,\); 2 row"
    with pytest.raises(batchjac.InputError, match=msg):
        jac(x)
    with pytest.raises(batchjac.InputError, match="nan_policy"):
        jac(x, nan_policy="omit")


def test_bad_options(x: np.ndarray) -> None:
    with pytest.raises(batchjac.InputError, match=r"`dtype` must be one of \('float32', 'float64'\)"):
        jac(x, dtype="float16")
    with pytest.raises(batchjac.InputError, match="`backend` must be one of"):
        batchjac.jacobian(never_called, x, backend="mxnet")  # type: ignore[arg-type]


def test_normalize_layouts(x: np.ndarray) -> None:
    spec = normalize((x,), wrt=[6, 0, 3], dtype=None, nan_policy="raise")
    assert spec.layout == Layout(kind="single", n_inputs=1, columns=(6, 0, 3), perm=(1, 3, 4, 2, 5, 6, 0, 7))
    u, ctx = spec.chunk(2, 5)
    np.testing.assert_array_equal(u, x[2:5, [6, 0, 3]])
    np.testing.assert_array_equal(ctx[0], x[2:5, [1, 2, 4, 5, 7]])
    # assemble() with numpy ops rebuilds the original rows exactly
    (full,) = assemble(spec.layout, u, ctx, lambda xs: np.concatenate(xs, -1), lambda a, i: a[..., list(i)])
    np.testing.assert_array_equal(full, x[2:5])
    # leading columns need no gather; all columns are the whole input
    assert normalize((x,), wrt=slice(0, 3), dtype=None, nan_policy="raise").layout.perm is None
    assert normalize((x,), wrt=list(range(8)), dtype=None, nan_policy="raise").layout.columns is None


def test_dtype_resolution(x: np.ndarray) -> None:
    assert normalize((x,), wrt=None, dtype=None, nan_policy="raise").dtype == np.float32
    assert normalize((x.astype(np.float64),), wrt=None, dtype=None, nan_policy="raise").dtype == np.float64
    assert normalize((x.tolist(),), wrt=None, dtype=None, nan_policy="raise").dtype == np.float32
    assert normalize((x,), wrt=None, dtype="float64", nan_policy="raise").dtype == np.float64
    ints = np.arange(20).reshape(10, 2)
    spec = normalize(({"x": x, "ids": ints},), wrt="x", dtype=None, nan_policy="raise")
    _, ctx = spec.chunk(0, 10)
    assert ctx[0].dtype == ints.dtype  # integer known inputs are passed through unchanged


def test_list_of_arrays_is_multi_input(x: np.ndarray) -> None:
    spec = normalize(([x, x[:, :2]],), wrt=1, dtype=None, nan_policy="raise")
    assert spec.layout.kind == "tuple"
    assert spec.unknown_shape == (2,)


def test_repeated_calls_take_the_fast_path_with_fresh_data_and_checks() -> None:
    pytest.importorskip("tensorflow")
    from batchjac._tune import fastpath as _fastpath
    from batchjac.examples import mlp_jacobian, mlp_weights, seed_model

    model = seed_model("tensorflow")
    rng = np.random.default_rng(40)
    for _ in range(3):  # same shapes, new values each time: never a stale result
        x = rng.normal(size=(64, 8)).astype(np.float32)
        jac = batchjac.jacobian(model, x[:, :5], x[:, 5:])
        ref = mlp_jacobian(mlp_weights((8, 64, 64, 4)), x)[:, :, :5]
        assert_jac_close(jac, ref)
    assert any(e.model() is model for e in _fastpath._entries.values() if e.model is not None)
    x[5, 6] = np.nan
    with pytest.raises(batchjac.InputError, match=r"`known` has a non-finite value \(nan\) in row 5"):
        batchjac.jacobian(model, x[:, :5], x[:, 5:])


# -- tables (pandas DataFrames), read without a model ------------------------------------------------
def test_dataframe_becomes_its_numbers_with_its_column_names() -> None:
    from batchjac._validate import is_lazy, normalize, to_numpy

    pd = pytest.importorskip("pandas")
    values = np.random.default_rng(51).normal(size=(7, 4))
    frame = pd.DataFrame(values, columns=["a", "b", 3, "d"])
    frame["n"] = np.arange(7, dtype=np.int32)
    frame["flag"] = np.arange(7) % 2 == 0
    arr = to_numpy(frame, "x")
    np.testing.assert_array_equal(arr, np.column_stack([values, np.arange(7), np.arange(7) % 2 == 0]))
    assert arr.columns == ("a", "b", "3", "d", "n", "flag")  # type: ignore[attr-defined]
    assert not is_lazy(frame)
    assert not is_lazy(values)
    # the unknowns named by column, in the order given; the rest known
    spec = normalize((frame,), wrt=["d", "a"], dtype=None, nan_policy="raise")
    u, _ = spec.chunk(0, 7)
    np.testing.assert_array_equal(u, values[:, [3, 0]])
    spec = normalize((frame,), wrt="b", dtype=None, nan_policy="raise")
    np.testing.assert_array_equal(spec.chunk(2, 5)[0], values[2:5, [1]])
    # a slice of the array is a plain one: no names
    assert getattr(arr[1:], "columns", None) is None


def test_dataframe_with_missing_values_is_float64_with_nan() -> None:
    from batchjac._validate import normalize, to_numpy

    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"a": pd.array([1, None, 3], dtype="Int64"), "b": [0.5, 1.5, 2.5]})
    arr = to_numpy(frame, "x")
    assert arr.dtype == np.float64
    np.testing.assert_array_equal(arr, [[1.0, 0.5], [np.nan, 1.5], [3.0, 2.5]])
    assert arr.columns == ("a", "b")  # type: ignore[attr-defined]
    with pytest.raises(batchjac.InputError, match=r"`x` has a non-finite value \(nan\) in row 1"):
        normalize((frame,), wrt=["b"], dtype=None, nan_policy="raise")


def test_dataframe_text_columns_are_named_with_the_fix() -> None:
    from batchjac._validate import to_numpy

    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({f"c{i}": ["t"] * 2 for i in range(12)} | {"ok": [1.0, 2.0]})
    shown = [f"c{i}" for i in range(10)] + ["..."]
    with pytest.raises(batchjac.InputTypeError) as got:
        to_numpy(frame, "table")
    assert str(got.value) == (
        f"`table` is a table whose column(s) {shown} are not numeric; batchjac reads numbers only. "
        f"Drop or encode them first, e.g. table.drop(columns={['c0', 'c1', 'c2']!r}) or "
        f"pandas.get_dummies(table).")
    few = pd.DataFrame({"name": ["a", "b"], "v": [1.0, 2.0]})
    with pytest.raises(batchjac.InputTypeError, match=r"column\(s\) \['name'\] are not numeric.*"
                       r"x.drop\(columns=\['name'\]\)"):
        to_numpy(few, "x")


# -- the call forms' errors by their whole messages; inputs read from disk by rows ------------------
def test_call_form_errors_say_what_was_given_and_the_forms_that_work(x: np.ndarray) -> None:
    from batchjac._validate import normalize

    def spec(*inputs: Any, wrt: Any = None) -> Any:
        return normalize(inputs, wrt=wrt, dtype=None, nan_policy="raise")

    with pytest.raises(batchjac.InputError) as got:
        spec()
    assert str(got.value) == ("jacobian() needs the model's inputs: jacobian(model, x), jacobian("
                              "model, unknown, known), or jacobian(model, {'x': X, 'h': H}, wrt='x').")
    with pytest.raises(batchjac.InputError, match=r"^jacobian\(\) got 3 input arrays; it takes one"):
        spec(x, x, x)
    with pytest.raises(batchjac.InputError) as got:
        spec({})
    assert str(got.value) == "`inputs` is an empty dict; give one array per model input."
    with pytest.raises(batchjac.InputError) as got:
        spec(())
    assert str(got.value) == "`inputs` is an empty tuple; give one array per model input."
    with pytest.raises(batchjac.InputTypeError) as got:
        spec({"x": x, 3: x})
    assert str(got.value) == "dict inputs need string keys; got key 3."
    with pytest.raises(batchjac.InputError) as got:
        spec(x[:, :5], x[:, 5:], wrt=[0])
    assert str(got.value) == (
        "`wrt` cannot be combined with the (unknown, known) call form: there every column of "
        "`unknown` is unknown. Either drop `wrt`, or pass one array with jacobian(model, x, wrt=[...]).")
    # a list of arrays is a multi-input model; a list of rows is one array
    assert spec([x[:, :5], x[:, 5:]], wrt=1).layout.kind == "tuple"
    assert spec(x.tolist()).layout.kind == "single"


def test_unknown_and_known_need_equal_middle_axes() -> None:
    from batchjac._validate import normalize

    rng = np.random.default_rng(52)
    u, h = rng.normal(size=(4, 2, 3)), rng.normal(size=(4, 2, 5))
    spec = normalize((u, h), wrt=None, dtype=None, nan_policy="raise")
    assert spec.unknown_shape == (2, 3)
    assert (spec.layout.kind, spec.layout.n_inputs) == ("concat", 1)
    for bad_h in (rng.normal(size=(4, 3, 5)), rng.normal(size=(4, 5)), rng.normal(size=(4, 2, 1, 5))):
        with pytest.raises(batchjac.InputError) as got:
            normalize((u, bad_h), wrt=None, dtype=None, nan_policy="raise")
        assert str(got.value) == (
            f"`unknown` {u.shape} and `known` {bad_h.shape} must both be (N, ..., features) with "
            f"equal middle axes, since the model takes concat([unknown, known], axis=-1).")
    with pytest.raises(batchjac.InputError, match=r"^`unknown` \(4, 3\) and `known` \(4, 2, 5\)"):
        normalize((u[:, 0], h), wrt=None, dtype=None, nan_policy="raise")
    with pytest.raises(batchjac.InputError, match=r"^`unknown` \(4,\) and `known` \(4, 2\)"):
        normalize((u[:, 0, 0], h[:, 0, :2]), wrt=None, dtype=None, nan_policy="raise")


def test_arrays_on_disk_are_lazy_and_named_by_their_file(tmp_path: Any) -> None:
    from batchjac._validate import is_lazy, normalize

    h5py = pytest.importorskip("h5py")
    zarr = pytest.importorskip("zarr")
    values = np.random.default_rng(53).normal(size=(6, 3))
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["d"] = values
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert is_lazy(f["d"])
        assert not is_lazy(f)  # a file holds datasets; it has no shape
    z = zarr.open_array(str(tmp_path / "a.zarr"), mode="w", shape=values.shape, dtype="f8")
    z[:] = values
    assert is_lazy(z)
    np.save(tmp_path / "a.npy", values)
    assert is_lazy(np.load(tmp_path / "a.npy", mmap_mode="r"))
    assert not is_lazy(values)
    assert not is_lazy(values.tolist())

    class Lookalike:  # shape and dtype, but from neither h5py nor zarr
        shape, dtype = (6, 3), np.dtype("f8")

    assert not is_lazy(Lookalike())
    # a file's rows read as they are needed, its name in every message
    bad = values.copy()
    bad[4, 1] = np.nan
    np.save(tmp_path / "bad.npy", bad)
    path = str(tmp_path / "bad.npy")
    spec = normalize((path,), wrt=None, dtype=None, nan_policy="propagate")
    assert spec.names == (f"x ({path})",)
    np.testing.assert_array_equal(spec.chunk(0, 3)[0], bad[:3])
    np.save(tmp_path / "five.npy", values[:5])
    five = str(tmp_path / "five.npy")
    with pytest.raises(batchjac.InputError) as got:
        normalize((np.zeros((6, 2)), five), wrt=None, dtype=None, nan_policy="raise")
    assert str(got.value) == (f"`known ({five})` has 5 rows but `unknown` has 6; they must have one "
                              f"row per instance.")
    assert normalize((values,), wrt=None, dtype=None, nan_policy="raise").names == ("x",)


def test_tensors_are_read_by_their_methods_and_bad_dtypes_are_named() -> None:
    from batchjac._validate import to_numpy

    torch = pytest.importorskip("torch")
    values = np.random.default_rng(54).normal(size=(5, 3))
    tracked = torch.tensor(values, requires_grad=True)  # .numpy() needs the detach first
    np.testing.assert_array_equal(to_numpy(tracked, "x"), values)

    class TensorLike:  # what TensorFlow's eager tensors offer: .numpy(), no .detach()
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def numpy(self) -> np.ndarray:
            return self.a

    np.testing.assert_array_equal(to_numpy(TensorLike(values), "x"), values)
    with pytest.raises(batchjac.InputTypeError) as got:
        to_numpy(np.array([["a", "b"]]), "x")
    assert str(got.value) == ("`x` must hold real numbers; got dtype <U1. Convert it with "
                              "np.asarray(x, dtype=np.float32) after removing non-numeric columns.")
    with pytest.raises(batchjac.InputTypeError) as got:
        to_numpy(np.array([[1.0], None], dtype=object), "h")
    assert str(got.value).startswith("`h` must hold real numbers; got dtype object (ragged rows?). ")
    assert to_numpy(np.array([[True, False]]), "x").dtype == np.bool_  # booleans are numbers here
    assert to_numpy(np.arange(3, dtype=np.uint8)[:, None], "x").dtype == np.uint8


# -- found by `make mutate` (docs/mutation.md) ----------------------------------------------------
def test_a_boolean_unknown_is_refused_by_its_whole_message() -> None:
    rng = np.random.default_rng(55)
    flags = rng.normal(size=(6, 3)) > 0
    for inputs, wrt in (((flags,), None), ((flags, rng.normal(size=(6, 2))), None),
                        (({"h": rng.normal(size=(6, 2)), "x": flags},), "x")):
        with pytest.raises(batchjac.InputTypeError) as got:
            normalize(inputs, wrt=wrt, dtype=None, nan_policy="raise")
        assert str(got.value) == "The unknown input is boolean; unknowns must be real numbers."
    # a boolean known input is fine: only the unknowns must be real
    spec = normalize(({"h": flags, "x": rng.normal(size=(6, 3))},), wrt="x", dtype=None,
                     nan_policy="raise")
    assert spec.chunk(0, 6)[1][0].dtype == np.bool_
    assert normalize((rng.normal(size=(6, 3)), flags), wrt=None, dtype=None,
                     nan_policy="raise").unknown_shape == (3,)


def test_files_stay_on_disk_checked_by_rows_and_named_by_their_source(tmp_path: Any) -> None:
    """A path (or a reader batchjac opened) is read by rows: its non-finite values are found
    when its rows are read, not while validating; its name in messages is its file."""
    from batchjac._io import open_input
    from batchjac._validate import is_lazy

    values = np.random.default_rng(56).normal(size=(6, 3))
    values[4, 1] = np.nan
    np.save(tmp_path / "x.npy", values)
    path = str(tmp_path / "x.npy")
    spec = normalize((path,), wrt=None, dtype=None, nan_policy="raise")
    assert is_lazy(spec.arrays[0])
    assert spec.finite_check == (True,)
    assert spec.dtype == np.float64
    reader = open_input(path)
    spec = normalize((reader,), wrt=None, dtype=None, nan_policy="raise")
    assert spec.arrays[0] is reader
    assert spec.names == (f"x ({path})",)
    assert spec.finite_check == (True,)
    eager = normalize((np.asarray(values),), wrt=None, dtype=None, nan_policy="propagate")
    assert eager.finite_check == (False,)
    with pytest.raises(batchjac.InputError, match=r"^`x` has a non-finite value \(nan\) in row 4"):
        normalize((values,), wrt=None, dtype=None, nan_policy="raise")


def test_text_numbers_carry_no_dtype_intent(tmp_path: Any) -> None:
    """CSV numbers are read as float64 whatever precision they were written in: they make
    float32 the default, as nested lists do; a float64 .npy makes float64 the default."""
    values = np.random.default_rng(57).normal(size=(5, 3))
    np.save(tmp_path / "x.npy", values)
    assert normalize((str(tmp_path / "x.npy"),), wrt=None, dtype=None,
                     nan_policy="raise").dtype == np.float64
    pytest.importorskip("pyarrow")  # (batchjac[io]'s CSV reader)
    np.savetxt(tmp_path / "x.csv", values, delimiter=",", header="a,b,c", comments="")
    spec = normalize((str(tmp_path / "x.csv"),), wrt=["c", "a"], dtype=None, nan_policy="raise")
    assert spec.dtype == np.float32
    np.testing.assert_allclose(spec.chunk(0, 5)[0], values[:, [2, 0]], rtol=1e-6)  # as float32


def test_dtype_is_read_from_names_types_and_framework_dtypes() -> None:
    from batchjac._validate import resolve_dtype

    class FrameworkDType:  # what tf.float64 offers: a name
        name = "float64"

        def __repr__(self) -> str:
            return "tf.float64"

    assert resolve_dtype(FrameworkDType(), []) == np.float64
    assert resolve_dtype(np.float32, []) == np.float32
    assert resolve_dtype(np.dtype("float64"), []) == np.float64
    assert resolve_dtype("float32", [np.dtype("float64")]) == np.float32
    assert resolve_dtype(None, [np.dtype("float32"), np.dtype("float64")]) == np.float64
    assert resolve_dtype(None, [np.dtype("float32"), np.dtype("int64")]) == np.float32
    for bad, shown in ((np.float16, repr(np.float16)), ("int32", "'int32'"), (object(), None)):
        with pytest.raises(batchjac.InputError) as got:
            resolve_dtype(bad, [])
        if shown is not None:
            assert str(got.value) == (
                f"`dtype` must be one of ('float32', 'float64') (or None: float32, or float64 "
                f"when the inputs are float64); got {shown}.")


class Boxed:
    """An array of a fake framework kind (a numpy array in a box, on a named device)."""

    def __init__(self, arr: np.ndarray, device: Any = None) -> None:
        self.arr, self.device = np.asarray(arr), device
        self.shape, self.ndim = self.arr.shape, self.arr.ndim

    def __getitem__(self, key: Any) -> Boxed:
        return Boxed(self.arr[key], self.device)


class BoxOps:
    """The ArrayOps of :class:`Boxed` (what normalize uses of a framework's array kind)."""

    kind = "boxed"

    def __init__(self) -> None:
        self.finite_checks = 0

    def is_native(self, a: Any) -> bool:
        return isinstance(a, Boxed)

    def dtype_of(self, a: Any) -> np.dtype:
        return a.arr.dtype if isinstance(a, Boxed) else np.dtype(a.dtype)

    def all_finite(self, a: Any) -> bool:
        self.finite_checks += 1
        return bool(np.isfinite(a.arr).all())

    def to_numpy(self, a: Any) -> np.ndarray:
        return a.arr

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        assert isinstance(a, np.ndarray)
        return Boxed(a, device)


def test_a_framework_kind_gets_its_own_arrays_as_they_are_and_the_rest_once_on_the_device(
        tmp_path: Any) -> None:
    rng = np.random.default_rng(58)
    u, h, f = rng.normal(size=(6, 3)), rng.normal(size=(6, 2)), rng.normal(size=(6, 4))
    np.save(tmp_path / "f.npy", f)
    native = Boxed(u, "dev:0")
    xp = BoxOps()
    spec = normalize(({"u": native, "h": h, "f": str(tmp_path / "f.npy")},), wrt="u", dtype=None,
                     nan_policy="raise", xp=xp, device="dev:1")  # type: ignore[arg-type]
    assert spec.arrays[0] is native  # its own kind: as it is, on its device
    assert [type(a) for a in spec.arrays] == [Boxed, Boxed, Boxed]
    assert [a.device for a in spec.arrays] == ["dev:0", "dev:1", "dev:1"]
    np.testing.assert_array_equal(spec.arrays[1].arr, h)
    np.testing.assert_array_equal(spec.arrays[2].arr, f)  # a file read whole, every row
    assert spec.finite_check == (False, False, False)
    assert xp.finite_checks == 3  # each checked where it lives

    bad = u.copy()
    bad[4, 1] = np.inf
    for given in (Boxed(bad, "dev:0"), bad):
        with pytest.raises(batchjac.InputError) as got:
            normalize(({"u": given, "h": h},), wrt="u", dtype=None, nan_policy="raise",
                      xp=BoxOps(), device="dev:1")  # type: ignore[arg-type]
        assert str(got.value) == (
            "`inputs['u']` has a non-finite value (inf) in row 4 at (1,); 1 row(s) in all have "
            "NaN/Inf. Clean or drop such rows, or pass nan_policy='propagate' to get NaN "
            "Jacobians for them.")
    spec = normalize(({"u": Boxed(bad), "h": h},), wrt="u", dtype=None, nan_policy="propagate",
                     xp=BoxOps())  # type: ignore[arg-type]
    assert spec.n == 6


def test_lazy_inputs_stay_lazy_and_are_named_and_checked_as_given(tmp_path: Any) -> None:
    """np.memmap inputs (1-D too) are used as they are; a lazy input of text or with no rows
    axis is refused by its whole message."""
    from batchjac._validate import as_input, is_lazy

    rng = np.random.default_rng(59)
    np.save(tmp_path / "v.npy", rng.normal(size=(7,)))
    np.save(tmp_path / "x.npy", rng.normal(size=(7, 3)))
    vector = np.load(tmp_path / "v.npy", mmap_mode="r")
    spec = normalize((vector,), wrt=None, dtype=None, nan_policy="raise")
    assert spec.arrays[0] is vector
    assert spec.unknown_shape == ()
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    spec = normalize((mapped,), wrt=[2], dtype=None, nan_policy="raise")
    assert spec.names == ("x",)  # no source to name
    assert is_lazy(spec.arrays[0])
    np.save(tmp_path / "t.npy", np.array([["a"], ["b"]]))
    with pytest.raises(batchjac.InputTypeError) as got:
        as_input(np.load(tmp_path / "t.npy", mmap_mode="r"), "x")
    assert str(got.value) == "`x` must hold real numbers; got dtype <U1."
    scalar = np.memmap(tmp_path / "s.raw", dtype=np.float64, mode="w+", shape=())
    with pytest.raises(batchjac.InputError) as got:
        as_input(scalar, "h")
    assert str(got.value) == "`h` is a scalar; it needs a leading axis with one row per instance."


def test_tables_by_their_methods_only_and_their_dtypes_kept() -> None:
    from batchjac._validate import to_numpy

    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(60)
    single = pd.DataFrame(rng.normal(size=(5, 2)).astype(np.float32), columns=["a", "b"])
    arr = to_numpy(single, "x")
    assert arr.dtype == np.float32  # not widened: float32 stays the default
    assert arr.columns == ("a", "b")  # type: ignore[attr-defined]
    assert normalize((single,), wrt=["b"], dtype=None, nan_policy="raise").dtype == np.float32
    # a column named "source" is not a file to name the input by (only lazy inputs have one)
    sourced = pd.DataFrame(rng.normal(size=(5, 2)), columns=["source", "b"])
    assert normalize((sourced,), wrt=["b"], dtype=None, nan_policy="raise").names == ("x",)
    series = pd.Series(rng.normal(size=5))  # a column: dtypes and to_numpy, no columns
    got = to_numpy(series, "x")
    np.testing.assert_array_equal(got, series.to_numpy())
    assert getattr(got, "columns", None) is None

    class Described:  # columns and dtypes but no to_numpy: not a table, and not numbers
        columns, dtypes = ["a"], [np.dtype("f8")]

    with pytest.raises(batchjac.InputTypeError, match=r"^`x` must hold real numbers; got dtype object"):
        to_numpy(Described(), "x")

    class CpuTensor:  # a .cpu() and .numpy() but no .detach(): read with .numpy()
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def cpu(self) -> CpuTensor:
            raise AssertionError("only torch tensors are moved with .detach().cpu()")

        def numpy(self) -> np.ndarray:
            return self.a

    values = rng.normal(size=(4, 2))
    np.testing.assert_array_equal(to_numpy(CpuTensor(values), "x"), values)


@pytest.mark.parametrize(("count", "shown_more"), [(10, False), (11, True)])
def test_text_columns_are_listed_up_to_ten(count: int, shown_more: bool) -> None:
    from batchjac._validate import to_numpy

    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({f"c{i}": ["t"] * 2 for i in range(count)} | {"ok": [1.0, 2.0]})
    shown = [f"c{i}" for i in range(10)] + (["..."] if shown_more else [])
    with pytest.raises(batchjac.InputTypeError, match=r"^`x` is a table whose column\(s\) "
                                                      + re.escape(repr(shown)) + " are not numeric"):
        to_numpy(frame, "x")


def test_wrt_forms_give_the_layout_and_their_errors_the_valid_range(x: np.ndarray) -> None:
    rng = np.random.default_rng(61)
    h = rng.normal(size=(10, 3))
    spec = normalize(({"x": x, "h": h},), wrt="h", dtype=None, nan_policy="raise")
    assert spec.layout == Layout(kind="dict", n_inputs=2, wrt_index=1, keys=("x", "h"))
    spec = normalize(({"x": x, "h": h},), wrt=("h", [2, 0]), dtype=None, nan_policy="raise")
    assert spec.layout == Layout(kind="dict", n_inputs=2, wrt_index=1, keys=("x", "h"),
                                 columns=(2, 0), perm=(1, 2, 0))
    np.testing.assert_array_equal(spec.chunk(0, 10)[0], h[:, [2, 0]])
    assert normalize(((x, h),), wrt=-2, dtype=None, nan_policy="raise").layout == Layout(
        kind="tuple", n_inputs=2, wrt_index=0)
    # a list of 1-D arrays is a multi-input model too
    spec = normalize(([x[:, 0], x[:, 1]],), wrt=1, dtype=None, nan_policy="raise")
    assert (spec.layout.kind, spec.unknown_shape) == ("tuple", ())
    # columns of the last axis of a 4-D input
    cube = rng.normal(size=(10, 2, 3, 5))
    spec = normalize((cube,), wrt=[4, 1], dtype=None, nan_policy="raise")
    assert spec.unknown_shape == (2, 3, 2)
    assert spec.layout == Layout(kind="single", n_inputs=1, columns=(4, 1), perm=(2, 1, 3, 4, 0))
    u, ctx = spec.chunk(0, 10)
    np.testing.assert_array_equal(u, cube[..., [4, 1]])
    np.testing.assert_array_equal(np.concatenate([u, ctx[0]], -1)[..., list(spec.layout.perm or ())],
                                  cube)  # the model's input rebuilt

    def message(*inputs: Any, wrt: Any) -> str:
        with pytest.raises(batchjac.InputError) as got:
            normalize(inputs, wrt=wrt, dtype=None, nan_policy="raise")
        return str(got.value)

    assert message((x, h, x), wrt=None) == (
        "The model has 3 inputs; say which is unknown with `wrt` (an index 0..2), or (input, "
        "columns) for some of its columns, e.g. wrt=(0, [0, 1]).")
    assert message((x, h), wrt=2) == "`wrt=2` is out of range: there are 2 inputs (0..1)."
    assert message((x, h), wrt=-3) == "`wrt=-3` is out of range: there are 2 inputs (0..1)."
    assert message(x, wrt=[0, 8]) == (
        "`wrt` column 8 is out of range: `x` has 8 feature columns (valid indices 0..7, or "
        "negative from the end).")
    assert message(x, wrt=slice(8, 10)) == (
        "`wrt=slice(8, 10, None)` selects no column of `x`, which has 8 feature columns. Give a "
        "non-empty slice such as slice(0, 5).")
    assert message(x[:, :3], wrt=slice(3, None)).endswith("such as slice(0, 3).")
