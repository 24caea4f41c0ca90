"""Errors that say what to do (issue 19): each bad call gets one error naming the argument, what
was received and the fix, and results that would be silently useless get a warning. Models are
small closed forms (a Dense layer, a linear map), so right results are checked exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchjac

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")


def _rng() -> np.random.Generator:
    return np.random.default_rng()  # fresh inputs each run: the checks must not depend on them


def _dense(width: int = 8, outputs: int = 4) -> Any:
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(outputs)])
    model.layers[-1].kernel.assign(_rng().normal(size=(width, outputs)).astype("f4"))
    return model


def _kernel(model: Any) -> np.ndarray:
    return np.asarray(model.layers[-1].kernel)


# -- integer known inputs are cast to the compute dtype -----------------------------------------

def test_integer_known_inputs_are_cast_to_the_compute_dtype() -> None:
    model, rng = _dense(), _rng()
    u = rng.normal(size=(12, 5)).astype("f4")
    h = rng.integers(-3, 4, size=(12, 3))  # int64: ConcatV2 refused float32 + int64
    jac = batchjac.jacobian(model, u, h)
    w = _kernel(model)
    np.testing.assert_allclose(jac, np.broadcast_to(w[:5].T, (12, 4, 5)), rtol=1e-6)
    # the known columns beside `wrt` of one integer table too
    x = rng.integers(-3, 4, size=(12, 8))
    jac = batchjac.jacobian(model, x, wrt=[1, 6])
    np.testing.assert_allclose(jac, np.broadcast_to(w[[1, 6]].T, (12, 4, 2)), rtol=1e-6)


# -- a DataFrame's column names -------------------------------------------------------------------

def test_dataframe_columns_name_the_unknowns(tmp_path: Any) -> None:
    pd = pytest.importorskip("pandas", reason="pandas is in the dev extra; DataFrames are tested "
                                              "where it is installed")
    model, rng = _dense(), _rng()
    names = [f"x{j}" for j in range(8)]
    frame = pd.DataFrame(rng.normal(size=(12, 8)).astype("f4"), columns=names)
    jac = batchjac.jacobian(model, frame, wrt=["x2", "x5", "x0"])
    w = _kernel(model)
    np.testing.assert_allclose(jac, np.broadcast_to(w[[2, 5, 0]].T, (12, 4, 3)), rtol=1e-6)
    with pytest.raises(batchjac.InputError, match=r"`wrt` names column 'nope', which `x` does not "
                                                  r"have; its columns are \['x0', 'x1'"):
        batchjac.jacobian(model, frame, wrt=["nope"])
    # a store labels the unknowns with the frame's column names
    result = batchjac.jacobian(model, frame, wrt=["x1", "x3"], out=str(tmp_path / "j.zarr"))
    assert result.open().shape == (12, 4, 2)
    assert batchjac.read_manifest(str(tmp_path / "j.zarr"))["metadata"]["unknown_names"] == ["x1", "x3"]
    # a text column is named, not reported as "ragged rows"
    frame["label"] = ["a"] * 12
    with pytest.raises(batchjac.InputTypeError, match=r"column\(s\) \['label'\] are not numeric"):
        batchjac.jacobian(model, frame, wrt=["x1"])


# -- inputs that do not fit the model's declared shape -----------------------------------------

def test_one_dimensional_x_for_a_keras_model_says_n_features_expected() -> None:
    x = _rng().normal(size=(10,)).astype("f4")
    with pytest.raises(batchjac.InputError, match=r"`x` has shape \(10,\), one number per instance, but "
                                                  r"the model takes \(N, 8\) inputs: \(N, features\) "
                                                  r"expected"):
        batchjac.jacobian(_dense(), x)


def test_one_dimensional_x_elsewhere_adds_the_hint_to_the_framework_error() -> None:
    torch = pytest.importorskip("torch")
    x = _rng().normal(size=(10,)).astype("f4")
    with pytest.raises(batchjac.ModelError, match=r"mat1 and mat2.*`x` is 1-D, shape \(10,\): one "
                                                  r"number per instance.*\(N, features\)"):
        batchjac.jacobian(torch.nn.Linear(8, 3), x)
    jnp = pytest.importorskip("jax.numpy")
    # one number per instance is a legitimate call form: nothing to say when the model works
    jac = batchjac.jacobian(lambda z: jnp.sin(z), x)
    np.testing.assert_allclose(jac, np.cos(x), rtol=1e-6)


def test_forgotten_known_inputs_name_the_model_width() -> None:
    model, rng = _dense(), _rng()
    u = rng.normal(size=(10, 5))
    for dtype in ("float32", "float64"):  # float64 fails while the float64 copy is built
        with pytest.raises(batchjac.InputError, match=r"The model takes 8 input columns, `x` has 5; "
                                                      r"forgot the known inputs\? Pass them as "
                                                      r"jacobian\(model, unknown, known\)"):
            batchjac.jacobian(model, u, dtype=dtype)
    with pytest.raises(batchjac.InputError, match=r"takes 8 input columns, but `unknown` has 5 and "
                                                  r"`known` 2: 7 in all .*the other 3 columns"):
        batchjac.jacobian(model, u, rng.normal(size=(10, 2)))
    with pytest.raises(batchjac.InputError, match=r"takes 8 input columns, `x` has 10: give only"):
        batchjac.jacobian(model, rng.normal(size=(10, 10)), wrt=[0, 1])


# -- random models and stateful RNNs ----------------------------------------------------------

class TrainingDropout(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.dense, self.drop = keras.layers.Dense(4), keras.layers.Dropout(0.5)

    def call(self, x: Any) -> Any:
        return self.dense(self.drop(x, training=True))


class Noise(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.dense, self.noise = keras.layers.Dense(4), keras.layers.GaussianNoise(1.0)

    def call(self, x: Any) -> Any:
        return self.dense(self.noise(x, training=True))


def _torch_dropout() -> Any:
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x: Any) -> Any:  # functional dropout: eval() does not switch it off
            return self.lin(torch.nn.functional.dropout(x, 0.5, training=True))

    return Net()


@pytest.mark.parametrize("make", [TrainingDropout, Noise, _torch_dropout])
def test_random_models_are_named_as_such_not_as_rows_that_interact(make: Any) -> None:
    x = _rng().normal(size=(16, 8)).astype("f4")
    with pytest.raises(batchjac.ModelError, match=r"not deterministic: two calls on the same 4 rows "
                                                  r"returned different outputs.*dropout in training "
                                                  r"mode.*inference mode") as caught:
        batchjac.jacobian(make(), x)
    assert not isinstance(caught.value, batchjac.RowInteractionError)


@pytest.mark.parametrize("batch", [2, 4])  # 4: the probe's own batch size, where Keras is silent
def test_stateful_rnn_is_refused_with_the_fix(batch: int) -> None:
    model = keras.Sequential([keras.Input((3, 2), batch_size=batch),
                              keras.layers.LSTM(4, stateful=True)])
    x = _rng().normal(size=(10, 3, 2)).astype("f4")
    with pytest.raises(batchjac.ModelError, match=rf"stateful recurrent layer \(LSTM 'lstm.*', "
                                                  rf"stateful=True\).*fixed size \({batch} rows\).*"
                                                  rf"Rebuild the model with stateful=False"):
        batchjac.jacobian(model, x)


# -- all-zero Jacobians ----------------------------------------------------------------------------

class ReadsOnlyKnown(keras.Model):
    """concat([unknown, known]) -> Dense(known columns): TensorFlow's gradient through the
    slice is zero, not None, so the probes see a connected output."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(4)

    def call(self, x: Any) -> Any:
        return self.dense(x[:, 5:])


def test_all_zero_jacobians_warn_once_per_bound_model(tmp_path: Any) -> None:
    model, rng = ReadsOnlyKnown(), _rng()
    u, h = rng.normal(size=(40, 5)).astype("f4"), rng.normal(size=(40, 3)).astype("f4")
    with pytest.warns(batchjac.ZeroJacobianWarning,
                      match=r"Every Jacobian entry of .* is zero: the model's output does not "
                            r"seem to depend on the unknowns.*reads only the known inputs") as rec:
        jac = batchjac.jacobian(model, u, h)
    assert rec[0].filename == __file__  # the user's call, not a line of batchjac
    assert jac.shape == (40, 4, 5)
    assert not np.any(jac)
    batchjac.jacobian(model, u, h)  # once per bound model: no second warning (warnings are errors)
    batchjac.jacobian(model, u[:7], h[:7], chunk_size=3)
    # a store gets the same check, on its first chunk
    with pytest.warns(batchjac.ZeroJacobianWarning):
        batchjac.jacobian(ReadsOnlyKnown(), u, h, out=str(tmp_path / "j.zarr"), chunk_size=16)


@pytest.mark.parametrize("where", ["first", "last", "none"])
def test_the_zero_check_finds_one_nonzero_entry_anywhere(where: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check reads blocks of rows and stops at the first nonzero one: one nonzero entry in
    the first or the last block is found, in C order and transposed (non-contiguous) arrays
    alike, and an all-zero chunk is all zero."""
    from batchjac import _runner

    monkeypatch.setattr(_runner, "ZERO_CHECK_BLOCK", 60)  # blocks of 2 rows of 5 x 6
    rng = _rng()
    for layout in ("C", "T"):
        a = np.zeros((11, 5, 6), dtype="f4")
        if where != "none":
            row = 0 if where == "first" else 10
            a[row, int(rng.integers(5)), int(rng.integers(6))] = float(rng.uniform(1e-30, 1.0))
        b = a if layout == "C" else np.ascontiguousarray(a.transpose(0, 2, 1)).transpose(0, 2, 1)
        assert _runner._any_nonzero(b) is (where != "none")
    assert _runner._any_nonzero(np.zeros((0, 3))) is False
    assert _runner._any_nonzero(np.asarray(2.0)) is True


def test_all_zero_jacobians_warn_in_every_backend() -> None:
    torch = pytest.importorskip("torch")
    rng = _rng()
    u, h = rng.normal(size=(9, 5)).astype("f4"), rng.normal(size=(9, 3)).astype("f4")
    lin = torch.nn.Linear(3, 4)
    with pytest.warns(batchjac.ZeroJacobianWarning):  # the unknowns reach the output times zero
        batchjac.jacobian(lambda x: lin(x[:, 5:] + 0.0 * x[:, :3]), u, h, backend="torch")
    jnp = pytest.importorskip("jax.numpy")
    w = jnp.asarray(rng.normal(size=(8, 4)).astype("f4")).at[:5].set(0.0)
    with pytest.warns(batchjac.ZeroJacobianWarning):
        batchjac.jacobian(lambda x: x @ w, u, h)
    # a Jacobian zero on some rows only is a result, not a warning
    w2 = jnp.asarray(rng.normal(size=(8, 4)).astype("f4"))
    u2 = np.full_like(u, -1.0)
    u2[0] = np.abs(u[0]) + 0.1
    jac = batchjac.jacobian(lambda x: jnp.maximum(x, 0.0) @ w2, u2, h)
    assert np.any(jac[0])
    assert not np.any(jac[1:])


# -- a JAX model whose Python side changes between calls ----------------------------------------

def test_jax_model_whose_leaves_change_between_calls_is_traced_again() -> None:
    """'Computation compiled for 6 inputs but called with 1': a model whose array leaves
    change in number between calls (5 weights, then none) must not reach the old compiled
    kernel. The current code sees the change (JaxBound.refresh) and compiles again; this test
    keeps it so, on the repeated-call fast path too."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")

    @jax.tree_util.register_pytree_node_class
    class Chain:
        def __init__(self, ws: list[Any], scale: Any) -> None:
            self.ws, self.scale = ws, scale

        def tree_flatten(self) -> Any:
            return (self.ws, self.scale), None

        @classmethod
        def tree_unflatten(cls, aux: Any, children: Any) -> Any:
            return cls(*children)

        def __call__(self, x: Any) -> Any:
            for w in self.ws:
                x = x @ w
            return x * self.scale

    rng = _rng()
    ws = [jnp.asarray(rng.normal(size=(3, 3)).astype("f4")) for _ in range(5)]
    model = Chain(ws, jnp.float32(2.0))
    x = rng.normal(size=(6, 3)).astype("f4")
    expect = np.linalg.multi_dot([np.asarray(w) for w in ws]).T * 2.0
    for _ in range(2):  # the second call takes the fast path
        np.testing.assert_allclose(batchjac.jacobian(model, x, backend="jax"),
                                   np.broadcast_to(expect, (6, 3, 3)), rtol=1e-4, atol=1e-5)
    model.ws, model.scale = [], 3.0  # no array leaf left: the old kernel took 5 + 1 + 1 inputs
    for _ in range(2):
        np.testing.assert_allclose(batchjac.jacobian(model, x, backend="jax"),
                                   np.broadcast_to(3.0 * np.eye(3), (6, 3, 3)), rtol=1e-6)
    model.ws.append(ws[0])  # in place: the list the kernel was traced with grows
    np.testing.assert_allclose(batchjac.jacobian(model, x, backend="jax"),
                               np.broadcast_to(3.0 * np.asarray(ws[0]).T, (6, 3, 3)), rtol=1e-5)


# -- bad options leave no store behind ------------------------------------------------------------

@pytest.mark.parametrize(("option", "message"), [
    ({"max_memory": "abc"}, "`max_memory` must be a number of bytes"),
    ({"chunk_size": 0}, "`chunk_size` must be a positive integer; got 0"),
    ({"mode": "sideways"}, "`mode` must be 'auto', 'forward' or 'reverse'"),
])
@pytest.mark.parametrize("suffix", ["zarr", "npy", "h5"])
def test_bad_options_leave_no_store_behind(tmp_path: Any, option: dict[str, Any], message: str,
                                           suffix: str) -> None:
    x = _rng().normal(size=(6, 8)).astype("f4")
    with pytest.raises(batchjac.InputError, match=message):
        batchjac.jacobian(_dense(), x, out=str(tmp_path / f"j.{suffix}"), **option)
    assert list(tmp_path.iterdir()) == []
