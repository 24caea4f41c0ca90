"""The forward Hessian and Hessian diagonal of JAX functions (batchjac._backends.jax_laplacian:
the forward-Laplacian rule set carrying the second derivatives along every pair of unit
tangents, or along each one) and the JAX kernels that use them (order forward-over-forward).

References, all in float64: ``jax.hessian`` (``jacfwd(jacrev)``) of the same function, closed
forms (a quadratic ``x^T A x`` has the Hessian ``A + A^T``), and central differences of an
analytic Jacobian.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import assert_jac_close, central_differences, rng

jax = pytest.importorskip("jax")
jnp = jax.numpy

from batchjac._backends.jax import laplacian as jax_laplacian  # noqa: E402

from .test_jax_laplacian import ACTIVATIONS, mlp_with_known, x64  # noqa: E402


def hessian_and_note(f: Any, *arrays: np.ndarray, **options: Any) -> tuple[np.ndarray, str]:
    """``batchjac.hessian`` and the kernel line of its ``explain``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        h = batchjac.hessian(f, *arrays, backend="jax", explain=True, **options)
    notes = [line for line in err.getvalue().splitlines() if "kernel:" in line]
    assert notes, err.getvalue()
    return np.asarray(h), notes[-1]


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_rules_match_jax_hessian(act: str) -> None:
    """Every activation with a rule: the Hessian, its diagonal and the Jacobian of the same
    pass against jax.hessian and jax.jacrev, with known inputs beside the unknowns."""
    with x64():
        one = mlp_with_known(ACTIVATIONS[act], seed=21)
        r = rng(22)
        x, h = r.normal(size=(11, 3)), r.normal(size=(11, 2))
        closed = jax_laplacian.trace(one, x[0], h[0])
        y, dy, hes = jax.vmap(lambda a, b: jax_laplacian.run_hessian(closed, a, b))(x, h)
        _, dy2, diag = jax.vmap(lambda a, b: jax_laplacian.run_diagonal(closed, a, b))(x, h)
        want = np.asarray(jax.vmap(jax.hessian(one))(x, h))  # (n, m, k, k)
        want_jac = np.asarray(jax.vmap(jax.jacrev(one))(x, h))
        np.testing.assert_allclose(np.asarray(y), np.asarray(jax.vmap(one)(x, h)), rtol=1e-12)
    got = np.moveaxis(np.asarray(hes), (1, 2), (-2, -1))  # (n, k, k, m) -> (n, m, k, k)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got, np.swapaxes(got, -1, -2), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.moveaxis(np.asarray(diag), 1, -1),
                               np.diagonal(want, axis1=-2, axis2=-1), rtol=1e-9, atol=1e-11)
    for d in (dy, dy2):
        np.testing.assert_allclose(np.moveaxis(np.asarray(d), 1, -1), want_jac, rtol=1e-10,
                                   atol=1e-12)
    off = want - np.diagonal(want, axis1=-2, axis2=-1)[..., None] * np.eye(3)
    assert np.abs(off).max() > 1e-2  # mixed terms present: a wrong pairing would fail


def test_a_constant_vector_times_a_varying_scalar() -> None:
    """``c * g(u)`` with ``c`` of length k and ``g`` a scalar: a ``mul`` of shapes (k,) and ()
    whose tangents must be broadcast before the product (they once met c's axis: a wrong
    Jacobian, silently, when the lengths matched)."""
    with x64():
        c = jnp.asarray([1.5, -2.0])

        def one(u: Any) -> Any:
            return c * jnp.sin(u[0] * u[1])

        u = jnp.asarray(rng(23).normal(size=2))
        closed = jax_laplacian.trace(one, u)
        for push in (jax_laplacian.run, jax_laplacian.run_diagonal, jax_laplacian.run_hessian):
            _, dy, _ = push(closed, u)
            np.testing.assert_allclose(np.asarray(dy).T, np.asarray(jax.jacfwd(one)(u)),
                                       rtol=1e-12)
        _, _, hes = jax_laplacian.run_hessian(closed, u)
        np.testing.assert_allclose(np.moveaxis(np.asarray(hes), -1, 0),
                                   np.asarray(jax.hessian(one)(u)), rtol=1e-12)


def test_auto_takes_the_forward_hessian_for_the_seed_shapes() -> None:
    """5 unknowns and 4 outputs (W6's shapes): auto picks forward over forward, the forward
    Hessian in one pass, equal to jax.hessian of the same function; the Jacobian of the same
    pass equals jax.jacrev."""
    r = rng(24)
    w1, w2 = r.normal(size=(8, 9)) * 0.6, r.normal(size=(9, 4)) * 0.6
    x, h = r.normal(size=(33, 5)), r.normal(size=(33, 3))
    with x64():
        wj1, wj2 = jnp.asarray(w1), jnp.asarray(w2)

        def f(z: Any) -> Any:
            return jnp.tanh(jnp.tanh(z @ wj1) @ wj2)

        def one(u: Any, c: Any) -> Any:
            return f(jnp.concatenate([u, c]))

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            jac, hes = batchjac.hessian(f, x, h, backend="jax", explain=True,
                                        return_jacobian=True)
        want = np.asarray(jax.vmap(jax.hessian(one))(x, h))
        want_jac = np.asarray(jax.vmap(jax.jacrev(one))(x, h))
    log = err.getvalue()
    assert "forward-over-forward" in log, log
    assert "a forward Hessian (one pass)" in log, log
    assert hes.shape == (33, 4, 5, 5)
    assert_jac_close(np.asarray(hes), want, factor=0.1)
    assert_jac_close(np.asarray(jac), want_jac, factor=0.1)


def test_a_quadratic_has_its_matrix_symmetrised() -> None:
    r = rng(25)
    a = r.normal(size=(4, 4))
    x = r.normal(size=(21, 4))
    with x64():
        am = jnp.asarray(a)
        hes, note = hessian_and_note(lambda z: jnp.einsum("ni,ij,nj->n", z, am, z), x,
                                     mode="forward-over-forward")
        diag, dnote = hessian_and_note(lambda z: jnp.einsum("ni,ij,nj->n", z, am, z), x,
                                       mode="forward-over-forward", diagonal=True)
    assert "a forward Hessian (one pass)" in note, note
    assert "a forward Hessian diagonal (one pass)" in dnote, dnote
    np.testing.assert_allclose(hes, np.broadcast_to(a + a.T, (21, 4, 4)), rtol=1e-12)
    np.testing.assert_allclose(diag, np.broadcast_to(2 * np.diag(a), (21, 4)), rtol=1e-12)


def test_rank_2_unknowns_match_finite_differences_of_the_analytic_jacobian() -> None:
    """Unknowns of shape (2, 3): the Hessian ``(N, m, 2, 3, 2, 3)`` equals central differences
    of the closed-form Jacobian of ``sin(W vec(u))``."""
    r = rng(26)
    w = r.normal(size=(2, 6)) * 0.8
    x = r.normal(size=(9, 2, 3))

    def jac(z: np.ndarray) -> np.ndarray:  # (n, 2, 2, 3)
        flat = z.reshape(len(z), 6)
        return (np.cos(flat @ w.T)[:, :, None] * w[None]).reshape(len(z), 2, 2, 3)

    with x64():
        wj = jnp.asarray(w)
        hes, note = hessian_and_note(lambda z: jnp.sin(z.reshape(len(z), 6) @ wj.T), x,
                                     mode="forward-over-forward")
    want = central_differences(jac, x)  # (n, 2, 2, 3, 2, 3)
    assert "a forward Hessian (one pass)" in note, note
    assert hes.shape == (9, 2, 2, 3, 2, 3)
    np.testing.assert_allclose(hes, want, rtol=1e-6, atol=1e-8)  # (the differences' own error)
    assert np.abs(want).max() > 0.1


def test_an_unsupported_primitive_falls_back_to_jacfwd_of_jacfwd_and_says_which() -> None:
    r = rng(27)
    w = r.normal(size=(3, 5))
    x = r.normal(size=(17, 3))
    with x64():
        wj = jnp.asarray(w)

        def one(z: Any) -> Any:
            return jnp.max(jnp.sin(z @ wj)) + jnp.tanh(z).sum()

        hes, note = hessian_and_note(jax.vmap(one), x, mode="forward-over-forward")
        want = np.asarray(jax.vmap(jax.hessian(one))(x))
    assert "jacfwd of jacfwd" in note, note
    assert "'reduce_max'" in note, note
    assert_jac_close(hes, want, factor=0.1)
    assert np.abs(want).max() > 0.1


def test_products_and_quotients_of_two_different_varying_values() -> None:
    """The product rule's cross terms ``ja_a jb_b + ja_b jb_a`` (asymmetric for two different
    values: an MLP's ``z * act(z)`` would not tell), for ``mul``, ``div`` and a matrix product
    of two varying operands."""
    r = rng(28)
    a, b, c = (r.normal(size=(4, 3)) for _ in range(3))
    x = r.normal(size=(13, 4))
    with x64():
        aj, bj, cj = map(jnp.asarray, (a, b, c))

        def one(u: Any) -> Any:
            p, q = jnp.sin(u @ aj), jnp.tanh(u @ bj)
            outer = jnp.outer(p, q) @ q  # dot_general of two varying operands
            return p * q / (1 + (u @ cj) ** 2) + outer

        closed = jax_laplacian.trace(one, x[0])
        _, _, hes = jax.vmap(lambda u: jax_laplacian.run_hessian(closed, u))(x)
        want = np.asarray(jax.vmap(jax.hessian(one))(x))
    np.testing.assert_allclose(np.moveaxis(np.asarray(hes), (1, 2), (-2, -1)), want,
                               rtol=1e-9, atol=1e-11)
