"""``differentiable=True``: Jacobians, Hessians (full, diagonal), Laplacians and HVPs that
carry gradients, in PyTorch, JAX and TensorFlow.

The reference is the framework's own composition of its transforms (torch.func's
``vmap(jacrev/jacfwd)`` nested, JAX's ``vmap(jacfwd(jacrev))`` under ``jax.grad``, nested
``GradientTape`` s): the gradient of a scalar loss on the result, with respect to the model's
parameters and to the inputs, must equal the reference's to 1e-10 relative in float64 and 1e-5
in float32, chunked (each chunk recomputed for the gradient) or not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac import InputError

from .helpers import jax_x64

KINDS = ("jacobian", "hessian", "diagonal", "laplacian", "hvp")
RTOL = {np.float64: 1e-10, np.float32: 1e-5}
#: float32 gradients of second-order results (third derivatives): against float64 JAX, over
#: 15 fresh draws of tests/test_differentiable.py's JAX case, batchjac's were off by up to
#: 2.6e-5 of the largest entry and JAX's own float32 transforms by up to 2.2e-5, so two float32
#: computations may differ by ~5e-5 (one draw did: 2.4e-4 of an entry, 5.2e-5 absolute)
RTOL_THIRD32 = 1e-4


def _call(kind: str, model: Any, x: Any, v: Any = None, **kw: Any) -> Any:
    if kind == "jacobian":
        return batchjac.jacobian(model, x, differentiable=True, **kw)
    if kind == "laplacian":
        return batchjac.laplacian(model, x, differentiable=True, **kw)
    if kind == "hvp":
        return batchjac.hvp(model, x, v=v, differentiable=True, **kw)
    return batchjac.hessian(model, x, diagonal=kind == "diagonal", differentiable=True, **kw)


def _reduce(kind: str, hess: Any, jac: Any, v: Any, xp: Any) -> Any:
    """The kind's result from a full per-instance Hessian (n, m, k, k) and Jacobian (n, m, k)."""
    if kind == "jacobian":
        return jac
    if kind == "hessian":
        return hess
    if kind == "diagonal":
        return xp.einsum("nmkk->nmk", hess)
    if kind == "laplacian":
        return xp.einsum("nmkk->nm", hess)
    return xp.einsum("nmkj,nj->nmk", hess, v)


def _assert_grads(ours: list[Any], ref: list[Any], dtype: Any, rtol: float | None = None) -> None:
    assert len(ours) == len(ref)
    rtol = RTOL[dtype] if rtol is None else rtol
    for a, b in zip(ours, ref):
        b = np.asarray(b, np.float64)
        a = np.zeros_like(b) if a is None else np.asarray(a, np.float64)
        scale = float(np.abs(b).max()) or 1.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def _weights(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 1.5, size=shape)


# -- PyTorch ---------------------------------------------------------------------------------



def _torch_case(dtype: Any, n: int = 6) -> tuple[Any, Any, Any]:
    torch = pytest.importorskip("torch")

    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2),
                              torch.nn.Tanh()).to(tdt)
    rng = np.random.default_rng()
    x = torch.tensor(rng.normal(size=(n, 3)), dtype=tdt, requires_grad=True)
    v = torch.tensor(rng.normal(size=(n, 3)), dtype=tdt)
    return net, x, v


def _torch_native(kind: str, net: Any, x: Any, v: Any) -> Any:
    torch = pytest.importorskip("torch")
    from torch.func import functional_call, hessian, jacrev, vmap

    params = dict(net.named_parameters())

    def one(xi: Any) -> Any:
        return functional_call(net, params, (xi,))

    if kind == "jacobian":
        return vmap(jacrev(one))(x)
    with warnings.catch_warnings():  # (torch's first dual tensor: torch.jit.script deprecated)
        warnings.simplefilter("ignore", DeprecationWarning)
        hess = vmap(hessian(one))(x)
    return _reduce(kind, hess, None, v, torch)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_torch_gradients_match_torch_func(kind: str, dtype: Any) -> None:
    torch = pytest.importorskip("torch")

    net, x, v = _torch_case(dtype)

    def grads(result: Any) -> list[Any]:
        loss = torch.sin(result).sum()
        return [g.detach().numpy() for g in
                torch.autograd.grad(loss, [*net.parameters(), x], allow_unused=False)]

    ref_result = _torch_native(kind, net, x, v)
    ref = grads(ref_result)
    for kw in ({}, {"chunk_size": 4}):
        ours = _call(kind, net, x, v, **kw)
        assert ours.requires_grad
        assert ours.shape == ref_result.shape
        np.testing.assert_allclose(ours.detach().numpy(), ref_result.detach().numpy(),
                                   rtol=RTOL[dtype], atol=RTOL[dtype])
        _assert_grads(grads(ours), ref, dtype)


def test_torch_every_order_and_mode_carries_torch_funcs_gradient() -> None:
    torch = pytest.importorskip("torch")

    net, x, v = _torch_case(np.float64)
    wrt = [*net.parameters(), x]
    ref = torch.autograd.grad(_torch_native("hessian", net, x, v).square().sum(), wrt)
    for mode in ("forward-over-forward", "forward-over-reverse"):
        h = batchjac.hessian(net, x, mode=mode, differentiable=True)
        g = torch.autograd.grad(h.square().sum(), wrt)
        _assert_grads([a.numpy() for a in g], [a.numpy() for a in ref], np.float64)
    ref = torch.autograd.grad(_torch_native("jacobian", net, x, v).square().sum(), wrt)
    for mode in ("forward", "reverse"):
        j = batchjac.jacobian(net, x, mode=mode, differentiable=True)
        assert torch.allclose(j, _torch_native("jacobian", net, x, v))
        g = torch.autograd.grad(j.square().sum(), wrt)
        _assert_grads([a.numpy() for a in g], [a.numpy() for a in ref], np.float64)


def test_torch_outputs_and_jacobian_beside_the_hessian_carry_gradients() -> None:
    torch = pytest.importorskip("torch")

    net, x, _ = _torch_case(np.float64)
    y, jac, lap = batchjac.laplacian(net, x, differentiable=True, return_outputs=True,
                                     return_jacobian=True)
    assert torch.allclose(y, net(x))
    assert torch.allclose(jac, _torch_native("jacobian", net, x, None))
    for part in (y, jac, lap):
        (g,) = torch.autograd.grad(part.sum(), [net[0].weight], retain_graph=True)
        assert g.abs().sum() > 0


@pytest.mark.parametrize("k", [0, 1, 3])
def test_torch_forward_laplacians_elementwise_node_against_autograds_checks(k: int) -> None:
    """The forward Laplacian's elementwise rule in a differentiable call is one autograd node
    with a hand-written backward and forward derivative: torch's gradcheck and gradgradcheck
    (float64 finite differences) for both, and torch.func's transforms over it against the
    same rule written as separate operations."""
    torch = pytest.importorskip("torch")
    from batchjac._backends.torch.laplacian import _Elementwise

    def node(d: Any, d1: Any, d2: Any) -> Any:
        return _Elementwise.apply(d, d1, d2)[0]

    def plain(d: Any, d1: Any, d2: Any) -> Any:
        out = d * d1
        return torch.cat([out[:k], (out[k] + d2 * d[:k].square().sum(0))[None]])

    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))

    def draw(*shape: int) -> Any:
        return torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)

    d, d1, d2 = draw(k + 1, 3, 4), draw(3, 4), draw(3, 4)
    for args in ((d, d1, d2), (d, draw(1, 4), d2)):  # (g' broadcast over the rows)
        with warnings.catch_warnings():  # (torch's first dual tensor: torch.jit.script deprecated)
            warnings.simplefilter("ignore", DeprecationWarning)
            assert torch.autograd.gradcheck(node, args, check_forward_ad=True)
        assert torch.autograd.gradgradcheck(node, args)
    tangents = tuple(torch.randn_like(a) for a in (d, d1, d2))
    assert torch.allclose(torch.func.jvp(node, (d, d1, d2), tangents)[1],
                          torch.func.jvp(plain, (d, d1, d2), tangents)[1])
    batch = torch.randn(5, k + 1, 3, 4, dtype=torch.float64, generator=gen)
    assert torch.allclose(torch.func.vmap(node, (0, None, None))(batch, d1, d2),
                          torch.func.vmap(plain, (0, None, None))(batch, d1, d2))
    for f in (torch.func.grad, torch.func.hessian):
        assert torch.allclose(f(lambda a: node(d, a, d2).sin().sum())(d1),
                              f(lambda a: plain(d, a, d2).sin().sum())(d1))


@pytest.mark.parametrize("act", ["Tanh", "Sigmoid", "SiLU", "sin"])
def test_torch_laplacians_gradient_of_a_gradient_matches_nested_autograd(act: str) -> None:
    """create_graph semantics through the forward Laplacian's rules: a loss on the gradient
    of a loss on the Laplacian (with respect to the inputs), differentiated again to the
    parameters, equals the same through nested autograd.grad."""
    torch = pytest.importorskip("torch")

    class Sin(torch.nn.Module):  # type: ignore[misc]
        def forward(self, z: Any) -> Any:
            return torch.sin(z)

    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    layer = Sin if act == "sin" else getattr(torch.nn, act)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), layer(), torch.nn.Linear(8, 8), layer(),
                              torch.nn.Linear(8, 1)).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def nested(x: Any) -> Any:
        (du,) = torch.autograd.grad(net(x).sum(), x, create_graph=True)
        return sum(torch.autograd.grad(du[:, i].sum(), x, create_graph=True)[0][:, i:i + 1]
                   for i in range(x.shape[1]))

    params = list(net.parameters())[:-1]  # (the last bias: no Laplacian depends on it)
    results = []
    for lap in (batchjac.laplacian(net, x, differentiable=True), nested(x)):
        (gx,) = torch.autograd.grad(lap.sin().sum(), x, create_graph=True)
        results.append([g.numpy() for g in torch.autograd.grad(gx.square().sum(), params)])
        results[-1].append(lap.detach().numpy())
    _assert_grads(*results, np.float64)


def test_torch_training_step_lowers_the_loss() -> None:
    """A physics-informed step as a user writes it: Laplacian in the loss, optimiser step."""
    torch = pytest.importorskip("torch")

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.rand(64, 2)
    f = torch.ones(64, 1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = (batchjac.laplacian(net, x, differentiable=True) - f).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_torch_weights_updated_in_place_or_replaced_are_seen() -> None:
    """The forward Laplacian's tape is kept between training steps: an optimizer's in-place
    step and a replaced parameter must both reach the next call's values."""
    torch = pytest.importorskip("torch")

    net, x, _ = _torch_case(np.float64)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        lap = batchjac.laplacian(net, x, differentiable=True)
        assert torch.allclose(lap, _torch_native("laplacian", net, x, None), rtol=1e-10)
        lap.sum().backward()
        opt.step()
    net[0].weight = torch.nn.Parameter(torch.randn_like(net[0].weight))
    lap = batchjac.laplacian(net, x, differentiable=True)
    assert torch.allclose(lap, _torch_native("laplacian", net, x, None), rtol=1e-10)


def test_torch_tape_on_a_few_rows_only_where_no_operation_reads_the_row_count() -> None:
    """The forward Laplacian's tape is traced on 2 and 3 rows and serves any chunk where both
    are the same operations; a model that reshapes by its row count differs between the two,
    and is traced on each chunk's rows: right Laplacians and gradients both ways."""
    torch = pytest.importorskip("torch")
    from batchjac._backends.torch import laplacian as torch_laplacian

    class Flat(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2).double()

        def forward(self, x: Any) -> Any:
            return torch.tanh(self.lin(x.reshape(x.shape[0], -1)))

    flat = Flat()
    x = torch.randn(7, 2, 2, dtype=torch.float64)
    trace = torch_laplacian.trace
    two, three = (trace(lambda a: flat(a), x[:r]) for r in (2, 3))
    assert not torch_laplacian.same_ops(two, three)
    net, x2, _ = _torch_case(np.float64, n=7)
    two, three = (trace(lambda a: net(a), x2[:r]) for r in (2, 3))
    assert torch_laplacian.same_ops(two, three)
    for model, inputs in ((flat, x), (net, x2)):
        params = list(model.parameters())
        lap = batchjac.laplacian(model, inputs, differentiable=True)
        from torch.func import hessian, vmap

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            h = vmap(hessian(lambda xi, model=model: model(xi[None])[0]))(inputs)
        k = int(np.prod(inputs.shape[1:]))
        ref = h.reshape(*h.shape[:2], k, k).diagonal(dim1=-2, dim2=-1).sum(-1)
        assert torch.allclose(lap, ref, rtol=1e-10, atol=1e-12)
        got = torch.autograd.grad(lap.square().sum(), params)
        want = torch.autograd.grad(ref.square().sum(), params)
        _assert_grads([g.numpy() for g in got], [w.numpy() for w in want], np.float64)


def test_torch_budget_recomputes_chunks_with_the_same_gradient() -> None:
    torch = pytest.importorskip("torch")

    net, x, _ = _torch_case(np.float64, n=40)
    ref = torch.autograd.grad(batchjac.laplacian(net, x, differentiable=True).sum(),
                              [*net.parameters()])
    lap = batchjac.laplacian(net, x, differentiable=True, max_memory=600_000)  # (chunks of 3)
    got = torch.autograd.grad(lap.sum(), [*net.parameters()])
    _assert_grads([a.numpy() for a in got], [a.numpy() for a in ref], np.float64)


def test_a_budget_below_one_row_is_refused_with_the_minimum() -> None:
    net, x, _ = _torch_case(np.float64, n=10)
    with pytest.raises(InputError, match=r"max_memory=100 cannot be met.*at least"):
        batchjac.laplacian(net, x, differentiable=True, max_memory=100)


def test_torch_reverse_mode_is_recomputed_in_chunks_by_plain_autograd() -> None:
    """torch.func's reverse transforms refuse the checkpoint's hooks: a chunked reverse-mode
    Jacobian is plain autograd's, recomputed, with torch.func's gradients; a second-order
    reverse order is still refused there, and "auto" takes a forward order."""
    torch = pytest.importorskip("torch")

    net, x, v = _torch_case(np.float64, n=10)
    wrt = [*net.parameters(), x]
    ref_j = _torch_native("jacobian", net, x, v)
    ref = torch.autograd.grad(ref_j.sin().sum(), wrt)
    for kw in ({"mode": "reverse"}, {"mode": "reverse", "max_memory": 200_000}, {}):
        j = batchjac.jacobian(net, x, chunk_size=4, differentiable=True, **kw) \
            if "max_memory" not in kw else batchjac.jacobian(net, x, differentiable=True, **kw)
        assert torch.allclose(j, ref_j)
        _assert_grads([a.numpy() for a in torch.autograd.grad(j.sin().sum(), wrt)],
                      [a.numpy() for a in ref], np.float64)
    # each chunk runs the model once, then once more in the loss's backward pass (not once
    # more per output inside the forward: the checkpoint's recomputation, kept until then)
    calls = []
    net.register_forward_hook(lambda *a: calls.append(a[1][0].shape[0]))
    j = batchjac.jacobian(net, x, mode="reverse", chunk_size=4, differentiable=True)
    assert calls == [4, 4, 2]
    torch.autograd.grad(j.sum(), wrt)
    assert sorted(calls[-3:]) == [2, 4, 4]
    with pytest.raises(InputError, match="mode='forward-over-reverse' cannot be recomputed"):
        batchjac.hessian(net, x, mode="forward-over-reverse", chunk_size=4, differentiable=True)
    h = batchjac.hessian(net, x, chunk_size=4, differentiable=True)
    assert h.requires_grad


def test_torch_refuses_a_module_of_another_dtype() -> None:
    torch = pytest.importorskip("torch")

    net = torch.nn.Linear(3, 2)  # float32
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(InputError, match="module's own dtype"):
        batchjac.jacobian(net, x, differentiable=True)


def test_torch_random_layers_forced_into_training_mode_are_refused() -> None:
    torch = pytest.importorskip("torch")

    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Tanh(),
                              torch.nn.Linear(8, 1)).train()
    x = torch.randn(5, 3)
    with pytest.raises(batchjac.ModelError, match=r"Dropout.*Drop train_mode"):
        batchjac.jacobian(net, x, differentiable=True, backend_options={"train_mode": True})
    # by default eval mode, as the compiled path: no mask, the module's mode kept
    with pytest.warns(batchjac.TrainingModeWarning):
        j = batchjac.jacobian(net, x, differentiable=True)
    assert net.training
    assert torch.allclose(j, _torch_native("jacobian", net.eval(), x, None))


def test_torch_numpy_inputs_give_parameter_gradients() -> None:
    torch = pytest.importorskip("torch")

    net, _, _ = _torch_case(np.float64)
    x = np.random.default_rng().normal(size=(5, 3))
    j = batchjac.jacobian(net, x, differentiable=True)
    assert isinstance(j, torch.Tensor)
    assert j.requires_grad
    ref = _torch_native("jacobian", net, torch.tensor(x), None)
    assert torch.allclose(j, ref)


# -- JAX -------------------------------------------------------------------------------------

@pytest.fixture
def x64() -> Iterator[None]:
    """JAX's x64 mode for the test (float64 arrays)."""
    pytest.importorskip("jax")
    with jax_x64():
        yield


def _jax_case(dtype: Any, n: int = 6) -> tuple[Any, Any, Any, Any]:
    pytest.importorskip("jax")
    import jax.numpy as jnp

    rng = np.random.default_rng()
    params = {"w1": jnp.asarray(rng.normal(size=(3, 8)), dtype),
              "b1": jnp.asarray(rng.normal(size=8), dtype),
              "w2": jnp.asarray(rng.normal(size=(8, 2)), dtype)}
    x = jnp.asarray(rng.normal(size=(n, 3)), dtype)
    v = jnp.asarray(rng.normal(size=(n, 3)), dtype)
    return params, x, v, jnp


try:  # (module level, as a user's model refers to it: batchjac detects JAX by it)
    import jax.numpy as jnp
except ImportError:  # pragma: no cover - the oldest environment has JAX
    jnp = None


def _jax_net(p: Any, x: Any) -> Any:
    return jnp.tanh(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])


def _jax_native(kind: str, p: Any, x: Any, v: Any) -> Any:
    import jax
    import jax.numpy as jnp

    def one(xi: Any) -> Any:
        return _jax_net(p, xi)

    if kind == "jacobian":
        return jax.vmap(jax.jacrev(one))(x)
    return _reduce(kind, jax.vmap(jax.jacfwd(jax.jacrev(one)))(x), None, v, jnp)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_jax_gradients_match_jax_transforms(kind: str, dtype: Any, x64: None) -> None:
    import jax
    import jax.numpy as jnp

    params, x, v, _ = _jax_case(dtype)

    def loss_of(result: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        return lambda p, x: jnp.sum(jnp.sin(result(p, x)))

    ref = jax.grad(loss_of(lambda p, x: _jax_native(kind, p, x, v)), argnums=(0, 1))(params, x)
    for kw in ({}, {"chunk_size": 4}):
        def ours(p: Any, x: Any, kw: Any = kw) -> Any:
            return _call(kind, _jax_net, x, v, backend_options={"params": p}, **kw)

        # (under the caller's jit, as a training step runs: eagerly, below)
        got = jax.jit(jax.grad(loss_of(ours), argnums=(0, 1)))(params, x)
        third = dtype == np.float32 and kind != "jacobian"  # (RTOL_THIRD32)
        _assert_grads(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), dtype,
                      rtol=RTOL_THIRD32 if third else None)


def test_jax_eager_gradient_without_jit(x64: None) -> None:
    import jax

    params, x, _, _ = _jax_case(np.float64)

    def loss(p: Any, lap: Callable[[Any], Any]) -> Any:
        return jnp.sum(jnp.sin(lap(p)))

    want = jax.grad(loss)(params, lambda p: _jax_native("laplacian", p, x, None))
    got = jax.grad(loss)(params, lambda p: batchjac.laplacian(
        _jax_net, x, differentiable=True, backend_options={"params": p}))
    _assert_grads(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), np.float64)


def test_jax_under_vmap_of_the_callers_function(x64: None) -> None:
    """The caller's own ``vmap`` over several parameter sets (an ensemble)."""
    import jax
    import jax.numpy as jnp

    params, x, v, _ = _jax_case(np.float64)
    ensemble = jax.tree_util.tree_map(lambda a: jnp.stack([a, 2 * a]), params)
    got = jax.vmap(lambda p: batchjac.laplacian(_jax_net, x, differentiable=True,
                                                backend_options={"params": p}))(ensemble)
    for i in range(2):
        one = jax.tree_util.tree_map(lambda a, i=i: a[i], ensemble)
        want = _jax_native("laplacian", one, x, v)
        np.testing.assert_allclose(got[i], want, rtol=1e-10, atol=1e-10 * float(abs(want).max()))


def test_jax_custom_vjp_falls_back_to_reverse_order(x64: None) -> None:
    """A ``jax.custom_vjp`` function has no forward rule: mode='auto' takes the other order,
    an asked forward order says why (JAX's api_test custom_vjp cases)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def f(x: Any) -> Any:
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))
    params, x, _, _ = _jax_case(np.float64)

    def net(p: Any, x: Any) -> Any:
        return f(x @ p["w1"]) @ p["w2"]

    got = batchjac.laplacian(net, x, differentiable=True, backend_options={"params": params})
    # (the custom rule's own second derivative: d/dx cos(x) through the rule is 0, so the
    # reference is the same transforms over the same function)
    ref = jax.vmap(lambda xi: jnp.trace(jax.jacrev(jax.jacrev(lambda z: net(params, z)))(xi),
                                        axis1=-2, axis2=-1))(x)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    with pytest.raises(batchjac.ModelError, match="custom_vjp"):
        batchjac.laplacian(net, x, differentiable=True, mode="forward-over-forward",
                           backend_options={"params": params})


def test_jax_concrete_inputs_inside_the_callers_jit(x64: None) -> None:
    """Points closed over by the caller's jitted loss are concrete arrays, but every operation
    on them inside the trace is traced: the NaN check must not read them there."""
    import jax

    params, x, _, _ = _jax_case(np.float64)

    @jax.jit
    def loss(p: Any) -> Any:
        return jnp.sum(batchjac.laplacian(_jax_net, x, differentiable=True,
                                          backend_options={"params": p}) ** 2)

    want = jax.grad(lambda p: jnp.sum(_jax_native("laplacian", p, x, None) ** 2))(params)
    got = jax.grad(loss)(params)
    _assert_grads(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), np.float64)


def test_jax_empty_batch(x64: None) -> None:
    params, x, _, _ = _jax_case(np.float64)
    got = batchjac.hessian(_jax_net, x[:0], differentiable=True,
                           backend_options={"params": params})
    assert got.shape == (0, 2, 3, 3)


# -- TensorFlow ------------------------------------------------------------------------------

def _tf_case(dtype: Any, n: int = 6) -> tuple[Any, Any, Any]:
    tf = pytest.importorskip("tensorflow")
    keras = tf.keras
    rng = np.random.default_rng()
    name = np.dtype(dtype).name
    model = keras.Sequential([keras.Input((3,), dtype=name),
                              keras.layers.Dense(8, activation="tanh", dtype=name),
                              keras.layers.Dense(2, activation="tanh", dtype=name)])
    x = tf.constant(rng.normal(size=(n, 3)).astype(dtype))
    v = tf.constant(rng.normal(size=(n, 3)).astype(dtype))
    return model, x, v


def _tf_native(kind: str, model: Any, x: Any, v: Any) -> Any:
    """Nested tapes inside the caller's tape (the expert's composition)."""
    import tensorflow as tf

    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = model(x)
        jac = inner.batch_jacobian(y, x)
    if kind == "jacobian":
        return jac
    hess = outer.batch_jacobian(jac, x)  # (n, m, k, k)
    if kind == "hessian":
        return hess
    if kind == "diagonal":
        return tf.linalg.diag_part(hess)
    if kind == "laplacian":
        return tf.linalg.trace(hess)
    return tf.einsum("nmkj,nj->nmk", hess, v)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_tensorflow_gradients_match_nested_tapes(kind: str, dtype: Any) -> None:
    import tensorflow as tf

    model, x, v = _tf_case(dtype)

    def grads(result: Callable[[], Any]) -> list[Any]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.sin(result()))
        return [None if g is None else g.numpy()
                for g in tape.gradient(loss, [*model.trainable_variables, x])]

    ref = grads(lambda: _tf_native(kind, model, x, v))
    for kw in ({}, {"chunk_size": 4}):
        _assert_grads(grads(lambda kw=kw: _call(kind, model, x, v, **kw)), ref, dtype)


def test_tensorflow_inside_the_callers_tf_function_and_optimizer_step() -> None:
    import tensorflow as tf

    model, x, _ = _tf_case(np.float32, n=32)
    opt = tf.keras.optimizers.Adam(1e-2)
    f = tf.ones((32, 2))

    def loss_of(lap: Any) -> Any:
        return tf.reduce_mean((lap - f) ** 2)

    @tf.function
    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_of(batchjac.laplacian(model, x, differentiable=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss, grads

    with tf.GradientTape() as tape:
        ref_loss = loss_of(_tf_native("laplacian", model, x, None))
    ref = tape.gradient(ref_loss, model.trainable_variables)
    loss, grads = step(x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    _assert_grads([g.numpy() for g in grads], [r.numpy() for r in ref], np.float32)
    losses = [float(step(x)[0]) for _ in range(15)]
    assert losses[-1] < losses[0]


def test_tensorflow_large_chunk_laplacian_gradient() -> None:
    """More rows than the compiled forward Laplacian's blocks: one block here (the gradient of
    a loop of blocks is slow to build), the same gradients as nested tapes."""
    import tensorflow as tf

    model, _, _ = _tf_case(np.float64)
    x = tf.constant(np.random.default_rng().normal(size=(4200, 3)))

    def grads(result: Callable[[], Any]) -> list[Any]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sin(result()))
        return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]

    _assert_grads(grads(lambda: batchjac.laplacian(model, x, differentiable=True)),
                  grads(lambda: _tf_native("laplacian", model, x, None)), np.float64)


def test_tensorflow_autograph_leaves_batchjac_unconverted() -> None:
    """Inside the caller's tf.function (AutoGraph on), batchjac's Python is not converted,
    whichever of batchjac and TensorFlow is imported first: no conversion log line."""
    from tests.helpers import run_in_fresh_process

    out = run_in_fresh_process("""
        import os, sys
        os.environ["AUTOGRAPH_VERBOSITY"] = "1"
        import batchjac, numpy as np, tensorflow as tf
        from tensorflow.python.autograph.impl import api
        converted = []
        original = api._convert_actual
        def spy(entity, program_ctx):
            converted.append(getattr(entity, "__module__", ""))
            return original(entity, program_ctx)
        api._convert_actual = spy
        model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(4, activation="tanh"),
                                     tf.keras.layers.Dense(1)])
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(batchjac.laplacian(model, x, differentiable=True))
            return tape.gradient(loss, model.trainable_variables)
        step(tf.constant(np.random.default_rng().normal(size=(8, 2)), tf.float32))
        print(sorted({m for m in converted if m.startswith("batchjac")}))
    """)
    assert out.strip().splitlines()[-1] == "[]"


def test_keras_fit_with_a_laplacian_in_its_train_step() -> None:
    """Keras's own training loop: a model whose train_step puts batchjac's Laplacian in the
    loss trains with fit (a dataset batched with drop_remainder=True: static shapes)."""
    tf = pytest.importorskip("tensorflow")
    keras = tf.keras

    class PINN(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(16, activation="tanh"),
                                         keras.layers.Dense(1)])
            self.losses_seen: list[Any] = []

        def call(self, x: Any) -> Any:
            return self.net(x)

        def train_step(self, data: Any) -> Any:
            x, f = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((batchjac.laplacian(self.net, x, differentiable=True) - f) ** 2)
            grads = tape.gradient(loss, self.net.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.net.trainable_variables))
            return {"pinn": loss}

    model = PINN()
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, (128, 2)).astype(np.float32)
    f = np.ones((128, 1), np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, f)).batch(32, drop_remainder=True)

    def loss_now() -> float:
        return float(tf.reduce_mean((_tf_native("laplacian", model.net, tf.constant(x), None)
                                     - f) ** 2))

    before = loss_now()
    model.fit(data, epochs=8, verbose=0, shuffle=False)
    assert loss_now() < 0.5 * before


def test_tensorflow_unknown_batch_size_is_refused_with_the_fix() -> None:
    import tensorflow as tf

    model, x, _ = _tf_case(np.float32)

    @tf.function(input_signature=[tf.TensorSpec((None, 3), tf.float32)])
    def f(x: Any) -> Any:
        return batchjac.laplacian(model, x, differentiable=True)

    with pytest.raises(Exception, match="drop_remainder=True"):
        f(x)


def test_tensorflow_refuses_a_float64_copy_of_a_float32_model() -> None:
    model, x, _ = _tf_case(np.float32)
    with pytest.raises(InputError, match="model's own dtype"):
        batchjac.jacobian(model, np.asarray(x, np.float64), dtype="float64",
                          differentiable=True)


# -- every backend: the options a differentiable call cannot take ----------------------------

@pytest.mark.parametrize("option", [{"out": np.zeros((4, 2, 3))}, {"client": object()},
                                    {"progress": True}, {"output": "numpy"}])
def test_refused_options_name_themselves(option: dict[str, Any]) -> None:
    net, x, _ = _torch_case(np.float64, n=4)
    name = next(iter(option))
    with pytest.raises(InputError, match=f"`{name}"):
        batchjac.jacobian(net, x, differentiable=True, **option)


def test_arrays_of_another_framework_are_refused() -> None:
    pytest.importorskip("jax")
    import jax.numpy as jnp

    net, _, _ = _torch_case(np.float64, n=4)
    with pytest.raises(InputError, match="cannot cross frameworks"):
        batchjac.jacobian(net, jnp.ones((4, 3)), differentiable=True)
