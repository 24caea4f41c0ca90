"""Inputs batchjac cannot take as they are, refused where inputs are first examined
(batchjac._validate.examine), by name, with what was received and the fix: float8 arrays of
every framework, sparse, ragged and meta-device tensors; bfloat16 and float16 inputs are
computed in float32 (widened, which is exact), and TensorFlow/Keras variables are taken as
their values.

References: the closed form of f(x) = tanh(x @ W), J[n] = diag(1 - tanh(x_n @ W)^2) W^T, in
float64, and TensorFlow's own ``GradientTape.batch_jacobian`` for the variables.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac import InputTypeError


def closed_form(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The Jacobian of tanh(x @ W) in each row of x, in float64."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    slope = 1 - np.tanh(x64 @ w64) ** 2
    return np.einsum("nj,ij->nji", slope, w64)


def assert_close(a: Any, ref: np.ndarray, rtol: float = 1e-5) -> None:
    a = np.asarray(a)
    assert a.shape == ref.shape, (a.shape, ref.shape)
    scale = float(np.abs(ref).max())
    assert scale > 0
    assert float(np.abs(a - ref).max()) <= rtol * scale, float(np.abs(a - ref).max()) / scale


def _data(seed: int, n: int = 7, d: int = 4, m: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(d, m)).astype(np.float32)


def _torch_model(w: np.ndarray) -> Any:
    torch = pytest.importorskip("torch")
    wt = torch.from_numpy(w)
    return lambda x: torch.tanh(x @ wt.to(x.dtype))


def _jax_model(w: np.ndarray) -> Any:
    jnp = pytest.importorskip("jax.numpy")
    wj = jnp.asarray(w)
    return lambda x: jnp.tanh(x @ wj.astype(x.dtype))


def _tf_model(w: np.ndarray) -> Any:
    tf = pytest.importorskip("tensorflow")
    wt = tf.constant(w)
    return lambda x: tf.tanh(tf.matmul(x, tf.cast(wt, x.dtype)))


def _array(kind: str, x: np.ndarray, dtype: str) -> Any:
    """``x`` rounded to ``dtype`` ("bfloat16", "float16", "float8_e4m3fn") as an array of
    ``kind``."""
    if kind == "torch":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(x).to(getattr(torch, dtype))
    if kind == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray(x).astype(getattr(jnp, dtype))
    if kind == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        return tf.cast(tf.constant(x), getattr(tf, dtype))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return x.astype(np.float16 if dtype == "float16" else getattr(ml_dtypes, dtype))


_MODELS = {"torch": _torch_model, "jax": _jax_model, "tensorflow": _tf_model}

#: (the array's kind, the model's framework, the cast a float8 message shows)
_HALF_CASES = [
    ("torch", "torch", "x.float()"),
    ("jax", "jax", "x.astype(jnp.float32)"),
    ("tensorflow", "tensorflow", "tf.cast(x, tf.float32)"),
    ("numpy", "torch", "x.astype(np.float32)"),
    ("numpy", "jax", "x.astype(np.float32)"),
    ("torch", "jax", "x.float()"),  # another framework's array: read to the host first
    ("jax", "torch", "x.astype(jnp.float32)"),
]


@pytest.mark.parametrize(("kind", "framework", "cast"), _HALF_CASES,
                         ids=[f"{k}-into-{f}" for k, f, _ in _HALF_CASES])
def test_half_precision_inputs_are_computed_in_float32(kind: str, framework: str,
                                                       cast: str) -> None:
    """bfloat16 was refused as "not real numbers" (or "ragged rows?") or failed inside torch's
    .numpy(), later refused by name; now bfloat16 and float16 inputs are widened to float32
    (exact) and computed there, against the closed form of the rounded values. float8 is
    refused by name, with the cast that makes it float32."""
    x, w = _data(4401)
    model = _MODELS[framework](w)
    for half in ("bfloat16", "float16"):
        given = _array(kind, x, half)
        rounded = np.asarray(_array("numpy", x, half)).astype(np.float32)
        assert np.abs(rounded - x).max() > 0  # (the rounding is real)
        jac = batchjac.jacobian(model, given, output="numpy")
        assert np.asarray(jac).dtype == np.float32
        assert_close(jac, closed_form(rounded, w))
        if kind != "numpy":  # a framework's tensor in: one of the same kind out
            out = batchjac.jacobian(model, given)
            assert type(out).__module__.split(".")[0] == type(given).__module__.split(".")[0]
    if kind in ("torch", "numpy"):
        with pytest.raises(InputTypeError) as e:
            batchjac.jacobian(model, _array(kind, x, "float8_e4m3fn"))
        text = str(e.value)
        assert text.startswith("`x` is float8_e4m3fn"), text
        assert cast in text, text
        assert "real numbers" not in text, text
        assert "ragged" not in text, text


def test_float8_anywhere_in_a_call_is_named_and_bfloat16_anywhere_widened() -> None:
    """The known input of (unknown, known), a dict's input, nested lists of ml_dtypes
    numbers; and every verb, since they all read inputs through the same place."""
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, w = _data(4402)
    wt = torch.from_numpy(w)
    model = _torch_model(w)
    f8 = torch.from_numpy(x[:, 2:]).to(torch.float8_e4m3fn)
    with pytest.raises(InputTypeError, match=r"^`known` is float8_e4m3fn.*known\.float\(\)"):
        batchjac.jacobian(model, torch.from_numpy(x[:, :2]), f8)
    with pytest.raises(InputTypeError,
                       match=r"^`inputs\['h'\]` is float8_e4m3fn.*inputs\['h'\]\.float\(\)"):
        batchjac.jacobian(lambda u, h: torch.tanh(torch.cat([u, h], -1) @ wt),
                          {"u": torch.from_numpy(x[:, :2]), "h": f8}, wrt="u")
    with pytest.raises(InputTypeError, match=r"^`x` holds float8_e4m3fn numbers"):
        batchjac.jacobian(model, [[ml_dtypes.float8_e4m3fn(v) for v in row] for row in x])
    with pytest.raises(InputTypeError, match=r"^`x` is float8_e4m3fn"):
        batchjac.jacobian(model, x.astype(ml_dtypes.float8_e4m3fn))
    for verb in (lambda v: batchjac.hessian(lambda v: torch.tanh(v @ wt).sum(-1), v),
                 lambda v: batchjac.check(model, v),
                 lambda v: batchjac.propagate(model, v, cov=np.eye(4))):
        with pytest.raises(InputTypeError, match=r"^`x` is float8_e4m3fn"):
            verb(torch.from_numpy(x).to(torch.float8_e4m3fn))
    # bfloat16 in the known input, a dict, nested lists: widened, the closed form's values
    bf = x.astype(ml_dtypes.bfloat16)
    rounded = bf.astype(np.float32)
    ref = closed_form(rounded, w)
    known = torch.from_numpy(x[:, 2:]).bfloat16()
    jac = batchjac.jacobian(model, torch.from_numpy(rounded[:, :2]), known, output="numpy")
    assert_close(jac, ref[:, :, :2])
    jac = batchjac.jacobian(lambda u, h: torch.tanh(torch.cat([u, h], -1) @ wt),
                            {"u": torch.from_numpy(rounded[:, :2]), "h": known}, wrt="u",
                            output="numpy")
    assert_close(jac, ref[:, :, :2])
    assert_close(batchjac.jacobian(model, [list(row) for row in bf]), ref)
    hess = batchjac.hessian(lambda v: torch.tanh(v @ wt).sum(-1), torch.from_numpy(x).bfloat16())
    assert hess.dtype == torch.float32
    assert hess.shape == (7, 4, 4)
