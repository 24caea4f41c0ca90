"""Forward over reverse on plain autograd: the PyTorch second-order kernels' "autograd" build
(``TorchSecondKernel._autograd_over_reverse``), the untimed first build of Hessians, their
diagonal and Hessian-vector products, which imports nothing (torch.func's first use loads
torch._dynamo, 0.6-1.4 s).

References: ``torch.func.hessian`` / ``jacrev`` per instance (vmap) in float64, the closed
form of a quadratic, and the kernel's torch.func build ("plain") on the same rows.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import race_now, rng

torch = pytest.importorskip("torch")

from batchjac._backends.torch.state import _load_forward_ad  # noqa: E402
from batchjac._bind import prepare  # noqa: E402
from batchjac._validate import normalize  # noqa: E402

_load_forward_ad()  # (torch.func.hessian's jacfwd: its import's deprecation warning silenced)


def curved(seed: int) -> Any:
    """3 unknowns and 2 known inputs to 2 outputs, through tanh, sin, exp, a product of two
    varying values and a quotient (every Hessian entry nonzero)."""
    r = rng(seed)
    w1 = torch.tensor(r.normal(size=(5, 6)) * 0.7)
    w2 = torch.tensor(r.normal(size=(6, 2)) * 0.7)

    def f(xh: Any) -> Any:  # the unknowns, then the known inputs (batchjac's concat layout)
        z = xh @ w1
        a = torch.tanh(z) + torch.sin(z) * torch.exp(-0.3 * z * z) / (1 + z * z)
        return (a @ w2) * (1 + xh[:, :1])

    return f


def native(f: Any, x: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(J, H)`` per instance: torch.func's jacrev and hessian of one row, vmap-ed."""
    xt, ht = torch.tensor(x), torch.tensor(h)

    def one(a: Any, b: Any) -> Any:
        return f(torch.cat([a, b])[None])[0]

    jac = torch.func.vmap(torch.func.jacrev(one))(xt, ht)
    hess = torch.func.vmap(torch.func.hessian(one))(xt, ht)
    return jac.numpy(), hess.numpy()


def kernel_for(model: Any, kind: str, *arrays: np.ndarray) -> tuple[Any, np.ndarray, tuple[np.ndarray, ...]]:
    spec = normalize(arrays, wrt=None, dtype=None, nan_policy="raise")
    bound = prepare(model, spec, "torch", {})
    kernel = bound.second_kernel(kind, "forward-over-reverse", spec.n, True, True)  # type: ignore[arg-type]
    u, ctx = spec.chunk(0, spec.n)
    return kernel, u, ctx


@pytest.mark.parametrize("kind", ["hessian", "diagonal", "hvp"])
def test_the_autograd_build_equals_torch_func_and_the_build_it_replaces(kind: str) -> None:
    f = curved(1)
    r = rng(2)
    x, h = r.normal(size=(23, 3)), r.normal(size=(23, 2))
    v = r.normal(size=(23, 3))
    want_jac, want_hess = native(f, x, h)
    assert np.abs(want_hess).min() > 1e-6  # every entry curved: a wrong index would show
    want = {"hessian": want_hess, "diagonal": np.diagonal(want_hess, axis1=-2, axis2=-1),
            "hvp": np.einsum("nokj,nj->nok", want_hess, v)}[kind]
    results = {}
    for build in ("autograd", "plain"):
        kernel, u, ctx = kernel_for(f, kind, x, h)
        assert kernel.variants == ("autograd", "plain")
        kernel.use(build)
        out = kernel(u, (*ctx, v) if kind == "hvp" else ctx)
        results[build] = out
        name = {"hessian": "hessians", "diagonal": "diagonals", "hvp": "hvps"}[kind]
        np.testing.assert_allclose(out[name], want, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(out["jacobians"], want_jac, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(out["outputs"], f(torch.tensor(np.hstack([x, h]))).numpy(),
                                   rtol=1e-12, atol=1e-12)
    assert results["autograd"].keys() == results["plain"].keys()


def test_a_quadratic_and_a_scalar_output_through_the_public_call() -> None:
    """``y = x^T A x`` per instance (one output per row, shape (N,)): the Hessian is
    ``A + A^T``, by the first call's build (autograd, untimed), its Laplacian the trace."""
    r = rng(3)
    a = r.normal(size=(4, 4))
    at = torch.tensor(a)
    x = r.normal(size=(30, 4))
    model = lambda z: torch.einsum("ni,ij,nj->n", z, at, z)  # noqa: E731
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        hess = batchjac.hessian(model, x, backend="torch", explain=True)
    assert hess.shape == (30, 4, 4)
    np.testing.assert_allclose(hess, np.broadcast_to(a + a.T, (30, 4, 4)), rtol=1e-12, atol=1e-12)
    assert "plain autograd" in err.getvalue(), err.getvalue()
    diag = batchjac.hessian(model, x, backend="torch", diagonal=True, mode="forward-over-reverse")
    np.testing.assert_allclose(diag, np.broadcast_to(2 * np.diag(a), (30, 4)), rtol=1e-12, atol=1e-12)


def test_a_linear_model_and_an_unused_unknown_give_zeros_not_errors() -> None:
    """A gradient constant in x (no second derivative: autograd's graph ends there) and an
    unknown the model never reads: zero blocks."""
    x = rng(4).normal(size=(12, 3))
    w = torch.tensor(rng(5).normal(size=(2, 2)))
    model = lambda z: torch.cat([z[:, :2] @ w, torch.sin(z[:, :1])], -1)  # noqa: E731
    hess = batchjac.hessian(model, x, backend="torch", mode="forward-over-reverse")
    want = np.zeros((12, 3, 3, 3))
    want[:, 2, 0, 0] = -np.sin(x[:, 0])
    np.testing.assert_allclose(hess, want, rtol=1e-12, atol=1e-12)


def test_a_double_backward_failure_falls_back_to_torch_func(monkeypatch: Any) -> None:
    """Where a double-backward pass fails, the kernel computes torch.func's build instead
    (the same values) and says why; the build is not tried again."""
    from batchjac._backends import torch as backend

    f = curved(6)
    r = rng(7)
    x, h = r.normal(size=(9, 3)), r.normal(size=(9, 2))
    calls = [0]
    real = torch.autograd.grad

    def failing(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("create_graph"):
            calls[0] += 1
            raise RuntimeError("derivative for aten::fake is not implemented")
        return real(*args, **kwargs)

    monkeypatch.setattr(backend.torch.autograd, "grad", failing)
    kernel, u, ctx = kernel_for(f, "hessian", x, h)
    out = kernel(u, ctx)
    out = kernel(u, ctx)
    assert calls[0] == 1
    assert kernel.variant == "plain"
    assert kernel.variants == ("plain",)
    assert "plain autograd failed: derivative for aten::fake" in kernel.note
    monkeypatch.undo()
    np.testing.assert_allclose(out["hessians"], native(f, x, h)[1], rtol=1e-10, atol=1e-12)


def test_the_builds_are_raced_once_the_work_repays_it(monkeypatch: Any) -> None:
    f = curved(8)
    r = rng(9)
    x, h = r.normal(size=(40, 3)), r.normal(size=(40, 2))
    race_now(monkeypatch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        hess = batchjac.hessian(f, x, h, backend="torch", explain=True)
    said = err.getvalue()
    assert "timed 40 rows: autograd" in said, said
    assert "ms, plain" in said, said
    np.testing.assert_allclose(hess, native(f, x, h)[1], rtol=1e-10, atol=1e-12)


def test_a_first_hessian_call_in_a_fresh_process_imports_no_torch_dynamo(tmp_path: Any) -> None:
    """The point of the build: torch.func's first use loads torch._dynamo (0.6-1.4 s of a
    first call that computes in 0.15 s, W6); the first call's Hessians are still right."""
    script = (
        "import json, sys, numpy as np, torch, batchjac\n"
        "torch.manual_seed(0)\n"
        "net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))\n"
        "x = np.random.default_rng(10).normal(size=(50, 5)).astype('float32')\n"
        "H = batchjac.hessian(net, x)\n"
        f"np.save({str(tmp_path / 'h.npy')!r}, H)\n"
        "torch.save(net.state_dict(), sys.argv[1])\n"
        "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "net.pt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"dynamo": False}
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    net.load_state_dict(torch.load(tmp_path / "net.pt"))
    x = np.random.default_rng(10).normal(size=(50, 5)).astype("float32")
    want = torch.func.vmap(torch.func.hessian(lambda z: net(z[None])[0]))(torch.tensor(x))
    np.testing.assert_allclose(np.load(tmp_path / "h.npy"), want.detach().numpy(), rtol=1e-4, atol=1e-6)
