"""Not twice differentiable is an error, not a zero (issue 33, item 3).

A model whose gradient autograd cannot differentiate again (a torch ``autograd.Function`` whose
backward is ``@once_differentiable``, a TensorFlow ``tf.custom_gradient`` whose gradient
function escapes the tape, a JAX ``custom_vjp`` in forward mode) must give its true second
derivatives or a clear error, never zeros read as "the gradient is constant". A model whose
gradient *is* constant (linear) still gets exact zeros.

The model throughout: ``x**3`` elementwise (2 unknowns, 2 outputs), whose per-instance Hessian
of output ``o`` is ``6 x_o`` at ``(o, o)`` and zero elsewhere.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import pytest

import batchjac

X = np.array([[1.0, 2.0], [-1.5, 0.5], [3.0, -2.0], [0.25, 1.25]])
MODES = ("auto", "forward-over-reverse", "forward-over-forward")
KINDS = ("hessian", "diagonal", "laplacian", "hvp")
V = np.array([[1.0, -1.0], [0.5, 2.0], [-1.0, 1.0], [2.0, 0.5]])


def true_second(kind: str, x: np.ndarray = X) -> np.ndarray:
    """The cube's result of ``kind`` for the rows ``x``."""
    n, k = x.shape
    h = np.zeros((n, k, k, k))  # (row, output, unknown, unknown)
    for o in range(k):
        h[:, o, o, o] = 6 * x[:, o]
    if kind == "hessian":
        return h
    diag = np.diagonal(h, axis1=-2, axis2=-1)
    if kind == "diagonal":
        return diag
    if kind == "laplacian":
        return diag.sum(-1)
    return np.einsum("noij,nj->noi", h, V)


def second(model: Any, kind: str, mode: str, x: np.ndarray = X, **options: Any) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fallback warnings of the first-order probes)
        if kind == "hvp":
            v = V.astype(x.dtype)
            return np.asarray(batchjac.hvp(model, x, v=v, mode=mode, **options))
        return np.asarray(batchjac.hessian(model, x, mode=mode, diagonal=kind == "diagonal",
                                           laplacian=kind == "laplacian", **options))


def true_or_clear_error(model: Any, kind: str, mode: str, error: str, x: np.ndarray = X,
                        rtol: float = 1e-6, **options: Any) -> str:
    """The true result (``"true"``) or a ModelError matching ``error`` (``"error"``); a zero or
    any other wrong result fails."""
    try:
        got = second(model, kind, mode, x, **options)
    except batchjac.ModelError as e:
        text = str(e)
    else:
        np.testing.assert_allclose(got, true_second(kind, x.astype(np.float64)), rtol=rtol,
                                   atol=rtol * 1e-3)
        return "true"
    assert re.search(error, text, re.S), text
    return "error"


# ---- PyTorch ------------------------------------------------------------------------------


def _torch_cubes() -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    from torch.autograd.function import once_differentiable

    class OldStyle(torch.autograd.Function):
        """forward(ctx, x): torch.func refuses it; plain autograd takes it."""

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        @once_differentiable
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

    class FuncForm(torch.autograd.Function):
        """torch.func's form with a jvp: torch.func differentiates the backward in forward
        mode, once_differentiable or not."""

        generate_vmap_rule = True

        @staticmethod
        def forward(x: Any) -> Any:
            return x**3

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            ctx.save_for_backward(inputs[0])
            ctx.save_for_forward(inputs[0])

        @staticmethod
        @once_differentiable
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

        @staticmethod
        def jvp(ctx: Any, t: Any) -> Any:
            (x,) = ctx.saved_tensors
            return 3 * x**2 * t

    class Twice(torch.autograd.Function):
        """A backward autograd records: twice differentiable by plain autograd."""

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

    return {"old": OldStyle, "func": FuncForm, "twice": Twice}


def _torch_model(function: Any, tail: str = "") -> Any:
    import torch

    class Model(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            y = function.apply(x)
            if tail == "mixed":  # also a differentiable path: the Hessian would be half-wrong
                return y + 0 * x * x
            return y

    return Model()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tail", ["", "mixed"])
def test_torch_once_differentiable_is_never_a_zero(kind: str, mode: str, tail: str) -> None:
    """The once-differentiable cube gave all-zero Hessians, diagonals and products through
    plain autograd (its gradient does not require grad, read as constant)."""
    model = _torch_model(_torch_cubes()["old"], tail)
    outcome = true_or_clear_error(model, kind, mode,
                                  r"OldStyle.*(once_differentiable|forward-over-forward)")
    if mode == "forward-over-forward":
        assert outcome == "error"


def test_torch_once_differentiable_error_says_what_to_do() -> None:
    model = _torch_model(_torch_cubes()["old"])
    with pytest.raises(batchjac.ModelError) as info:
        second(model, "hessian", "forward-over-reverse")
    text = str(info.value)
    assert "not twice differentiable" in text
    assert "OldStyle" in text
    assert "@once_differentiable" in text
    assert "batchjac.jacobian" in text
    jac = batchjac.jacobian(model, X)  # first order: fine as it is
    np.testing.assert_allclose(np.asarray(jac)[:, [0, 1], [0, 1]], 3 * X**2)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_func_form_gives_the_true_hessian(kind: str) -> None:
    """A once-differentiable backward of a Function in torch.func's form: torch.func's forward
    over reverse differentiates it, and that is the build taken (plain autograd gave zeros)."""
    model = _torch_model(_torch_cubes()["func"])
    for mode in ("auto", "forward-over-reverse"):
        if mode == "auto" and kind in ("diagonal", "laplacian"):
            continue  # (auto may take forward over forward there: covered below)
        np.testing.assert_allclose(second(model, kind, mode), true_second(kind), rtol=1e-6,
                                   atol=1e-9)
    # torch's nested forward mode loses a custom jvp's second-order terms: an error, not zeros
    assert true_or_clear_error(model, kind, "forward-over-forward",
                               r"forward-over-forward.*FuncForm.*forward-over-reverse") in (
        "error", "true")


@pytest.mark.parametrize("kind", KINDS)
def test_torch_twice_differentiable_function_and_linear_model(kind: str) -> None:
    """What worked still works: a Function whose backward autograd records, and a linear
    model, whose gradient is constant, gets exact zeros."""
    torch = pytest.importorskip("torch")

    model = _torch_model(_torch_cubes()["twice"])
    np.testing.assert_allclose(second(model, kind, "forward-over-reverse"), true_second(kind),
                               rtol=1e-6, atol=1e-9)
    linear = torch.nn.Linear(2, 2).double()
    for mode in MODES:
        got = second(linear, kind, mode)
        assert got.shape == true_second(kind).shape
        assert not np.any(got)


def test_torch_auto_takes_forward_over_reverse_where_forward_over_forward_cannot() -> None:
    """mode="auto" picks forward over forward for more outputs than unknowns; through a custom
    Function that order is refused (torch's nested forward mode loses its second-order terms),
    and auto then computes forward over reverse, for this call and the next."""
    torch = pytest.importorskip("torch")

    twice = _torch_cubes()["twice"]

    class Wide(torch.nn.Module):  # 2 unknowns, 6 outputs: [cube, 2 cube, x]
        def forward(self, x: Any) -> Any:
            y = twice.apply(x)
            return torch.cat([y, 2 * y, x], dim=1)

    h = true_second("hessian")
    want = np.concatenate([h, 2 * h, np.zeros_like(h)], axis=1)
    for _ in range(2):
        np.testing.assert_allclose(second(Wide(), "hessian", "auto"), want, rtol=1e-6, atol=1e-9)
    with pytest.raises(batchjac.ModelError, match="mode='forward-over-reverse'"):
        second(Wide(), "hessian", "forward-over-forward")


# ---- TensorFlow -----------------------------------------------------------------------------


def _tf_cube(gradient: str) -> Any:
    tf = pytest.importorskip("tensorflow")

    @tf.custom_gradient
    def cube(x: Any) -> Any:
        def grad(dy: Any) -> Any:
            if gradient == "stop":  # the gradient's dependence on x hidden from the tape
                return dy * 3 * tf.stop_gradient(x) ** 2
            if gradient == "numpy":
                return dy * tf.numpy_function(lambda a: 3 * a**2, [x], x.dtype)
            return dy * 3 * x**2

        return x**3, grad

    return cube


@pytest.mark.parametrize("gradient", ["stop", "numpy"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_tf_gradient_function_not_differentiable_is_an_error(gradient: str, kind: str,
                                                             mode: str) -> None:
    """Every build read the second tape's "no path" as zeros (UnconnectedGradients.ZERO)."""
    model = _tf_cube(gradient)
    for _ in range(2):  # a second call (the kernel kept) refuses too
        with pytest.raises(batchjac.ModelError, match=r"not twice differentiable.*custom_gradient"):
            second(model, kind, mode, backend="tensorflow")


@pytest.mark.parametrize("kind", KINDS)
def test_tf_differentiable_gradient_and_constant_gradients(kind: str) -> None:
    """A gradient function written with TensorFlow operations gives the true Hessian; a linear
    model and a ReLU network (second derivatives zero where they exist) give zeros."""
    keras = pytest.importorskip("keras")
    assert true_or_clear_error(_tf_cube("good"), kind, "auto", "^$", backend="tensorflow") == "true"
    relu = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(2)])
    linear = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    for model in (relu, linear):
        for mode in MODES:
            got = second(model, kind, mode, X.astype(np.float32))
            assert got.shape == true_second(kind).shape
            assert not np.any(got)


# ---- JAX ------------------------------------------------------------------------------------


def _jax_cube() -> Any:
    jax = pytest.importorskip("jax")

    @jax.custom_vjp
    def cube(x: Any) -> Any:
        return x**3

    cube.defvjp(lambda x: (x**3, x), lambda x, g: (3 * x**2 * g,))
    return cube


@pytest.mark.parametrize("kind", KINDS)
def test_jax_custom_vjp_gives_the_true_hessian_or_a_clear_error(kind: str) -> None:
    """JAX has no forward mode through a custom_vjp: forward over forward (which mode="auto"
    took for the full Hessian, its diagonal and the Laplacian here) failed with "Calling the
    model failed: TypeError: can't apply forward-mode autodiff (jvp) to a custom_vjp function"
    (or "Differentiation rule for 'custom_lin' not implemented"). Now auto computes forward
    over reverse (the forward derivative of the vjp rule: the true Hessian), and the order
    asked for explicitly says why it cannot and what to pass."""
    cube = _jax_cube()
    x = X.astype(np.float32)
    for mode in ("auto", "forward-over-reverse"):
        assert true_or_clear_error(cube, kind, mode, "^$", x=x, rtol=1e-5) == "true"
    with pytest.raises(batchjac.ModelError,
                       match=r"forward-over-forward.*custom_vjp.*mode='forward-over-reverse'"):
        second(cube, kind, "forward-over-forward", x)


def test_jax_linear_model_gives_zeros() -> None:
    jnp = pytest.importorskip("jax.numpy")
    w = jnp.asarray([[1.0, 2.0], [3.0, -1.0]], dtype=jnp.float32)
    for kind in KINDS:
        for mode in MODES:
            got = second(lambda x: x @ w, kind, mode, X.astype(np.float32))
            assert got.shape == true_second(kind).shape
            assert not np.any(got)
