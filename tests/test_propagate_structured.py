"""``propagate`` with a structured input covariance (issue 38): a dense ``cov`` that is
diagonal (shared or per instance) is taken as the standard deviations it holds, and a shared
``cov`` of low rank through its factor, so that ``J Sigma J^T`` costs what the structure
needs; the results equal ``std=``'s and the dense reference ``J Sigma J^T`` built from
batchjac's own Jacobians in float64, and the form taken is reported."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import jax_x64, rng

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _model() -> tuple[Any, np.ndarray]:
    g = rng(3801)
    w1, w2 = jnp.asarray(g.normal(size=(6, 16)) * 0.5), jnp.asarray(g.normal(size=(16, 3)))

    def f(x: Any) -> Any:
        return jnp.tanh(x @ w1.astype(x.dtype)) @ w2.astype(x.dtype)

    return f, g.normal(size=(25, 6))


def _reference(f: Any, x: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """J Sigma J^T per instance, from batchjac's float64 Jacobians, Sigma dense."""
    jac = np.asarray(batchjac.jacobian(f, x), np.float64)
    sig = np.broadcast_to(sigma, (len(x), *sigma.shape[-2:]))
    return np.einsum("nak,nkl,nbl->nab", jac, sig, jac)


def test_a_diagonal_cov_is_taken_as_its_standard_deviations() -> None:
    with jax_x64():
        f, x = _model()
        s = rng(3802).uniform(0.1, 0.5, size=6)
        dense = batchjac.propagate(f, x, cov=np.diag(s ** 2))
        std = batchjac.propagate(f, x, std=s)
        assert dense.sigma_form == "diagonal (taken as std)"
        assert std.sigma_form == "std"
        np.testing.assert_allclose(dense.cov, std.cov, rtol=1e-12, atol=0)
        np.testing.assert_allclose(dense.cov, _reference(f, x, np.diag(s ** 2)), rtol=1e-10)
        # one per instance: an (N, k, k) stack of diagonal matrices
        per = rng(3803).uniform(0.1, 0.5, size=(len(x), 6))
        stack = np.einsum("nk,kl->nkl", per ** 2, np.eye(6))
        got = batchjac.propagate(f, x, cov=stack)
        assert got.sigma_form == "diagonal per instance (taken as std)"
        np.testing.assert_allclose(got.cov, batchjac.propagate(f, x, std=per).cov, rtol=1e-12)
        np.testing.assert_allclose(got.cov, _reference(f, x, stack), rtol=1e-10)
        stack[3, 0, 1] = stack[3, 1, 0] = 1e-4  # one instance not diagonal: the dense rule
        full = batchjac.propagate(f, x, cov=stack)
        assert full.sigma_form == "dense per instance"
        np.testing.assert_allclose(full.cov, _reference(f, x, stack), rtol=1e-10)


def test_a_low_rank_cov_is_used_through_its_factor() -> None:
    with jax_x64():
        f, x = _model()
        factor = rng(3804).normal(size=(6, 2)) * 0.3
        sigma = factor @ factor.T  # rank 2 of 6
        got = batchjac.propagate(f, x, cov=sigma)
        assert got.sigma_form == "low rank (2 of 6)"
        np.testing.assert_allclose(got.cov, _reference(f, x, sigma), rtol=1e-9, atol=1e-15)
        full = rng(3805).normal(size=(6, 6))
        got = batchjac.propagate(f, x, cov=full @ full.T)
        assert got.sigma_form == "dense"
        np.testing.assert_allclose(got.cov, _reference(f, x, full @ full.T), rtol=1e-10)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_dense_cov_goes_through_its_cholesky_factor_or_whole_where_singular(dtype: Any) -> None:
    """A dense shared ``Sigma`` of full rank: ``(J L)(J L)^T`` with its Cholesky factor (a
    triangular product); a singular one above the low-rank line (rank 5 of 6: one unknown
    known exactly, a zero row and column): Cholesky fails and ``J Sigma J^T`` is formed
    whole. Both equal the float64 reference, in float64 and float32, and the Cholesky path is
    the one taken where it exists."""
    from batchjac import _propagate

    with jax_x64():
        f, x = _model()
        g = rng(3806)
        a = g.normal(size=(6, 6))
        full = a @ a.T + 0.05 * np.eye(6)
        singular = full.copy()
        singular[2, :] = singular[:, 2] = 0.0
        taken: list[bool] = []
        lower = _propagate._times_lower

        def spy(part: np.ndarray, low: np.ndarray, buf: np.ndarray) -> np.ndarray:
            taken.append(True)
            return lower(part, low, buf)

        _propagate._times_lower = spy
        try:
            for sigma, through in ((full, True), (singular, False)):
                del taken[:]
                got = batchjac.propagate(f, x.astype(dtype), cov=sigma.astype(dtype))
                assert got.sigma_form == "dense"
                assert bool(taken) is through
                want = _reference(f, x, sigma)
                tol = 1e-10 if dtype == np.float64 else 2e-5
                np.testing.assert_allclose(got.cov, want, rtol=tol, atol=tol * np.abs(want).max())
        finally:
            _propagate._times_lower = lower
