"""Valid models that used to crash batchjac (issue 19), in every backend they concern.

Shapes the frameworks' Jacobian primitives refuse (a scalar output or a scalar unknown per
instance, no unknown feature at all), outputs in another tensor type (``tf.IndexedSlices``),
and models that one way of computing the Jacobians cannot handle: forward mode through
TensorFlow control flow, TensorFlow's vectorisation (pfor) of control flow, JAX's reverse mode
through ``lax.while_loop`` and its forward mode through ``custom_vjp``. Each must give the
right Jacobians (another way, with one warning), or say what to do; and a failure must leave
nothing behind that breaks the next call with the same model. References are closed forms.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import assert_jac_close, race_now

BACKENDS = ["tensorflow", "jax", "torch"]

# Whether a call races XLA against the plain graph depends on the work timed so far (the
# machine's load); where it does, these models' while loops make XLA fail, with its own
# warning (tested in test_backend_tensorflow.py), which is not what these tests are about
pytestmark = pytest.mark.filterwarnings("ignore::batchjac.XLAFallbackWarning")

FALLBACK_WARNINGS = (batchjac.ForwardModeFallbackWarning, batchjac.ReverseModeFallbackWarning,
                     batchjac.VectorizationFallbackWarning)


@contextlib.contextmanager
def no_fallback_warning() -> Iterator[None]:
    """A block in which a fallback warning is an error (each is given once per model)."""
    with warnings.catch_warnings():
        for kind in FALLBACK_WARNINGS:
            warnings.simplefilter("error", kind)
        yield


def data(shape: tuple[int, ...], seed: int, low: float = -1.5, high: float = 1.5) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32)


def diag(d: np.ndarray) -> np.ndarray:
    """(N, k) -> (N, k, k): per-instance diagonal Jacobians of an elementwise map."""
    return np.einsum("ni,ij->nij", d, np.eye(d.shape[1]))


# ---- rank-1 outputs and unknowns ---------------------------------------------------------------

W3 = np.array([0.5, -1.0, 2.0])


def rank1_models(backend: str) -> dict[str, Callable[..., Any]]:
    """scalar_out: (N, 3) -> (N,); scalar_in: (N,) -> (N, 2); both: (N,) -> (N,)."""
    if backend == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        w = tf.constant(W3, tf.float32)

        @tf.function
        def scalar_out(x: Any) -> Any:
            return tf.reduce_sum(tf.sin(x) * w, axis=1)

        @tf.function
        def scalar_in(x: Any) -> Any:
            return tf.stack([tf.sin(x), x**2], axis=1)

        @tf.function
        def both(x: Any) -> Any:
            return tf.sin(x) + 0.5 * x**2

        return {"scalar_out": scalar_out, "scalar_in": scalar_in, "both": both}
    if backend == "jax":
        jnp = pytest.importorskip("jax.numpy")
        wj = jnp.asarray(W3, jnp.float32)
        return {"scalar_out": lambda x: jnp.sum(jnp.sin(x) * wj, axis=1),
                "scalar_in": lambda x: jnp.stack([jnp.sin(x), x**2], axis=1),
                "both": lambda x: jnp.sin(x) + 0.5 * x**2}
    torch = pytest.importorskip("torch")
    wt = torch.tensor(W3, dtype=torch.float32)
    return {"scalar_out": lambda x: torch.sum(torch.sin(x) * wt, dim=1),
            "scalar_in": lambda x: torch.stack([torch.sin(x), x**2], dim=1),
            "both": lambda x: torch.sin(x) + 0.5 * x**2}


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank1_outputs_and_unknowns_have_the_documented_shape(backend: str, mode: str) -> None:
    """J is (N, *output_shape, *unknown_shape): (N, 3) for a scalar output of 3 unknowns,
    (N, 2) for 2 outputs of a scalar unknown, (N,) when both are scalars (torch.func.jacrev's
    convention per instance). TensorFlow's batch_jacobian refuses rank-1 tensors."""
    models = rank1_models(backend)
    x = data((13, 3), seed=190)
    x64 = x.astype(np.float64)
    jac = batchjac.jacobian(models["scalar_out"], x, mode=mode, backend=backend)
    assert_jac_close(jac, np.cos(x64) * W3)

    s = data((11,), seed=191)
    s64 = s.astype(np.float64)
    y, jac = batchjac.jacobian(models["scalar_in"], s, mode=mode, backend=backend,
                               return_outputs=True)
    assert y.shape == (11, 2)
    assert_jac_close(jac, np.stack([np.cos(s64), 2 * s64], axis=1))

    jac = batchjac.jacobian(models["both"], s, mode=mode, backend=backend, chunk_size=4)
    assert_jac_close(jac, np.cos(s64) + s64)


# ---- no unknown features -----------------------------------------------------------------------


def elementwise(backend: str) -> Callable[..., Any]:
    if backend == "tensorflow":
        tf = pytest.importorskip("tensorflow")

        @tf.function
        def f(x: Any) -> Any:
            return tf.sin(x) * 2.0

        return f
    if backend == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return lambda x: jnp.sin(x) * 2.0
    torch = pytest.importorskip("torch")
    return lambda x: torch.sin(x) * 2.0


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_unknown_features_give_empty_jacobians(backend: str, mode: str) -> None:
    """Unknowns of shape (N, 0) beside known inputs (N, 3): J is (N, 3, 0) in every mode,
    and the outputs are the model's."""
    known = data((9, 3), seed=192)
    unknown = np.zeros((9, 0), np.float32)
    y, jac = batchjac.jacobian(elementwise(backend), unknown, known, mode=mode, backend=backend,
                               return_outputs=True)
    assert jac.shape == (9, 3, 0)
    assert jac.dtype == np.float32
    np.testing.assert_allclose(y, 2 * np.sin(known), rtol=1e-6)


# ---- TensorFlow: an output that is a tf.IndexedSlices ------------------------------------------


def test_tensorflow_indexed_slices_output_is_densified() -> None:
    tf = pytest.importorskip("tensorflow")

    @tf.function
    def grad_of_gathered(x: Any) -> Any:
        # the gradient through a gather on axis 0 is a tf.IndexedSlices: here cos(x), per row
        with tf.GradientTape() as tape:
            tape.watch(x)
            total = tf.reduce_sum(tf.sin(tf.gather(x, tf.range(tf.shape(x)[0]))))
        return tape.gradient(total, x)

    x = data((7, 3), seed=193)
    for mode in ("auto", "reverse"):  # (auto: 3 unknowns, 3 outputs: reverse mode)
        y, jac = batchjac.jacobian(grad_of_gathered, x, mode=mode, return_outputs=True)
        np.testing.assert_allclose(y, np.cos(x), rtol=1e-6)
        assert_jac_close(jac, diag(-np.sin(x.astype(np.float64))))
    # TensorFlow's forward-mode accumulator cannot record the call of a function returning
    # one (AttributeError: 'IndexedSlices' object has no attribute '_id'): it says what to do
    with pytest.raises(batchjac.ModelError, match=r"IndexedSlices.*mode='reverse'"):
        batchjac.jacobian(grad_of_gathered, x, mode="forward")


def test_fallback_warnings_are_public() -> None:
    for name in ("ForwardModeFallbackWarning", "ReverseModeFallbackWarning",
                 "VectorizationFallbackWarning"):
        assert name in batchjac.__all__
        assert issubclass(getattr(batchjac, name), batchjac.BatchJacWarning)


# ---- TensorFlow: forward mode through control flow -------------------------------------------

#: (2 unknowns -> 5 outputs: mode="auto" picks forward mode)
W25 = np.arange(10.0).reshape(2, 5) * 0.1 - 0.4


def keras_model(kind: str) -> Any:
    """2 unknowns -> 5 outputs through a layer whose forward mode TensorFlow cannot compute:
    ``foldl``, a while loop reading a Keras variable ("a variable without handle data"), or
    ``vectorized_map`` of a ``cond`` ("Required handle data not set")."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")

    class Fold(keras.layers.Layer):
        def build(self, shape: Any) -> None:
            self.w = self.add_weight(shape=(2, 5), initializer=keras.initializers.Constant(W25))

        def call(self, x: Any) -> Any:
            if kind == "foldl":  # a <- tanh(a @ w.T @ w), three times, from a = x @ w
                return tf.foldl(lambda a, _: tf.tanh(a @ tf.transpose(self.w) @ self.w),
                                tf.range(3), initializer=x @ self.w)
            h = x @ self.w  # per row: sin(h) where h[0] > 0, else h**2
            return tf.vectorized_map(lambda r: tf.cond(r[0] > 0, lambda: tf.sin(r),
                                                       lambda: r**2), h)

    return keras.Sequential([keras.Input((2,)), Fold()])


def keras_reference(kind: str, x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    if kind == "foldl":
        m = W25.T @ W25
        a, jac = x @ W25, np.broadcast_to(W25.T, (len(x), 5, 2))
        for _ in range(3):
            a = np.tanh(a @ m)
            jac = (1 - a**2)[:, :, None] * np.einsum("ij,njk->nik", m.T, jac)
        return jac
    h = x @ W25
    d = np.where(h[:, :1] > 0, np.cos(h), 2 * h)
    return d[:, :, None] * W25.T[None]


@pytest.mark.parametrize("kind", ["foldl", "map_cond"])
def test_tensorflow_forward_failure_falls_back_to_reverse_once(kind: str) -> None:
    model = keras_model(kind)
    x = data((10, 2), seed=194)
    with pytest.warns(batchjac.ForwardModeFallbackWarning, match="Forward mode failed"):
        jac = batchjac.jacobian(model, x)  # auto: 2 unknowns < 5 outputs, forward mode
    assert_jac_close(jac, keras_reference(kind, x))
    x2 = data((7, 2), seed=195)
    with no_fallback_warning():  # once: not again for another chunk size, nor in reverse
        assert_jac_close(batchjac.jacobian(model, x2), keras_reference(kind, x2))
        assert_jac_close(batchjac.jacobian(model, x2, mode="reverse"), keras_reference(kind, x2))
    with pytest.raises(batchjac.ModelError, match="mode='reverse'"):
        batchjac.jacobian(model, x2, mode="forward")


def test_tensorflow_failed_forward_mode_leaves_the_model_usable() -> None:
    """mode="forward", asked for, says what to do; the same model object then works."""
    model = keras_model("foldl")
    x = data((10, 2), seed=196)
    with pytest.raises(batchjac.ModelError, match=r"Forward mode failed.*mode='reverse'"):
        batchjac.jacobian(model, x, mode="forward")
    assert_jac_close(batchjac.jacobian(model, x, mode="reverse"), keras_reference("foldl", x))
    with pytest.warns(batchjac.ForwardModeFallbackWarning):
        assert_jac_close(batchjac.jacobian(model, x), keras_reference("foldl", x))
    with pytest.raises(batchjac.ModelError, match="mode='reverse'"):  # the same kernel
        batchjac.jacobian(model, x, mode="forward")
    assert_jac_close(batchjac.jacobian(model, x), keras_reference("foldl", x))


# ---- TensorFlow: control flow pfor cannot vectorise --------------------------------------------


def nested_map_fn(w: np.ndarray) -> Any:
    """x -> sin(x @ w) through a map_fn in a map_fn, which pfor vectorises in neither mode
    ("Required handle data not set", "Encountered an exception while vectorizing")."""
    tf = pytest.importorskip("tensorflow")
    wt = tf.constant(w, tf.float32)

    @tf.function
    def f(x: Any) -> Any:
        return tf.map_fn(lambda r: tf.map_fn(tf.sin, r), x @ wt)

    return f


@pytest.mark.parametrize(("mode", "w"), [("auto", W25), ("forward", W25), ("reverse", W25),
                                         ("auto", W25.T)])
def test_tensorflow_unvectorisable_model_runs_in_a_loop(mode: str, w: np.ndarray) -> None:
    """2 -> 5 (auto: forward mode) and 5 -> 2 (auto: reverse mode): the mode chosen or asked
    for runs in a while loop over the basis instead of pfor, with one warning."""
    model = nested_map_fn(w)
    x = data((9, w.shape[0]), seed=197)
    ref = np.cos(x.astype(np.float64) @ w)[:, :, None] * w.T[None]
    with pytest.warns(batchjac.VectorizationFallbackWarning, match="could not vectorise"):
        jac = batchjac.jacobian(model, x, mode=mode)
    assert_jac_close(jac, ref)
    with no_fallback_warning():
        assert_jac_close(batchjac.jacobian(model, x, mode=mode, chunk_size=4), ref)


def test_tensorflow_products_of_an_unvectorisable_model_loop_over_the_directions(
        caplog: pytest.LogCaptureFixture) -> None:
    """jvp and vjp vectorise an instance's directions by pfor; where pfor cannot vectorise the
    model, they loop over the directions (said in the debug log), with the same products."""
    model = nested_map_fn(W25)
    x = data((9, 2), seed=211)
    jac = np.cos(x.astype(np.float64) @ W25)[:, :, None] * W25.T[None]  # (9, 5, 2)
    g = np.random.default_rng(212)
    t = g.normal(size=(9, 3, 2)).astype(np.float32)
    c = g.normal(size=(9, 3, 5)).astype(np.float32)
    with caplog.at_level("DEBUG", logger="batchjac"):
        jv = batchjac.jvp(model, x, tangents=t)
        cj = batchjac.vjp(model, x, cotangents=c)
    said = caplog.text
    assert "jvp products: pfor cannot vectorise" in said, said
    assert "vjp products: pfor cannot vectorise" in said, said
    np.testing.assert_allclose(jv, np.einsum("nja,nda->ndj", jac, t), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cj, np.einsum("nja,ndj->nda", jac, c), rtol=1e-5, atol=1e-6)


# ---- JAX: reverse mode through while_loop, forward mode through custom_vjp ----------------------


def newton_sqrt() -> Any:
    """(N, 3) -> (N, 2): sqrt(sum(x)) twice, by Newton's iteration in a lax.while_loop whose
    trip count depends on the inputs; JAX has no reverse mode for it (3 unknowns > 2 outputs:
    auto picks reverse mode)."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")

    def f(x: Any) -> Any:
        s = jnp.sum(x, axis=1, keepdims=True) * jnp.ones((1, 2), x.dtype)

        def more(c: Any) -> Any:
            return jnp.any(jnp.abs(c[0] ** 2 - s) > 1e-6 * s) & (c[1] < 50)

        y, _ = jax.lax.while_loop(more, lambda c: (0.5 * (c[0] + s / c[0]), c[1] + 1), (s, 0))
        return y

    return f


def newton_reference(x: np.ndarray) -> np.ndarray:
    s = x.astype(np.float64).sum(axis=1)
    return np.broadcast_to((0.5 / np.sqrt(s))[:, None, None], (len(x), 2, 3))


@pytest.mark.parametrize("first", ["auto", "reverse"])
def test_jax_while_loop_falls_back_to_forward_mode(first: str) -> None:
    model = newton_sqrt()
    x = data((12, 3), seed=199, low=0.5, high=2.0)
    if first == "reverse":  # asked for: says what to do, and leaves the model usable
        with pytest.raises(batchjac.ModelError, match=r"Reverse mode failed.*mode='forward'"):
            batchjac.jacobian(model, x, mode="reverse")
    with pytest.warns(batchjac.ReverseModeFallbackWarning, match="Reverse mode failed"):
        jac = batchjac.jacobian(model, x)
    assert_jac_close(jac, newton_reference(x))
    x2 = data((5, 3), seed=200, low=0.5, high=2.0)
    with no_fallback_warning():
        assert_jac_close(batchjac.jacobian(model, x2), newton_reference(x2))
        assert_jac_close(batchjac.jacobian(model, x, mode="forward"), newton_reference(x))
    with pytest.raises(batchjac.ModelError, match="mode='forward'"):
        batchjac.jacobian(model, x, mode="reverse")
    assert_jac_close(batchjac.jacobian(model, x), newton_reference(x))


def custom_vjp_model() -> tuple[Any, Callable[[np.ndarray], np.ndarray]]:
    """3 unknowns -> 6 outputs (auto: forward mode) through a custom_vjp, and its Jacobian."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")

    @jax.custom_vjp
    def cube(x: Any) -> Any:
        return x**3

    cube.defvjp(lambda x: (x**3, x), lambda x, g: (3 * x**2 * g,))

    def model(x: Any) -> Any:
        return jnp.concatenate([cube(x), jnp.sin(x)], axis=1)

    def reference(x: np.ndarray) -> np.ndarray:
        x64 = x.astype(np.float64)
        return np.concatenate([diag(3 * x64**2), diag(np.cos(x64))], axis=1)

    return model, reference


def test_jax_custom_vjp_falls_back_to_reverse_mode() -> None:
    model, reference = custom_vjp_model()
    x = data((10, 3), seed=201)
    ref = reference(x)
    with pytest.warns(batchjac.ForwardModeFallbackWarning, match="Forward mode failed"):
        assert_jac_close(batchjac.jacobian(model, x), ref)
    with pytest.raises(batchjac.ModelError, match="mode='reverse'"):
        batchjac.jacobian(model, x, mode="forward")
    with no_fallback_warning():
        assert_jac_close(batchjac.jacobian(model, x, mode="reverse"), ref)
        assert_jac_close(batchjac.jacobian(model, x[:4]), ref[:4])


# ---- the mode race ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jax", "tensorflow"])
def test_a_failing_mode_loses_the_mode_race_without_a_warning(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where mode="auto" times both modes (their counts are close), a mode that fails for the
    model loses: the other is kept, and nothing warns (the plan computes what it said)."""
    race_now(monkeypatch)
    if kind == "jax":
        model, reference = custom_vjp_model()
        x = data((10, 3), seed=202)
    else:
        model, x = keras_model("foldl"), data((10, 2), seed=203)

        def reference(x: np.ndarray) -> np.ndarray:
            return keras_reference("foldl", x)
    with no_fallback_warning():
        assert_jac_close(batchjac.jacobian(model, x), reference(x))
        assert_jac_close(batchjac.jacobian(model, x[:7]), reference(x[:7]))


# ---- a mode asked for is refused where it fails, by every verb and every path ------------------

TORCH_CUBE_SOURCE = '''
import torch


class Cube(torch.autograd.Function):
    """x**3 with a backward rule only: no forward mode (jvp), no torch.func support."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


def model(x):
    return torch.cat([Cube.apply(x), torch.sin(x)], dim=1)
'''

JAX_CUBE_SOURCE = '''
import jax
import jax.numpy as jnp


@jax.custom_vjp
def cube(x):
    return x**3


cube.defvjp(lambda x: (x**3, x), lambda x, g: (3 * x**2 * g,))


def model(x):
    return jnp.concatenate([cube(x), jnp.sin(x)], axis=1)
'''


def cube_sin_reference(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return np.concatenate([diag(3 * x64**2), diag(np.cos(x64))], axis=1)


def torch_cube_model() -> Any:
    pytest.importorskip("torch")
    space: dict[str, Any] = {}
    exec(compile(TORCH_CUBE_SOURCE, "<torch_cube>", "exec"), space)  # a model without jvp
    return space["model"]


def forward_failing(backend: str) -> tuple[Any, np.ndarray, np.ndarray]:
    """A model whose forward mode fails in ``backend``, inputs, and its Jacobians."""
    if backend == "tensorflow":
        x = data((12, 2), seed=210)
        return keras_model("foldl"), x, keras_reference("foldl", x)
    x = data((12, 3), seed=211)
    if backend == "jax":
        return custom_vjp_model()[0], x, cube_sin_reference(x)
    return torch_cube_model(), x, cube_sin_reference(x)


#: the refusal, not the fallback warning (which says "Pass mode='reverse' to skip the attempt"
#: and, as tests turn warnings into errors, would be raised too)
ASKED = r"Forward mode failed for this model.*Pass mode='reverse' \(or mode='auto'"


@pytest.mark.parametrize("backend", BACKENDS)
def test_asked_forward_mode_is_refused_by_every_verb(backend: str, tmp_path: Any) -> None:
    """jacobian (in memory and into a store), solve, check and propagate all refuse a
    mode="forward" that fails for the model, before and after mode="auto" fell back; torch used
    to compute reverse mode instead (with a warning, and a store without one)."""
    model, x, ref = forward_failing(backend)
    with pytest.raises(batchjac.ModelError, match=ASKED):
        batchjac.jacobian(model, x, mode="forward")
    with pytest.raises(batchjac.ModelError, match=ASKED):
        batchjac.jacobian(model, x, mode="forward", out=str(tmp_path / "j.zarr"))
    assert not (tmp_path / "j.zarr").exists()
    assert not (tmp_path / "j.zarr.partial").exists()  # no chunk done: nothing left behind
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", batchjac.ForwardModeFallbackWarning)
        assert_jac_close(batchjac.jacobian(model, x), ref)  # auto: the other mode
        y = np.asarray(batchjac.jacobian(model, x, mode="reverse", return_outputs=True)[0])
    with pytest.raises(batchjac.ModelError, match=ASKED):  # after the fallback too
        batchjac.jacobian(model, x, mode="forward", chunk_size=5)
    with pytest.raises(batchjac.ModelError, match=ASKED):
        batchjac.jacobian(model, x, mode="forward", out=str(tmp_path / "k.zarr"))
    with pytest.raises(batchjac.ModelError, match=ASKED):
        batchjac.solve(model, y, n_unknowns=x.shape[1], x0=x + 0.05, mode="forward")
    with pytest.raises(batchjac.ModelError, match=ASKED):
        batchjac.check(model, x, mode="forward")
    with pytest.raises(batchjac.ModelError, match=ASKED):
        batchjac.propagate(model, x, std=0.1, mode="forward")
    solved = batchjac.solve(model, y, n_unknowns=x.shape[1], x0=x + 0.05, mode="reverse")
    assert isinstance(solved, batchjac.SolveResult)
    assert solved.success.all(), solved
    np.testing.assert_allclose(solved.x, x, atol=2e-3)


@pytest.mark.parametrize(("backend", "source"), [("jax", JAX_CUBE_SOURCE),
                                                 ("torch", TORCH_CUBE_SOURCE)])
@pytest.mark.parametrize("command", ["compute", "check"])
def test_cli_asked_forward_mode_exits_5_with_the_fix(backend: str, source: str, command: str,
                                                     tmp_path: Any) -> None:
    pytest.importorskip(backend)
    from click.testing import CliRunner

    from batchjac.cli import cli

    (tmp_path / "cube.py").write_text(source)
    np.save(tmp_path / "x.npy", data((12, 3), seed=212))
    args = [command, f"{tmp_path / 'cube.py'}:model", "-i", str(tmp_path / "x.npy")]
    if command == "compute":
        args += ["-o", str(tmp_path / "j.zarr")]
    result = CliRunner().invoke(cli, [*args, "--mode", "forward"])
    assert result.exit_code == 5, result.output
    # the refusal (not the fallback warning), its advice in the CLI's terms
    assert "Pass --mode reverse (or --mode auto" in result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "j.zarr").exists()
    assert not (tmp_path / "j.zarr.partial").exists()  # so auto, next, is not "another job"
    if command == "compute":  # auto falls back and finishes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", batchjac.ForwardModeFallbackWarning)
            done = CliRunner().invoke(cli, args)
        assert done.exit_code == 0, done.output
        jac = np.asarray(batchjac.open_store(str(tmp_path / "j.zarr")))
        assert_jac_close(jac, cube_sin_reference(data((12, 3), seed=212)))
