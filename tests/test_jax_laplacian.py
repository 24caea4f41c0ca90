"""The forward Laplacian of JAX functions (batchjac._backends.jax_laplacian) and the JAX
Laplacian kernel that uses it (order forward-over-forward).

References, all in float64: closed forms (``sum(sin x)`` has Laplacian ``-sum(sin x)``, a
quadratic ``x^T A x`` has ``2 tr(A)``), central differences of an analytic Jacobian, and
the trace of ``jax.hessian`` (with ``jax.jacrev`` for the Jacobian) on the same function.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import assert_jac_close, central_differences, jax_x64, rng

jax = pytest.importorskip("jax")
jnp = jax.numpy

from batchjac._backends.jax import JaxSecondKernel, laplacian as jax_laplacian  # noqa: E402

x64 = jax_x64


def native_laplacian(one: Callable[..., Any], *arrays: np.ndarray) -> np.ndarray:
    """The trace of ``jax.hessian`` of one instance's function, vmapped over the rows
    (over the first argument's features, flattened)."""
    def lap(u: Any, *rest: Any) -> Any:
        h = jax.hessian(one)(u, *rest)
        k = u.size
        return jnp.trace(h.reshape((*h.shape[:h.ndim - 2 * u.ndim], k, k)), axis1=-2, axis2=-1)

    return np.asarray(jax.vmap(lap)(*arrays))


def laplacian_and_note(f: Any, *arrays: np.ndarray, **options: Any) -> tuple[np.ndarray, str]:
    """``batchjac.laplacian`` and the kernel line of its ``explain``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        lap = batchjac.laplacian(f, *arrays, backend="jax", explain=True, **options)
    notes = [line for line in err.getvalue().splitlines() if "kernel:" in line]
    assert notes, err.getvalue()
    return np.asarray(lap), notes[-1]


#: the activations with a rule, each by the primitives JAX writes for it
ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,  # logistic
    "sin": jnp.sin,
    "cos": jnp.cos,
    "exp": lambda z: jnp.exp(-z * z),
    "softplus": jax.nn.softplus,  # jit, custom_jvp_call, max, abs, exp, log1p, select_n
    "gelu": jax.nn.gelu,  # integer_pow, tanh, mul
    "relu": lambda z: jax.nn.relu(z) * z,  # custom_jvp_call of max (times z: curved)
    "sqrt": lambda z: jnp.sqrt(1 + z * z),
    "rsqrt": lambda z: jax.lax.rsqrt(2 + z * z),
    "log": lambda z: jnp.log(1 + z * z),
    "quotient": lambda z: z / (1 + z * z),  # div of two varying values
    "pow": lambda z: (1 + z * z) ** 0.7,  # pow with a constant exponent
    "power of a varying base and exponent": lambda z: (2 + jnp.sin(z)) ** jnp.cos(z),
    "square": lambda z: jnp.square(z) + z ** 3,
    "erf": jax.scipy.special.erf,
    "swish": jax.nn.swish,  # a product of two varying values
}


def mlp_with_known(act: Callable[[Any], Any], seed: int) -> Callable[[Any, Any], Any]:
    """One instance: 3 unknowns and 2 known inputs concatenated, two layers of ``act``."""
    r = rng(seed)
    w1, b1 = jnp.asarray(r.normal(size=(5, 7)) * 0.7), jnp.asarray(r.normal(size=7) * 0.2)
    w2, b2 = jnp.asarray(r.normal(size=(7, 6)) * 0.5), jnp.asarray(r.normal(size=6) * 0.2)
    w3 = jnp.asarray(r.normal(size=(6, 2)) * 0.5)

    def one(x: Any, h: Any) -> Any:
        z = act(jnp.concatenate([x, h]) @ w1 + b1)
        return act(z @ w2 + b2) @ w3

    return one


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_rules_match_the_trace_of_jax_hessian(act: str) -> None:
    with x64():
        one = mlp_with_known(ACTIVATIONS[act], seed=1)
        r = rng(2)
        x, h = r.normal(size=(13, 3)), r.normal(size=(13, 2))
        closed = jax_laplacian.trace(one, x[0], h[0])
        y, dy, lap = jax.vmap(lambda a, b: jax_laplacian.run(closed, a, b))(x, h)
        want_lap = native_laplacian(one, x, h)
        want_jac = np.asarray(jax.vmap(jax.jacrev(one))(x, h))
        np.testing.assert_allclose(np.asarray(y), np.asarray(jax.vmap(one)(x, h)),
                                   rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.moveaxis(np.asarray(dy), 1, -1), want_jac, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lap), want_lap, rtol=1e-9, atol=1e-11)
    assert np.abs(want_lap).max() > 1e-2  # curved: the test could fail


def test_the_kernel_matches_jax_hessian_with_known_inputs() -> None:
    """``batchjac.laplacian(model, unknown, known)`` of a batch function whose known inputs
    are concatenated inside: the trace of jax.hessian, by the forward Laplacian."""
    with x64():
        one = mlp_with_known(jnp.tanh, seed=3)
        r = rng(4)
        x, h = r.normal(size=(29, 3)), r.normal(size=(29, 2))
        lap, note = laplacian_and_note(lambda z: jax.vmap(lambda row: one(row[:3], row[3:]))(z),
                                       x, h)
        want = native_laplacian(one, x, h)
    assert "a forward Laplacian (one pass)" in note, note
    assert_jac_close(lap, want, factor=0.1)


def test_sum_sin_has_its_closed_form() -> None:
    x = rng(5).normal(size=(40, 4)) * 2
    with x64():
        lap, note = laplacian_and_note(lambda z: jnp.sin(z).sum(-1), x)
    assert "a forward Laplacian" in note, note
    assert_jac_close(lap, -np.sin(x).sum(-1), factor=0.1)


def test_a_quadratic_has_twice_the_trace_of_its_matrix() -> None:
    r = rng(6)
    a = r.normal(size=(4, 4))
    x = r.normal(size=(25, 4))
    with x64():
        am = jnp.asarray(a)
        lap, note = laplacian_and_note(lambda z: jnp.einsum("ni,ij,nj->n", z, am, z), x)
    assert "a forward Laplacian" in note, note
    np.testing.assert_allclose(lap, np.full(25, 2 * np.trace(a)), rtol=1e-12)
    assert abs(np.trace(a)) > 0.1


def test_matches_finite_differences_of_an_analytic_jacobian() -> None:
    """A tanh MLP's Jacobian in closed form, ``W2^T diag(1 - tanh^2(z)) W1^T``; its central
    differences along each unknown, summed over the diagonal, are the Laplacian."""
    r = rng(7)
    w1, b1, w2 = r.normal(size=(3, 9)) * 0.8, r.normal(size=9) * 0.3, r.normal(size=(9, 2)) * 0.8
    x = r.normal(size=(31, 3))

    def analytic_jacobian(z: np.ndarray) -> np.ndarray:  # (n, 2 * 3): J[n, o, j] flattened
        s = 1 - np.tanh(z @ w1 + b1) ** 2
        return np.einsum("ja,na,ao->noj", w1, s, w2).reshape(len(z), -1)

    dj = central_differences(analytic_jacobian, x).reshape(31, 2, 3, 3)
    want = np.trace(dj, axis1=-2, axis2=-1)
    with x64():
        w1j, b1j, w2j = map(jnp.asarray, (w1, b1, w2))
        lap, _ = laplacian_and_note(lambda z: jnp.tanh(z @ w1j + b1j) @ w2j, x)
    np.testing.assert_allclose(lap, want, rtol=1e-6, atol=1e-8)  # (the differences' own error)
    assert np.abs(want).max() > 0.1


def test_rank_2_unknowns() -> None:
    """Unknowns of shape (2, 3) contracted over both axes: the Laplacian over all 6."""
    r = rng(8)
    w = r.normal(size=(2, 3, 4)) * 0.6
    x = r.normal(size=(11, 2, 3))
    with x64():
        wj = jnp.asarray(w)

        def one(z: Any) -> Any:
            return jnp.sin(jnp.einsum("ij,ijo->o", z, wj)) * jnp.tanh(z).sum()

        lap, note = laplacian_and_note(jax.vmap(one), x)
        want = native_laplacian(one, x)
    assert lap.shape == (11, 4)
    assert "a forward Laplacian" in note, note
    assert_jac_close(lap, want, factor=0.1)


def test_per_instance_model_and_jacobian_from_the_same_pass() -> None:
    with x64():
        one = mlp_with_known(jax.nn.sigmoid, seed=9)
        r = rng(10)
        x, h = r.normal(size=(17, 3)), r.normal(size=(17, 2))
        y, jac, lap = batchjac.hessian(lambda z: one(z[:3], z[3:]), x, h, laplacian=True,
                                       return_jacobian=True, return_outputs=True, backend="jax",
                                       backend_options={"per_instance": True})
        want_lap = native_laplacian(one, x, h)
        want_jac = np.asarray(jax.vmap(jax.jacrev(one))(x, h))
        want_y = np.asarray(jax.vmap(one)(x, h))
    assert_jac_close(lap, want_lap, factor=0.1)
    assert_jac_close(jac, want_jac, factor=0.1)
    assert_jac_close(y, want_y, factor=0.1)


def test_chunks_in_blocks_equal_the_reference(monkeypatch: Any) -> None:
    """A chunk computed in blocks (the last one padded with copies of the last row), with
    known inputs split alike: the Laplacian's blocks and the Hessian's (their own size)."""
    monkeypatch.setattr(JaxSecondKernel, "LAPLACIAN_BLOCK_ROWS", 4)
    monkeypatch.setattr(JaxSecondKernel, "HESSIAN_BLOCK_ROWS", 5)
    r = rng(11)
    x, h = r.normal(size=(37, 3)) * 2, r.normal(size=(37, 2))
    with x64():
        one = mlp_with_known(jnp.tanh, seed=13)
        f = jax.vmap(lambda row: one(row[:3], row[3:]))
        lap, note = laplacian_and_note(f, x, h)
        want = native_laplacian(one, x, h)
        hess = np.asarray(batchjac.hessian(f, x, h, backend="jax"))
        want_h = np.asarray(jax.vmap(jax.hessian(one))(x, h))
    assert "a forward Laplacian" in note, note
    assert_jac_close(lap, want, factor=0.1)
    np.testing.assert_allclose(hess, want_h, rtol=1e-9, atol=1e-11)
    assert JaxSecondKernel._block_rows("hessian", "forward-over-forward", 37) == 5
    assert JaxSecondKernel._block_rows("laplacian", "forward-over-forward", 37) == 4


def test_one_block_shape_is_compiled_and_jax_arrays_stay_jax(monkeypatch: Any) -> None:
    """The executable is compiled for one block of rows (evened over the chunk) and called
    once a block: a chunk of 37 rows in blocks of 4 calls it 10 times on ``(4, 3)``, the last
    block padded; JAX arrays in give JAX arrays out, equal to the numpy path's values (a
    kernel without the Jacobian: the same to rounding) and to the trace of ``jax.hessian``;
    the Jacobian and outputs from the same pass are cut alike."""
    monkeypatch.setattr(JaxSecondKernel, "LAPLACIAN_BLOCK_ROWS", 4)
    shapes: list[tuple[int, ...]] = []
    real_init = JaxSecondKernel.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        fn = self._fn

        def counted(params: Any, u: Any, ctx: Any) -> Any:
            shapes.append(tuple(u.shape))
            return fn(params, u, ctx)

        self._fn = counted

    monkeypatch.setattr(JaxSecondKernel, "__init__", spy)
    r = rng(14)
    x = r.normal(size=(37, 3)) * 1.5
    with x64():
        w = jnp.asarray(r.normal(size=(3, 6)))
        v = jnp.asarray(r.normal(size=(6, 2)))

        def one(z: Any) -> Any:
            return jnp.tanh(z @ w) @ v

        f = jax.vmap(one)
        y, jac, lap = batchjac.laplacian(f, jnp.asarray(x), backend="jax",
                                         return_jacobian=True, return_outputs=True)
        want = native_laplacian(one, x)
        want_jac = np.asarray(jax.vmap(jax.jacrev(one))(x))
        from_numpy = np.asarray(batchjac.laplacian(f, x, backend="jax"))
        want_y = np.asarray(f(jnp.asarray(x)))
    assert isinstance(lap, jax.Array), type(lap)
    assert isinstance(jac, jax.Array), type(jac)
    assert (lap.shape, jac.shape, y.shape) == ((37, 2), (37, 2, 3), (37, 2))
    assert set(shapes) == {(4, 3)}, shapes
    assert len(shapes) == 2 * 10, shapes
    assert_jac_close(np.asarray(lap), want, factor=0.1)
    assert_jac_close(np.asarray(jac), want_jac, factor=0.1)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-12)
    np.testing.assert_allclose(from_numpy, np.asarray(lap), rtol=1e-12, atol=1e-14)


def test_an_unsupported_primitive_falls_back_to_jvp_of_jvp_and_says_which() -> None:
    """``jnp.max`` (reduce_max) has no rule: the kernel computes jvp of jvp, the same values
    as jax.hessian, and the note names the primitive."""
    r = rng(12)
    w = r.normal(size=(3, 5))
    x = r.normal(size=(19, 3))
    with x64():
        wj = jnp.asarray(w)

        def one(z: Any) -> Any:
            return jnp.max(jnp.sin(z @ wj)) + jnp.tanh(z).sum()

        closed = jax_laplacian.trace(one, x[0])
        with pytest.raises(jax_laplacian.Unsupported, match="reduce_max"):
            jax_laplacian.run(closed, jnp.asarray(x[0]))
        lap, note = laplacian_and_note(jax.vmap(one), x)
        want = native_laplacian(one, x)
    assert "jvp of jvp" in note, note
    assert "'reduce_max'" in note, note
    assert_jac_close(lap, want, factor=0.1)
    assert np.abs(want).max() > 0.1


def test_constant_output_has_zero_derivatives() -> None:
    """An output that does not depend on the unknowns: zeros, not an error."""
    with x64():
        closed = jax_laplacian.trace(lambda u, h: jnp.sin(h) * 2.0, jnp.ones(3), jnp.ones(2))
        y, dy, lap = jax_laplacian.run(closed, jnp.ones(3), jnp.full(2, 0.5))
    np.testing.assert_allclose(np.asarray(y), 2 * np.sin(np.full(2, 0.5)))
    assert dy.shape == (3, 2)
    assert not np.asarray(dy).any()
    assert lap.shape == (2,)
    assert not np.asarray(lap).any()


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_a_float32_function_stays_float32_under_x64(act: str) -> None:
    """No rule's constant promotes a float32 function's derivatives to float64 (x64 on)."""
    with x64():
        r = rng(14)
        w = jnp.asarray(r.normal(size=(3, 4)).astype(np.float32))

        def one(z: Any) -> Any:
            return ACTIVATIONS[act](z @ w)

        x = jnp.asarray(r.normal(size=3).astype(np.float32))
        y, dy, lap = jax_laplacian.run(jax_laplacian.trace(one, x), x)
        want = native_laplacian(one, np.asarray(x)[None])[0]
    assert (y.dtype, dy.dtype, lap.dtype) == (np.float32,) * 3
    np.testing.assert_allclose(np.asarray(lap), want, rtol=1e-4, atol=1e-5)


def test_a_convolution_over_image_unknowns() -> None:
    """A small CNN (conv_general_dilated, NHWC, stride 2, tanh, a dense layer) over unknown
    images of shape (6, 6, 1): the Laplacian over all 36 pixels."""
    r = rng(15)
    kern = r.normal(size=(3, 3, 1, 2)) * 0.5
    dense = r.normal(size=(8, 3)) * 0.4
    x = r.normal(size=(7, 6, 6, 1))
    with x64():
        kj, dj = jnp.asarray(kern), jnp.asarray(dense)

        def one(img: Any) -> Any:
            z = jax.lax.conv_general_dilated(img[None], kj, (2, 2), "VALID",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jnp.sin(jnp.tanh(z).reshape(-1) @ dj)

        lap, note = laplacian_and_note(jax.vmap(one), x)
        want = native_laplacian(one, x)
    assert lap.shape == (7, 3)
    assert "a forward Laplacian" in note, note
    assert_jac_close(lap, want, factor=0.1)
    assert np.abs(want).max() > 0.1


def test_the_cpu_options_reach_xla_and_an_xla_without_them_compiles_the_next(
        monkeypatch: Any) -> None:
    """On the CPU the second-order kernel asks XLA for its options (the fusion emitters off;
    the forward Laplacian's products alone in YNNPACK calls). An XLA that refuses an option
    (here made-up ones) compiles the kernel with the next set, the last its defaults: the
    Laplacian and the Hessian are still the trace of ``jax.hessian`` and ``jax.hessian``.
    An XLA that knows neither option (jaxlib 0.4.36) refuses every set but the last."""
    from batchjac._backends.jax import compat, executables as jax_executables

    if jax.default_backend() != "cpu":
        pytest.skip("the options are the CPU's")
    asked: list[dict[str, Any]] = []
    real = jax_executables.compile

    def spy(lowered: Any, options: Any = None, **kw: Any) -> Any:
        asked.append(dict(options or {}))
        return real(lowered, options, **kw)

    monkeypatch.setattr(jax_executables, "compile", spy)
    r = rng(21)
    x = r.normal(size=(23, 3))
    ynn = "xla_cpu_experimental_ynn_fusion_type"
    with x64():
        w = jnp.asarray(r.normal(size=(3, 5)))

        def one(z: Any) -> Any:
            return jnp.tanh(z @ w).sum() + (z ** 3).sum()

        want = native_laplacian(one, x)
        lap = np.asarray(batchjac.laplacian(jax.vmap(one), x, backend="jax"))
        preferred = {**JaxSecondKernel.CPU_OPTIONS, ynn: JaxSecondKernel.LAPLACIAN_YNN[0]}
        knows = compat.xla_accepts(preferred)
        if knows:
            assert asked == [preferred]
        else:  # refused, then the next set (no YNNPACK fusions: refused too), XLA's defaults
            assert asked == [preferred, {**JaxSecondKernel.CPU_OPTIONS, ynn: ""}, {}], asked
        assert_jac_close(lap, want, factor=0.1)
        # a fusion type this XLA does not know: the next, without YNNPACK's fusions
        monkeypatch.setattr(JaxSecondKernel, "LAPLACIAN_YNN", ("NO_SUCH_FUSION_TYPE", ""))
        asked.clear()
        lap = np.asarray(batchjac.laplacian(jax.vmap(lambda z: one(z) * 3), x, backend="jax"))
        assert [a.get(ynn) for a in asked] == ["NO_SUCH_FUSION_TYPE", ""] + [None] * (not knows), asked
        assert_jac_close(lap, 3 * want, factor=0.1)
        monkeypatch.setattr(JaxSecondKernel, "CPU_OPTIONS", {"xla_no_such_option_here": True})
        asked.clear()
        hess = np.asarray(batchjac.hessian(jax.vmap(lambda z: one(z) * 2), x, backend="jax"))
        want_h = np.asarray(jax.vmap(jax.hessian(lambda z: one(z) * 2))(x))
    assert asked == [{"xla_no_such_option_here": True}, {}], asked  # refused: the defaults
    np.testing.assert_allclose(hess, want_h, rtol=1e-9, atol=1e-11)
