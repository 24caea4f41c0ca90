"""Model kinds as users hold them (issue 37), second order and recurrent: Equinox, Flax Linen
and Haiku models give Hessians and Laplacians equal to JAX's own; recurrent models (a JAX
``lax.scan``, PyTorch LSTM and GRU, a Keras GRU on TensorFlow) give Jacobians, Hessians and
Laplacians equal to their framework's own; a ``torch.compile``d model (a compiled module, a
compiled function, a module compiled in place) is differentiated through its original,
compiling nothing (before: a minute of compilation on its first call), and ``explain`` says so.

References: ``jax.vmap(jax.jacrev | jax.hessian)`` of one instance, torch's
``torch.autograd.functional`` row by row, TensorFlow's ``GradientTape.batch_jacobian``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import assert_jac_close, rng


def _jax_references(f: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """JAX's own per-instance Jacobians and Hessians of a batch function ``f``."""
    import jax
    import jax.numpy as jnp

    one = lambda r: f(r[None])[0]  # noqa: E731
    xs = jnp.asarray(x)
    return np.asarray(jax.vmap(jax.jacrev(one))(xs)), np.asarray(jax.vmap(jax.hessian(one))(xs))


def _assert_second_order(model: Any, x: np.ndarray, jac: np.ndarray, hess: np.ndarray,
                         **kw: Any) -> None:
    assert_jac_close(batchjac.jacobian(model, x, **kw), jac)
    assert_jac_close(batchjac.hessian(model, x, **kw), hess)
    assert_jac_close(batchjac.laplacian(model, x, **kw), np.trace(hess, axis1=-2, axis2=-1))


def test_jax_model_kinds_give_jax_s_own_hessians_and_laplacians() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    eqx = pytest.importorskip("equinox")
    linen = pytest.importorskip("flax.linen")
    hk = pytest.importorskip("haiku")
    x = rng(3701).normal(size=(9, 5)).astype(np.float32)

    mlp = eqx.nn.MLP(5, 3, width_size=16, depth=2, activation=jnp.tanh,
                     key=jax.random.PRNGKey(1))  # one instance per call, detected
    _assert_second_order(mlp, x, *_jax_references(jax.vmap(mlp), x))

    class Dense(linen.Module):
        @linen.compact
        def __call__(self, z: Any) -> Any:
            return linen.Dense(3)(jnp.tanh(linen.Dense(16)(z)))

    variables = Dense().init(jax.random.PRNGKey(2), jnp.asarray(x[:1]))
    refs = _jax_references(lambda z: Dense().apply(variables, z), x)
    _assert_second_order(Dense(), x, *refs, backend_options={"params": variables})
    _assert_second_order(Dense().bind(variables), x, *refs)

    net = hk.without_apply_rng(hk.transform(
        lambda z: hk.nets.MLP([16, 3], activation=jax.nn.softplus)(z)))
    params = net.init(jax.random.PRNGKey(3), jnp.asarray(x[:1]))
    _assert_second_order(net, x, *_jax_references(lambda z: net.apply(params, z), x),
                         backend_options={"params": params})


def test_a_jax_scan_recurrence() -> None:
    """A recurrent cell unrolled by ``lax.scan`` over a sequence of 6 steps, the unknowns the
    sequence's inputs, the last state the output."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    g = rng(3702)
    wx, wh = jnp.asarray(g.normal(size=(2, 8)) * 0.5), jnp.asarray(g.normal(size=(8, 8)) * 0.3)
    wo = jnp.asarray(g.normal(size=(8, 2)))

    def rnn(seq: Any) -> Any:  # (N, 12) = 6 steps of 2 inputs -> (N, 2)
        steps = seq.reshape(seq.shape[0], 6, 2).swapaxes(0, 1)

        def cell(h: Any, xt: Any) -> tuple[Any, None]:
            return jnp.tanh(xt @ wx.astype(seq.dtype) + h @ wh.astype(seq.dtype)), None

        h, _ = jax.lax.scan(cell, jnp.zeros((seq.shape[0], 8), seq.dtype), steps)
        return h @ wo.astype(seq.dtype)

    x = g.normal(size=(11, 12)).astype(np.float32)
    _assert_second_order(rnn, x, *_jax_references(rnn, x))
    jitted = jax.jit(rnn)
    assert_jac_close(batchjac.jacobian(jitted, x[:, :4], x[:, 4:]),
                     _jax_references(rnn, x)[0][:, :, :4])


class _Recurrent:
    """A torch LSTM or GRU over 5 steps of 3 features, its last output through a linear head:
    (N, 15) -> (N, 2)."""

    def __init__(self, kind: str) -> None:
        import torch

        torch.manual_seed(37)
        self.torch = torch
        self.cell = getattr(torch.nn, kind)(3, 6, batch_first=True)
        self.head = torch.nn.Linear(6, 2)

    def __call__(self, x: Any) -> Any:
        out, _ = self.cell(x.reshape(x.shape[0], 5, 3))
        return self.head(out[:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_torch_recurrent_modules(kind: str) -> None:
    torch = pytest.importorskip("torch")
    f = _Recurrent(kind)
    module = torch.nn.Module()
    module.cell, module.head = f.cell, f.head
    module.forward = f.__call__  # type: ignore[method-assign]
    x = rng(3703).normal(size=(7, 15)).astype(np.float32)
    rows = [torch.from_numpy(x[i]).double() for i in range(len(x))]
    twin = _Recurrent(kind)  # the same weights, float64, one instance at a time
    twin.cell.load_state_dict(f.cell.state_dict())
    twin.head.load_state_dict(f.head.state_dict())
    twin.cell.double()
    twin.head.double()
    one = lambda r: twin(r[None])[0]  # noqa: E731
    jac = np.stack([torch.autograd.functional.jacobian(one, r).numpy() for r in rows])
    hess = np.stack([np.stack([torch.autograd.functional.hessian(
        lambda r, o=o: one(r)[o], r).numpy() for o in range(2)]) for r in rows])
    _assert_second_order(module, x, jac, hess)


def test_a_keras_recurrent_model_on_tensorflow() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(37)
    inp = keras.Input((15,))
    seq = keras.layers.Reshape((5, 3))(inp)
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.GRU(6)(seq)))
    x = rng(3704).normal(size=(7, 15)).astype(np.float32)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = model(xt)
    ref = tape.batch_jacobian(y, xt).numpy()
    assert_jac_close(batchjac.jacobian(model, x), ref)
    assert_jac_close(batchjac.jacobian(model, x[:, :6], x[:, 6:]), ref[:, :, :6])


def _counting_backend() -> tuple[Any, list[int]]:
    """A torch.compile backend that counts the graphs it is given and runs them as they are."""
    compiled: list[int] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        compiled.append(1)
        return gm.forward

    return backend, compiled


def test_a_torch_compiled_model_is_differentiated_uncompiled(
        capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(38)
    module = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x = rng(3705).normal(size=(13, 4)).astype(np.float32)
    jac_ref = torch.func.vmap(torch.func.jacrev(module))(torch.from_numpy(x)).detach().numpy()
    hess_ref = np.stack([torch.autograd.functional.hessian(lambda r: module(r)[0], r).numpy()
                         for r in torch.from_numpy(x)])
    backend, compiled = _counting_backend()
    in_place = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    in_place.load_state_dict(module.state_dict())
    in_place.compile(backend=backend)
    for model in (torch.compile(module, backend=backend),
                  torch.compile(lambda v: module(v), backend=backend), in_place):
        assert_jac_close(batchjac.jacobian(model, x, explain=True), jac_ref)
        assert "torch.compile'd: differentiated through the original module" in \
            capsys.readouterr().err
    # (a compiled model called inside another function is compiled by that call: the
    # function compiled, over the original module, is what batchjac can unwrap)
    first = torch.compile(lambda v: module(v)[:, 0], backend=backend)
    assert_jac_close(batchjac.hessian(first, x), hess_ref)
    assert_jac_close(batchjac.laplacian(first, x), np.trace(hess_ref, axis1=1, axis2=2))
    assert compiled == [], "torch.compile compiled a graph for batchjac"
    # (a call of a compiled function of its own compiles: the counter works; a module's
    # forward may have reached TorchDynamo's recompile limit in a process running many tests)
    torch.compile(lambda v: torch.tanh(v) * 2.0, backend=backend)(torch.from_numpy(x))
    assert compiled
