"""Inputs batchjac cannot take as they are, refused where inputs are first examined
(batchjac._validate.examine), by name, with what was received and the fix: bfloat16 and float8
arrays of every framework (float16 is computed in float32, as it always was), sparse, ragged
and meta-device tensors; and TensorFlow/Keras variables, which are taken as their values.

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

#: (the array's kind, the model's framework, the cast the message shows)
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
def test_bfloat16_is_refused_by_name_and_float16_is_computed(kind: str, framework: str,
                                                              cast: str) -> None:
    """bfloat16 was refused as "not real numbers" (or "ragged rows?") or failed inside torch's
    .numpy(); now it is named, with the cast that makes it float32. float16 of the same
    values is computed in float32, against the closed form of the rounded values."""
    x, w = _data(4401)
    model = _MODELS[framework](w)
    with pytest.raises(InputTypeError) as e:
        batchjac.jacobian(model, _array(kind, x, "bfloat16"))
    text = str(e.value)
    assert text.startswith("`x` is bfloat16"), text
    assert cast in text, text
    assert "real numbers" not in text
    assert "ragged" not in text
    half = _array(kind, x, "float16")
    rounded = x.astype(np.float16).astype(np.float32)
    jac = batchjac.jacobian(model, half, output="numpy")
    assert np.asarray(jac).dtype == np.float32
    assert_close(jac, closed_form(rounded, w))


def test_float8_and_bfloat16_anywhere_in_a_call_are_named() -> None:
    """The known input of (unknown, known), a dict's input, nested lists of ml_dtypes
    numbers, float8; and every verb, since they all read inputs through the same place."""
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, w = _data(4402)
    wt = torch.from_numpy(w)
    model = _torch_model(w)
    known = torch.from_numpy(x[:, 2:]).bfloat16()
    with pytest.raises(InputTypeError, match=r"^`known` is bfloat16.*known\.float\(\)"):
        batchjac.jacobian(lambda u: torch.tanh(u @ wt), torch.from_numpy(x[:, :2]), known)
    with pytest.raises(InputTypeError, match=r"^`inputs\['h'\]` is bfloat16.*inputs\['h'\]\.float\(\)"):
        batchjac.jacobian(lambda u, h: torch.tanh(torch.cat([u, h], -1) @ wt),
                          {"u": torch.from_numpy(x[:, :2]), "h": known}, wrt="u")
    rows = [[ml_dtypes.bfloat16(v) for v in row] for row in x]
    with pytest.raises(InputTypeError, match=r"^`x` holds bfloat16 numbers"):
        batchjac.jacobian(model, rows)
    with pytest.raises(InputTypeError, match=r"^`x` is float8_e4m3fn"):
        batchjac.jacobian(model, x.astype(ml_dtypes.float8_e4m3fn))
    with pytest.raises(InputTypeError, match=r"^`x` is float8_e4m3fn.*x\.float\(\)"):
        batchjac.jacobian(model, torch.from_numpy(x).to(torch.float8_e4m3fn))
    bf = torch.from_numpy(x).bfloat16()
    for verb in (lambda: batchjac.hessian(lambda v: torch.tanh(v @ wt).sum(-1), bf),
                 lambda: batchjac.check(model, bf),
                 lambda: batchjac.propagate(model, bf, cov=np.eye(4))):
        with pytest.raises(InputTypeError, match=r"^`x` is bfloat16"):
            verb()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_sparse_and_meta_torch_tensors_are_named() -> None:
    """A sparse tensor (COO, CSR) and a tensor on the 'meta' device failed inside torch
    (aten::as_strided, "Tensor.item() cannot be called on meta tensors"); now refused naming
    the argument, what it is and the fix, into a torch model or any other, in every verb."""
    torch = pytest.importorskip("torch")
    x, w = _data(4403)
    model = _torch_model(w)
    dense = torch.from_numpy(x)
    for sparse, layout in ((dense.to_sparse(), "sparse_coo"), (dense.to_sparse_csr(), "sparse_csr")):
        with pytest.raises(InputTypeError, match=rf"^`x` is a sparse tensor of layout torch\.{layout} "
                                                 rf"\(a torch\.Tensor of shape \(7, 4\)\).*x\.to_dense\(\)"):
            batchjac.jacobian(model, sparse)
        with pytest.raises(InputTypeError, match=r"`x` is a sparse tensor.*x\.to_dense\(\)"):
            batchjac.propagate(model, sparse, cov=np.eye(4))
    meta = torch.empty(7, 4, device="meta")
    with pytest.raises(InputTypeError, match=r"^`x` is a tensor on the 'meta' device.*no values"):
        batchjac.jacobian(model, meta)
    with pytest.raises(InputTypeError, match=r"^`known` is a tensor on the 'meta' device"):
        batchjac.jacobian(lambda u: torch.tanh(u @ torch.from_numpy(w)), dense[:, :2],
                          torch.empty(7, 2, device="meta"))
    with pytest.raises(InputTypeError, match=r"^`x` is a tensor on the 'meta' device"):
        batchjac.check(model, meta)
    # the dense tensor is computed: the checks let it through
    assert_close(batchjac.jacobian(model, dense.to_sparse().to_dense()), closed_form(x, w))
    jnp = pytest.importorskip("jax.numpy")
    wj = jnp.asarray(w)
    with pytest.raises(InputTypeError, match=r"^`x` is a sparse tensor of layout torch\.sparse_coo"):
        batchjac.jacobian(lambda v: jnp.tanh(v @ wj), dense.to_sparse())


def test_sparse_arrays_of_other_kinds_are_named() -> None:
    """SciPy's sparse matrices were read as a 0-d object array ("not real numbers (ragged
    rows?)"), TensorFlow's SparseTensor failed in tf.convert_to_tensor, JAX's BCOO was an
    object array: each is named with its own way to make it dense."""
    torch = pytest.importorskip("torch")
    x, w = _data(4404)
    model = _torch_model(w)
    del torch
    sp = pytest.importorskip("scipy.sparse")
    with pytest.raises(InputTypeError, match=r"^`x` is a sparse matrix.*x\.toarray\(\)"):
        batchjac.jacobian(model, sp.csr_matrix(x))
    tf = pytest.importorskip("tensorflow")
    with pytest.raises(InputTypeError, match=r"^`x` is a sparse tensor.*tf\.sparse\.to_dense\(x\)"):
        batchjac.jacobian(_tf_model(w), tf.sparse.from_dense(x))
    jsparse = pytest.importorskip("jax.experimental.sparse")
    with pytest.raises(InputTypeError, match=r"^`x` is a sparse array.*x\.todense\(\)"):
        batchjac.jacobian(_jax_model(w), jsparse.BCOO.fromdense(x))


def _tape_jacobian(model: Any, x: np.ndarray) -> np.ndarray:
    """TensorFlow's own per-row Jacobian of ``model`` at ``x``."""
    tf = pytest.importorskip("tensorflow")
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = model(xt)
    return np.asarray(tape.batch_jacobian(y, xt))


def test_a_tf_variable_is_taken_as_its_value() -> None:
    """A tf.Variable worked as the whole input but failed with wrt columns and in the
    (unknown, known) form ("'ResourceVariable' object has no attribute 'ndim'"), and a
    keras.Variable failed at once ("'str' object has no attribute 'as_numpy_dtype'"): each is
    now read as its value, and the Jacobians are TensorFlow's own."""
    tf = pytest.importorskip("tensorflow")
    x, w = _data(4405, n=6, d=4, m=3)
    model = _tf_model(w)
    ref = _tape_jacobian(model, x)
    assert_close(ref, closed_form(x, w))  # (the reference itself, against the closed form)
    var = tf.Variable(x)
    assert_close(batchjac.jacobian(model, var), ref)
    assert_close(batchjac.jacobian(model, var, wrt=[0, 2]), ref[..., [0, 2]])
    assert_close(batchjac.jacobian(model, var, mode="forward", chunk_size=4), ref)
    assert_close(batchjac.jacobian(model, tf.Variable(x[:, :3]), tf.Variable(x[:, 3:])),
                 ref[..., :3])
    assert_close(batchjac.jacobian(lambda a, b: model(tf.concat([a, b], -1)),
                                   {"a": tf.Variable(x[:, :1]), "b": tf.Variable(x[:, 1:])},
                                   wrt="b"), ref[..., 1:])
    assert_close(batchjac.jacobian(_torch_model(w), var), ref)  # into another framework
    var.assign(x[::-1].copy())  # the value at the call, not a copy taken earlier
    assert_close(batchjac.jacobian(model, var), ref[::-1])
    keras = pytest.importorskip("keras")
    if keras.backend.backend() == "tensorflow":
        assert_close(batchjac.jacobian(model, keras.Variable(x)), ref)
