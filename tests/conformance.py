"""The conformance suite every backend runs unchanged.

A backend's test module subclasses :class:`BackendConformance` and supplies only the model
builders below (fixtures in fsspec's `tests/abstract` style). References are independent of
batchjac: closed forms (linear → weight matrix, elementwise → diagonal, MLP → product of
weight matrices and tanh' diagonals, in numpy float64) and float64 central finite differences.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import numpy as np
import pytest

import batchjac
from batchjac.examples import mlp_forward, mlp_jacobian, mlp_weights

from .helpers import assert_jac_close, central_differences

SEED_SIZES = (8, 64, 64, 4)


class BackendConformance:
    """Subclass as ``TestXConformance`` and implement the builders."""

    backend: ClassVar[str]
    #: whether the framework can tell that an output does not depend on an input (TF's None
    #: gradient, torch's requires_grad); JAX cannot, and gives zero Jacobians instead
    detects_disconnected: ClassVar[bool] = True

    # ---- builders each backend supplies -------------------------------------------------
    def mlp(self, sizes: tuple[int, ...], dtype: str) -> Any:
        """The example MLP with weights mlp_weights(sizes) (batch in, batch out)."""
        raise NotImplementedError

    def linear(self, w: np.ndarray, b: np.ndarray, dtype: str) -> Any:
        """x (N, d) -> x @ w + b."""
        raise NotImplementedError

    def linear_3d(self, w: np.ndarray, dtype: str, out_shape: tuple[int, int]) -> Any:
        """x (N, d) -> reshape(x @ w, (N, *out_shape)): a multi-dimensional output."""
        raise NotImplementedError

    def elementwise(self, dtype: str) -> Any:
        """x -> sin(x) + 0.5 * x**2, elementwise, any shape."""
        raise NotImplementedError

    def two_input(self, wx: np.ndarray, wh: np.ndarray, dtype: str, as_dict: bool) -> Any:
        """(x, h) -> tanh(x @ wx + h @ wh), called positionally or with keys 'x' and 'h'."""
        raise NotImplementedError

    def disconnected(self, dtype: str) -> Any:
        """x -> an output of shape (N, 3) that does not depend on x."""
        raise NotImplementedError

    def batch_coupled(self, dtype: str) -> Any:
        """x -> x - mean(x over the batch axis): rows interact."""
        raise NotImplementedError

    def float64(self) -> contextlib.AbstractContextManager[Any]:
        """Context in which float64 computation is allowed (JAX: x64 mode)."""
        return contextlib.nullcontext()

    # ---- helpers --------------------------------------------------------------------------
    def jac(self, model: Any, *inputs: Any, **kw: Any) -> Any:
        return batchjac.jacobian(model, *inputs, backend=self.backend, **kw)

    @staticmethod
    def data(n: int, d: int, seed: int, dtype: str = "float32") -> np.ndarray:
        return np.random.default_rng(seed).normal(0, 1, (n, d)).astype(dtype)

    # ---- closed forms ---------------------------------------------------------------------
    @pytest.mark.parametrize("mode", ["forward", "reverse"])
    def test_linear_is_weight_matrix(self, mode: str) -> None:
        rng = np.random.default_rng(10)
        w, b = rng.normal(size=(6, 3)), rng.normal(size=3)
        x = self.data(37, 6, seed=11)
        jac = self.jac(self.linear(w, b, "float32"), x, mode=mode)
        assert_jac_close(jac, np.broadcast_to(w.T, (37, 3, 6)))

    @pytest.mark.parametrize("mode", ["forward", "reverse"])
    def test_elementwise_is_diagonal(self, mode: str) -> None:
        x = self.data(20, 5, seed=12)
        jac = self.jac(self.elementwise("float32"), x, mode=mode)
        ref = np.einsum("ni,ij->nij", np.cos(x.astype(np.float64)) + x, np.eye(5))
        assert_jac_close(jac, ref)

    @pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
    def test_seed_mlp_unknown_known(self, mode: str) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        x = self.data(300, 8, seed=13)
        jac = self.jac(model, x[:, :5], x[:, 5:], mode=mode)
        ref = mlp_jacobian(mlp_weights(SEED_SIZES), x)[:, :, :5]
        assert jac.dtype == np.float32
        assert_jac_close(jac, ref)

    @pytest.mark.parametrize("mode", ["forward", "reverse"])
    def test_float64_matches_closed_form(self, mode: str) -> None:
        with self.float64():
            model = self.mlp(SEED_SIZES, "float64")
            x = self.data(64, 8, seed=14, dtype="float64")
            jac = self.jac(model, x[:, :5], x[:, 5:], mode=mode)
        assert jac.dtype == np.float64
        assert_jac_close(jac, mlp_jacobian(mlp_weights(SEED_SIZES), x)[:, :, :5])

    def test_float64_when_asked(self) -> None:
        with self.float64():
            model = self.mlp(SEED_SIZES, "float32")
            x = self.data(16, 8, seed=15)  # float32 data, float64 asked
            jac = self.jac(model, x, wrt=slice(0, 5), dtype="float64")
        assert jac.dtype == np.float64
        # the float32 model's weights are float32-rounded: compare at float32 accuracy
        assert_jac_close(jac, mlp_jacobian(mlp_weights(SEED_SIZES), x)[:, :, :5], dtype=np.float32)

    # ---- call forms -----------------------------------------------------------------------
    @pytest.mark.parametrize("wrt", [[6, 0, 3], slice(2, 7), [-1], np.array([True] + [False] * 6 + [True])])
    def test_wrt_columns_anywhere(self, wrt: Any) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        x = self.data(50, 8, seed=16)
        cols = np.arange(8)[wrt]
        jac = self.jac(model, x, wrt=wrt)
        assert_jac_close(jac, mlp_jacobian(mlp_weights(SEED_SIZES), x)[:, :, cols])

    def test_all_columns_and_return_outputs(self) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        x = self.data(40, 8, seed=17)
        y, jac = self.jac(model, x, return_outputs=True)
        layers = mlp_weights(SEED_SIZES)
        assert_jac_close(jac, mlp_jacobian(layers, x))
        np.testing.assert_allclose(y, mlp_forward(layers, x), rtol=1e-4, atol=1e-5)

    @pytest.mark.parametrize("as_dict", [False, True])
    @pytest.mark.parametrize("mode", ["forward", "reverse"])
    def test_multi_input(self, as_dict: bool, mode: str) -> None:
        rng = np.random.default_rng(18)
        wx, wh = rng.normal(size=(3, 4)) * 0.5, rng.normal(size=(2, 4)) * 0.5
        x, h = self.data(25, 3, seed=19), self.data(25, 2, seed=20)
        model = self.two_input(wx, wh, "float32", as_dict)
        inputs: Any = {"x": x, "h": h} if as_dict else (x, h)
        pre = x.astype(np.float64) @ wx + h.astype(np.float64) @ wh
        d = 1 - np.tanh(pre) ** 2
        ref_x = d[:, :, None] * wx.T[None]
        ref_h = d[:, :, None] * wh.T[None]
        assert_jac_close(self.jac(model, inputs, wrt="x" if as_dict else 0, mode=mode), ref_x)
        assert_jac_close(self.jac(model, inputs, wrt="h" if as_dict else 1, mode=mode), ref_h)
        # some columns of one input
        sel = ("x", [2, 0]) if as_dict else (0, [2, 0])
        assert_jac_close(self.jac(model, inputs, wrt=sel, mode=mode), ref_x[:, :, [2, 0]])

    def test_multidimensional_output(self) -> None:
        w = np.random.default_rng(21).normal(size=(5, 6))
        x = self.data(9, 5, seed=22)
        jac = self.jac(self.linear_3d(w, "float32", (2, 3)), x)
        assert jac.shape == (9, 2, 3, 5)
        assert_jac_close(jac, np.broadcast_to(w.T.reshape(2, 3, 5), (9, 2, 3, 5)))

    def test_multidimensional_unknown(self) -> None:
        x = np.random.default_rng(23).normal(size=(6, 2, 3)).astype("float32")
        jac = self.jac(self.elementwise("float32"), x, mode="reverse")
        assert jac.shape == (6, 2, 3, 2, 3)
        d = (np.cos(x.astype(np.float64)) + x).reshape(6, 6)
        ref = np.einsum("ni,ij->nij", d, np.eye(6)).reshape(6, 2, 3, 2, 3)
        assert_jac_close(jac, ref)

    # ---- chunking -------------------------------------------------------------------------
    @pytest.mark.parametrize("mode", ["forward", "reverse"])
    def test_chunked_equals_unchunked(self, mode: str) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        x = self.data(103, 8, seed=24)
        whole = self.jac(model, x[:, :5], x[:, 5:], mode=mode)
        y, parts = self.jac(model, x[:, :5], x[:, 5:], mode=mode, chunk_size=10, return_outputs=True)
        np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6)
        # both against the closed form, and the outputs too (the last chunk of 3 rows is padded)
        layers = mlp_weights(SEED_SIZES)
        assert_jac_close(parts, mlp_jacobian(layers, x)[:, :, :5])
        assert_jac_close(whole, mlp_jacobian(layers, x)[:, :, :5])
        assert y.shape == (103, 4)
        np.testing.assert_allclose(y, mlp_forward(layers, x), rtol=1e-4, atol=1e-5)

    def test_out_memmap(self, tmp_path: Any) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        x = self.data(70, 8, seed=25)
        out = np.lib.format.open_memmap(tmp_path / "j.npy", mode="w+", dtype=np.float32, shape=(70, 4, 5))
        res = self.jac(model, x[:, :5], x[:, 5:], chunk_size=16, out=out)
        assert res is out
        out.flush()
        stored = np.load(tmp_path / "j.npy")
        assert_jac_close(stored, mlp_jacobian(mlp_weights(SEED_SIZES), x)[:, :, :5])

    def test_empty_batch(self) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        x = self.data(0, 8, seed=26)
        jac = self.jac(model, x[:, :5], x[:, 5:])
        assert jac.shape == (0, 4, 5)
        y, jac = self.jac(model, x, return_outputs=True)
        assert y.shape == (0, 4)
        assert jac.shape == (0, 4, 8)

    def test_single_instance(self) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        x = self.data(1, 8, seed=27)
        jac = self.jac(model, x, wrt=[1, 2])
        assert_jac_close(jac, mlp_jacobian(mlp_weights(SEED_SIZES), x)[:, :, [1, 2]])

    # ---- finite differences ---------------------------------------------------------------
    def test_against_finite_differences(self) -> None:
        rng = np.random.default_rng(28)
        wx, wh = rng.normal(size=(3, 4)), rng.normal(size=(2, 4))
        x, h = self.data(30, 3, seed=29), self.data(30, 2, seed=30)
        model = self.two_input(wx, wh, "float32", False)
        jac = self.jac(model, (x, h), wrt=0)
        h64 = h.astype(np.float64)
        ref = central_differences(lambda u: np.tanh(u @ wx + h64 @ wh), x)
        assert_jac_close(jac, ref)

    # ---- bad input and bad models ---------------------------------------------------------
    def test_disconnected_output(self) -> None:
        x = self.data(10, 4, seed=31)
        if self.detects_disconnected:
            with pytest.raises(batchjac.NotConnectedError, match="does not depend on the unknowns"):
                self.jac(self.disconnected("float32"), x)
        else:
            np.testing.assert_array_equal(self.jac(self.disconnected("float32"), x), 0.0)

    def test_rows_that_interact_are_refused(self) -> None:
        x = self.data(10, 4, seed=32)
        with pytest.raises(batchjac.RowInteractionError, match="rows of a batch interact"):
            self.jac(self.batch_coupled("float32"), x)

    def test_nan_inputs(self) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        x = self.data(12, 8, seed=33)
        x[7, 6] = np.nan
        with pytest.raises(batchjac.InputError, match=r"`known` has a non-finite value \(nan\) in row 7"):
            self.jac(model, x[:, :5], x[:, 5:])
        jac = self.jac(model, x[:, :5], x[:, 5:], nan_policy="propagate")
        assert np.isnan(jac[7]).all()
        assert np.isfinite(np.delete(jac, 7, axis=0)).all()

    def test_row_mismatch(self) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        with pytest.raises(batchjac.InputError, match="`known` has 9 rows but `unknown` has 10"):
            self.jac(model, self.data(10, 5, seed=34), self.data(9, 3, seed=35))

    def test_trace_once_for_many_chunks(self) -> None:
        model = self.mlp(SEED_SIZES, "float32")
        x = self.data(2000, 8, seed=36)
        from batchjac import _backends

        self.jac(model, x[:, :5], x[:, 5:], chunk_size=256)
        bound = next(iter(_backends._bound[model].values()))
        before = bound.trace_count
        self.jac(model, x[:, :5], x[:, 5:], chunk_size=256)
        self.jac(model, x[:1000, :5], x[:1000, 5:], chunk_size=256)
        assert bound.trace_count == before
