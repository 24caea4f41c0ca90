"""Each private or version-specific part of torch the PyTorch backend uses (its compat module:
census #13-21 of the engine review, torch 2.5's ``OutOfMemoryError`` and the reads of custom
autograd Functions), removed or renamed as a torch upgrade would: the numbers stay right against
float64 references (closed forms of a tanh MLP, torch.func's ``jacrev`` and ``hessian`` per
instance), slower at most; where no fallback can exist, an error that names the torch version.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import run_in_fresh_process

torch = pytest.importorskip("torch")

from batchjac import _backends  # noqa: E402
from batchjac._backends.torch import compat, cost, errors, laplacian, state  # noqa: E402
from batchjac._backends.torch.state import _load_forward_ad  # noqa: E402

_load_forward_ad()  # (as the kernels do: its import's deprecation warning silenced)
importlib.import_module("torch._dynamo")  # (loaded before a test hides a module it imports)

#: the compat functions that remember what they found, cleared around each test
CACHED = (compat.mode_dependent_layers, compat.dispatch_mode, compat.pytree,
          compat.out_of_memory_errors, compat.functions_readable)


@pytest.fixture(autouse=True)
def _fresh_compat() -> Any:
    for f in CACHED:
        f.cache_clear()
    yield
    for f in CACHED:
        f.cache_clear()


def mlp(seed: int = 0, dtype: Any = None) -> Any:
    """3 unknowns -> 8 tanh units -> 2 outputs."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return net.to(dtype or torch.float64)


def closed_form(net: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(J, H, L)`` per instance of :func:`mlp`'s net, in float64 from its weights."""
    w1, b1, w2 = (np.asarray(p.detach().double().numpy()) for p in
                  (net[0].weight, net[0].bias, net[2].weight))
    t = np.tanh(x @ w1.T + b1)
    d = 1 - t * t
    jac = np.einsum("oh,nh,hi->noi", w2, d, w1)
    hess = np.einsum("oh,nh,hi,hj->noij", w2, -2 * t * d, w1, w1)
    return jac, hess, np.trace(hess, axis1=-2, axis2=-1)


def func_reference(f: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(J, H)`` per instance: torch.func's jacrev and hessian of one row, vmap-ed."""
    xt = torch.tensor(x)

    def one(a: Any) -> Any:
        return f(a[None])[0]

    return (torch.func.vmap(torch.func.jacrev(one))(xt).detach().numpy(),
            torch.func.vmap(torch.func.hessian(one))(xt).detach().numpy())


def curved(seed: int) -> Any:
    """3 unknowns to 2 outputs through the operations the forward Laplacian's tables name
    (matrix products, tanh, sin, exp, a product and a quotient of two varying values)."""
    g = np.random.default_rng(seed)
    w1, w2 = torch.tensor(g.normal(size=(3, 6)) * 0.7), torch.tensor(g.normal(size=(6, 2)) * 0.7)

    def f(x: Any) -> Any:
        z = x @ w1
        a = torch.tanh(z) + torch.sin(z) * torch.exp(-0.3 * z * z) / (1 + z * z)
        return a @ w2

    return f


def rows(n: int = 6, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 3))


def bound_of(model: Any) -> Any:
    return next(iter(_backends._bound[model].values()))


def assert_mlp_right(x: np.ndarray, **options: Any) -> Any:
    """A fresh net's Jacobians, Hessians and Laplacians equal the closed form."""
    jac, hess, lap = closed_form(mlp(), x)
    np.testing.assert_allclose(batchjac.jacobian(mlp(), x, **options), jac, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(batchjac.hessian(mlp(), x), hess, rtol=1e-10, atol=1e-12)
    net = mlp()
    np.testing.assert_allclose(batchjac.laplacian(net, x), lap, rtol=1e-10, atol=1e-12)
    return net


def test_this_torch_is_read_as_the_backend_expects() -> None:
    """On the tested torch every internal is found (the numbers tests below then check the
    fallbacks, not what this torch does anyway)."""
    assert compat.dispatch_mode(cost.RowBytes) is not None
    assert compat.pytree() is not None
    assert compat.functions_readable()
    assert compat.aten_name(torch.ops.aten.mm.default) == "mm"
    assert isinstance(compat.version(torch.ones(1)), int)
    assert torch.nn.modules.batchnorm._BatchNorm in compat.mode_dependent_layers()


# ---- #13: batchnorm._BatchNorm, dropout._DropoutNd ---------------------------------------------


def test_training_mode_layers_without_the_private_bases(monkeypatch: Any) -> None:
    """The private bases renamed: the training-mode warning names the layers by their public
    classes, and the Jacobians are eval mode's (before, the backend did not import)."""
    monkeypatch.delattr(torch.nn.modules.batchnorm, "_BatchNorm")
    monkeypatch.delattr(torch.nn.modules.dropout, "_DropoutNd")
    layers = compat.mode_dependent_layers()
    assert torch.nn.BatchNorm1d in layers
    assert torch.nn.Dropout in layers
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Dropout(0.5),
                              torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    net.eval()
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    x = rows()
    want, _ = func_reference(net, x)
    net.train()
    with pytest.warns(batchjac.TrainingModeWarning, match=r"1 \(BatchNorm1d\), 2 \(Dropout\)"):
        got = batchjac.jacobian(net, x)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    assert net.training
    assert net[1].training


def test_private_modules_and_bases_missing_at_import_in_a_fresh_process() -> None:
    """The backend imports and computes where torch has neither private base (#13) and
    ``torch.utils._python_dispatch`` and ``torch.utils._pytree`` cannot be imported (#14-15;
    made so after torch loaded, as the engine review tried): before, the import failed, and
    with the dispatch module gone every jacobian raised "Calling the model failed:
    ModuleNotFoundError", a cost estimate blamed on the model."""
    out = run_in_fresh_process("""
        import sys
        import numpy as np
        import torch, torch._dynamo
        del torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.dropout._DropoutNd
        sys.modules["torch.utils._python_dispatch"] = None
        sys.modules["torch.utils._pytree"] = None
        import batchjac
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(),
                                  torch.nn.Linear(8, 2)).double()
        x = np.random.default_rng(0).normal(size=(6, 3))
        w1, b1, w2 = (p.detach().numpy() for p in (net[0].weight, net[0].bias, net[2].weight))
        t = np.tanh(x @ w1.T + b1)
        d = 1 - t * t
        jac = np.einsum("oh,nh,hi->noi", w2, d, w1)
        lap = np.einsum("oh,nh->no", w2, -2 * t * d * (w1 * w1).sum(1))
        errors = [np.abs(batchjac.jacobian(net, x, mode=m) - jac).max()
                  for m in ("forward", "reverse")]
        errors += [np.abs(batchjac.laplacian(net, x, mode=m) - lap).max()
                   for m in ("auto", "forward-over-forward")]
        print("ERR", max(errors))
    """)
    assert float(out.split("ERR")[1]) < 1e-12, out


# ---- #14: torch.utils._python_dispatch ----------------------------------------------------------


@pytest.mark.parametrize("how", ["unimportable", "none", "raises"])
def test_no_dispatch_mode(how: str, monkeypatch: Any) -> None:
    """Without dispatch modes: no working-set estimate, no forward Laplacian (the order's own
    build), the same numbers."""
    if how == "unimportable":
        monkeypatch.delattr(torch.utils, "_python_dispatch")
        monkeypatch.setitem(sys.modules, "torch.utils._python_dispatch", None)
    elif how == "none":
        monkeypatch.setattr(compat, "dispatch_mode", lambda handler: None)
    else:
        def changed(handler: Any) -> Any:
            raise TypeError("TorchDispatchMode changed")

        monkeypatch.setattr(compat, "dispatch_mode", changed)
    net = mlp()
    xt = torch.tensor(rows())
    if how != "raises":
        y, per_row = cost.counted(lambda: net(xt), 6)
        assert per_row is None
        torch.testing.assert_close(y, net(xt))
    traced = []
    real = laplacian.trace
    monkeypatch.setattr(laplacian, "trace", lambda *a: traced.append(1) or real(*a))
    net = assert_mlp_right(rows())
    assert bound_of(net)._row_bytes_seen is None
    assert traced  # (the forward Laplacian was tried, and failed)


# ---- #15: torch.utils._pytree -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["unimportable", "none"])
def test_no_pytree(how: str, monkeypatch: Any) -> None:
    if how == "unimportable":
        monkeypatch.setitem(sys.modules, "torch.utils._pytree", None)
    else:
        monkeypatch.setattr(compat, "pytree", lambda: None)
    net = mlp()
    xt = torch.tensor(rows())
    assert cost.counted(lambda: net(xt), 6)[1] is None
    with pytest.raises(NotImplementedError, match="_pytree"):
        laplacian.trace(net, xt)
    assert_mlp_right(rows())


# ---- #16: TorchDispatchMode._should_skip_dynamo ----------------------------------------------------


@pytest.mark.parametrize("how", ["renamed", "removed"])
def test_dynamo_hook_of_dispatch_modes(how: str, monkeypatch: Any) -> None:
    """Renamed, batchjac's override is not made (TorchDynamo then wraps the handlers: slower
    first calls); removed, torch's own subclass hook fails and no mode is made (no estimate, no
    forward Laplacian). The numbers stay."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if how == "renamed":
        monkeypatch.setattr(compat, "_SKIP_DYNAMO", "_should_skip_dynamo_renamed")
    else:
        monkeypatch.delattr(TorchDispatchMode, "_should_skip_dynamo")
    mode = compat.dispatch_mode(cost.RowBytes)
    net = mlp()
    xt = torch.tensor(rows())
    if how == "renamed":
        assert mode is not None
        assert "_should_skip_dynamo" not in mode.__dict__
        assert cost.counted(lambda: net(xt), 6)[1] == (8 + 8 + 2) * 8
    else:
        assert mode is None
        assert cost.counted(lambda: net(xt), 6)[1] is None
    assert_mlp_right(rows())


# ---- #17: Tensor._version ------------------------------------------------------------------------


def _unreadable_versions(how: str, monkeypatch: Any) -> None:
    if how == "hook":
        monkeypatch.setattr(compat, "version", lambda t: None)
    else:
        def renamed(self: Any) -> Any:
            raise AttributeError("'Tensor' object has no attribute '_version'")

        monkeypatch.setattr(torch.Tensor, "_version", property(renamed))
        assert compat.version(torch.ones(1)) is None


@pytest.mark.parametrize("how", ["hook", "attribute"])
def test_cast_weights_without_versions_are_never_stale(how: str, monkeypatch: Any) -> None:
    """float32 weights, float64 rows: batchjac runs float64 copies of the weights, made again
    where a weight changed in place. Where versions cannot be read, every call makes them
    again: the second call sees the changed weights."""
    _unreadable_versions(how, monkeypatch)
    net, x = mlp(4, torch.float32), rows()
    np.testing.assert_allclose(batchjac.jacobian(net, x), closed_form(net, x)[0], rtol=1e-12,
                               atol=1e-13)
    with torch.no_grad():
        net[0].weight.mul_(1.5)
        net[2].weight.add_(0.25)
    np.testing.assert_allclose(batchjac.jacobian(net, x), closed_form(net, x)[0], rtol=1e-12,
                               atol=1e-13)


@pytest.mark.parametrize("how", ["hook", "attribute"])
def test_laplacian_tapes_without_versions_are_never_stale(how: str, monkeypatch: Any) -> None:
    """The forward Laplacian's tape holds what the model computed from its weights (here a
    Python number, ``float(scale)``): traced again where a weight changed. Where versions cannot
    be read, traced again on every call."""
    _unreadable_versions(how, monkeypatch)

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(5)
            self.scale = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

        def forward(self, x: Any) -> Any:
            return self.net(x) * float(self.scale)

    model, x = Scaled(), rows()
    traced = []
    real = laplacian.trace
    monkeypatch.setattr(laplacian, "trace", lambda *a: traced.append(1) or real(*a))
    lap = closed_form(model.net, x)[2]
    np.testing.assert_allclose(batchjac.laplacian(model, x), lap, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        model.scale.mul_(3.0)
    np.testing.assert_allclose(batchjac.laplacian(model, x), 3 * lap, rtol=1e-10, atol=1e-12)
    assert len(traced) >= 2


# ---- #18, #19: forward_ad._maybe_load_decompositions, warnings._filters_mutated ------------------


def test_forward_decompositions_loader_renamed(monkeypatch: Any) -> None:
    monkeypatch.setattr(compat, "_DECOMPOSITIONS", "_maybe_load_decompositions_renamed")
    monkeypatch.setattr(state, "_forward_ad_loaded", False)
    assert compat.load_forward_decompositions() is False
    state._load_forward_ad()
    x = rows()
    jac, hess, _ = closed_form(mlp(), x)
    np.testing.assert_allclose(batchjac.jacobian(mlp(), x, mode="forward"), jac, rtol=1e-12,
                               atol=1e-13)
    np.testing.assert_allclose(batchjac.hessian(mlp(), x, mode="forward-over-forward"), hess,
                               rtol=1e-10, atol=1e-12)


def test_warning_filter_hook_renamed(monkeypatch: Any) -> None:
    """The silenced warning is silenced inside the block only, and the filters are as before
    (the per-module caches of warnings shown are then not reset: cosmetic)."""
    monkeypatch.setattr(compat, "_FILTERS_MUTATED", "_filters_mutated_renamed")
    before = list(warnings.filters)
    with state._silenced("batchjac compat test", UserWarning):
        warnings.warn("batchjac compat test", UserWarning, stacklevel=1)
    assert warnings.filters == before
    with pytest.warns(UserWarning, match="batchjac compat test"):
        warnings.warn("batchjac compat test", UserWarning, stacklevel=1)
    x = rows()
    np.testing.assert_allclose(batchjac.jacobian(mlp(), x, mode="reverse"),
                               closed_form(mlp(), x)[0], rtol=1e-12, atol=1e-13)


# ---- #20: "torch._dynamo" in sys.modules ---------------------------------------------------------


@pytest.mark.parametrize("loaded", [True, False])
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_dynamo_heuristic_either_way(loaded: bool, mode: str, monkeypatch: Any) -> None:
    """Whatever the check says (a renamed module reads as never loaded), the first build is
    one that computes the same Jacobians."""
    monkeypatch.setattr(compat, "dynamo_loaded", lambda: loaded)
    x = rows(40)
    np.testing.assert_allclose(batchjac.jacobian(mlp(), x, mode=mode), closed_form(mlp(), x)[0],
                               rtol=1e-12, atol=1e-13)


# ---- #21: ATen names ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["unreadable", "unknown", "foreign"])
def test_aten_names_changed(how: str, monkeypatch: Any) -> None:
    """Names that cannot be read or that the tables do not know take the general rule (the
    same Laplacian); an operation that reads as outside ATen is refused by the forward
    Laplacian, and the order's own build computes it."""
    real = compat.aten_name
    fake = {"unreadable": lambda op: "", "unknown": lambda op: f"{real(op)}_renamed",
            "foreign": lambda op: None}[how]
    monkeypatch.setattr(compat, "aten_name", fake)
    f, x = curved(2), rows(7)
    jac, hess = func_reference(f, x)
    lap = np.trace(hess, axis1=-2, axis2=-1)
    xt = torch.tensor(x)
    tape = laplacian.trace(f, xt)
    if how == "foreign":
        with pytest.raises(NotImplementedError, match="not an ATen operation"):
            laplacian.run(tape, [xt], 0)
    else:
        _, dy, got = laplacian.run(tape, [xt], 0)
        np.testing.assert_allclose(dy.permute(1, 2, 0).numpy(), jac, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got.numpy(), lap, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(batchjac.laplacian(f, x), lap, rtol=1e-10, atol=1e-12)


def test_a_custom_op_named_like_an_aten_op_is_not_taken_for_it() -> None:
    """A custom op ``batchjac_compat_test::tanh`` (that computes a sine) read by its name alone
    took the tanh rule: a wrong Laplacian, silently. Outside ATen, the forward Laplacian
    refuses it (torch's forward mode passes no tangent through a custom op without a forward
    rule) and forward over reverse computes it: the true Laplacian."""
    if not hasattr(torch.library, "custom_op"):
        pytest.skip("torch.library.custom_op: torch 2.4+")
    op = _custom_tanh()
    assert compat.aten_name(torch.ops.batchjac_compat_test.tanh.default) is None
    torch.manual_seed(6)
    w = torch.randn(3, 4, dtype=torch.float64)

    def f(x: Any) -> Any:
        return op(x @ w).sum(-1, keepdim=True)

    x = rows(5)
    want = -(np.sin(x @ w.numpy()) * (w.numpy() ** 2).sum(0)).sum(-1, keepdims=True)
    np.testing.assert_allclose(batchjac.laplacian(f, x), want, rtol=1e-10, atol=1e-12)


_CUSTOM: list[Any] = []


def _custom_tanh() -> Any:
    if not _CUSTOM:
        @torch.library.custom_op("batchjac_compat_test::tanh", mutates_args=())
        def tanh(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x)

        def setup(ctx: Any, inputs: Any, output: Any) -> None:
            ctx.save_for_backward(inputs[0])

        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            return g * torch.cos(x)

        tanh.register_autograd(backward, setup_context=setup)
        _CUSTOM.append(tanh)
    return _CUSTOM[0]


# ---- torch.OutOfMemoryError (torch 2.5+) --------------------------------------------------------


def test_out_of_memory_class_missing(monkeypatch: Any) -> None:
    """torch before 2.5 has no ``torch.OutOfMemoryError``: reading it in the handler of a
    failed forward mode raised AttributeError there, in place of the fallback to reverse mode."""
    monkeypatch.delattr(torch, "OutOfMemoryError", raising=False)
    assert MemoryError in compat.out_of_memory_errors()
    assert not errors._out_of_memory(RuntimeError("an operator failed"))
    assert errors._out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))

    class Cube(torch.autograd.Function):  # forward(ctx, x): torch.func's jvp refuses it
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

    class Wide(torch.nn.Module):  # 9 outputs of 3 unknowns: auto plans forward mode
        def forward(self, x: Any) -> Any:
            return torch.cat([Cube.apply(x), x, 2 * x], dim=1)

    monkeypatch.setattr(compat, "dynamo_loaded", lambda: True)  # (torch.func first)
    x, model = rows(), Wide()
    cube = np.zeros((6, 3, 3))
    cube[:, [0, 1, 2], [0, 1, 2]] = 3 * x**2
    want = np.concatenate([cube, np.broadcast_to(np.eye(3), cube.shape),
                           np.broadcast_to(2 * np.eye(3), cube.shape)], axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", batchjac.ForwardModeFallbackWarning)
        got = batchjac.jacobian(model, x, mode="auto")
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # (reverse mode after it: the Function has no forward-mode rule, which batchjac reads from
    # the graph before torch.func's jvp would say so)
    assert "Cube has no forward-mode rule" in str(bound_of(model).forward_failure)


# ---- custom autograd Functions: _forward_cls, AccumulateGrad.variable, once_differentiable --------


def _functions() -> dict[str, Any]:
    from torch.autograd.function import once_differentiable

    class OldStyle(torch.autograd.Function):
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
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

    return {"old": OldStyle, "func": FuncForm, "twice": Twice}


def _through(function: Any) -> Any:
    class Model(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return function.apply(x)

    return Model()


@pytest.mark.filterwarnings("ignore::batchjac.ForwardModeFallbackWarning")  # (the probes')
@pytest.mark.parametrize("how", ["unreadable", "forward_cls", "once_marker"])
def test_custom_functions_that_cannot_be_read(how: str, monkeypatch: Any) -> None:
    """Where a graph node's Function, or whether its backward is once differentiable, cannot
    be read (the self-check fails), every custom Function is taken as not twice
    differentiable: torch.func's forward over reverse computes it where it can (the true
    Hessian), an error naming the torch version where it cannot, never a zero; a model
    without custom Functions is unaffected."""
    if how == "unreadable":
        monkeypatch.setattr(compat, "functions_readable", lambda: False)
    elif how == "forward_cls":
        monkeypatch.setattr(compat, "_FORWARD_CLS", "_forward_cls_renamed")
    else:
        monkeypatch.setattr(compat, "_ONCE_CODE", None)
    assert not compat.functions_readable()
    x = rows(4)
    want = np.zeros((4, 3, 3, 3))
    for o in range(3):
        want[:, o, o, o] = 6 * x[:, o]
    functions = _functions()
    got = batchjac.hessian(_through(functions["func"]), x, mode="forward-over-reverse")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for name in ("old", "twice"):
        with pytest.raises(batchjac.ModelError, match=re.escape(f"torch {torch.__version__}")):
            batchjac.hessian(_through(functions[name]), x, mode="forward-over-reverse")
    with pytest.raises(batchjac.ModelError, match=re.escape(f"torch {torch.__version__}")):
        batchjac.hessian(_through(functions["func"]), x, mode="forward-over-forward",
                         diagonal=True)
    _, hess, _ = closed_form(mlp(), x)
    np.testing.assert_allclose(batchjac.hessian(mlp(), x, mode="forward-over-forward"), hess,
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(batchjac.hessian(mlp(), x, mode="forward-over-reverse"), hess,
                               rtol=1e-10, atol=1e-12)


def test_compiled_models_whose_original_cannot_be_read(monkeypatch: Any) -> None:
    """torch.compile's attributes renamed (``_orig_mod``, ``_torchdynamo_orig_callable``): the
    compiled model is computed as it is, compiled (a counting backend sees its graphs), and
    the Jacobians stay right against the uncompiled module's."""
    torch.manual_seed(41)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = np.random.default_rng(41).normal(size=(6, 4)).astype(np.float32)
    want = torch.func.vmap(torch.func.jacrev(module))(torch.from_numpy(x)).detach().numpy()
    graphs: list[int] = []

    def counting(gm: Any, example_inputs: Any) -> Any:
        graphs.append(1)
        return gm.forward

    compiled = torch.compile(module, backend=counting)
    assert compat.uncompiled(compiled) is module
    monkeypatch.setattr(compat, "_ORIG_MOD", "_renamed_orig_mod")
    monkeypatch.setattr(compat, "_ORIG_CALLABLE", "_renamed_orig_callable")
    assert compat.uncompiled(compiled) is None
    assert compat.uncompiled(torch.compile(lambda v: module(v), backend=counting)) is None
    got = batchjac.jacobian(compiled, x, mode="reverse")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
