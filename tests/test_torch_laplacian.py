"""The forward Laplacian of PyTorch models (batchjac._backends.torch_laplacian) and the torch
Laplacian kernel's build that uses it.

References: the trace of ``torch.func.hessian`` per instance and ``torch.func.jacrev`` on the
same function in float64, and the closed form of ``sum(sin x)`` (Laplacian ``-sum(sin x)``).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import race_now, rng, run_in_fresh_process

torch = pytest.importorskip("torch")

from batchjac._backends.torch import laplacian as torch_laplacian  # noqa: E402
from batchjac._backends.torch.state import _load_forward_ad  # noqa: E402
from batchjac._bind import prepare  # noqa: E402
from batchjac._validate import normalize  # noqa: E402

_load_forward_ad()  # (as the kernels do: its import's deprecation warning silenced)


def curved(seed: int) -> tuple[Any, Any, Any]:
    """A model of 3 unknowns and 2 known inputs through the operations the rules treat apart
    (matrix products, sums with constants, tanh, sin, exp, sigmoid, log, products and a
    quotient of two varying values, a power and softplus by the general rule, a concatenation
    with the known columns, a sum), and its parameters."""
    r = rng(seed)
    w1 = torch.tensor(r.normal(size=(5, 6)) * 0.6)
    b1 = torch.tensor(r.normal(size=6) * 0.1)
    w2 = torch.tensor(r.normal(size=(6, 2)) * 0.6)

    def f(x: Any, h: Any) -> Any:
        z = torch.cat([x, h], -1) @ w1 + b1
        a = torch.tanh(z) * torch.sigmoid(z)
        a = a + torch.sin(z) ** 2 - torch.exp(-z * z) / (1 + z * z)
        s = torch.nn.functional.softplus(a) @ w2
        return torch.log(1 + s * s) + s.sum(-1, keepdim=True)

    return f, w1, w2


def references(f: Any, x: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(J, Laplacian)`` per instance from torch.func's own jacrev and hessian."""
    xt, ht = torch.tensor(x), torch.tensor(h)

    def one(a: Any, b: Any) -> Any:
        return f(a[None], b[None])[0]

    jac = torch.func.vmap(torch.func.jacrev(one))(xt, ht)
    hess = torch.func.vmap(torch.func.hessian(one))(xt, ht)
    return jac.detach().numpy(), torch.diagonal(hess, dim1=-2, dim2=-1).sum(-1).detach().numpy()


def test_rules_match_torch_func_hessian_trace() -> None:
    f, _, _ = curved(1)
    r = rng(2)
    x, h = r.normal(size=(17, 3)), r.normal(size=(17, 2))
    xt, ht = torch.tensor(x), torch.tensor(h)
    graph = torch_laplacian.trace(f, xt, ht)
    y, dy, lap = torch_laplacian.run(graph, [xt, ht], 0)
    want_jac, want_lap = references(f, x, h)
    np.testing.assert_allclose(y.numpy(), f(xt, ht).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dy.permute(1, 2, 0).numpy(), want_jac, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lap.numpy(), want_lap, rtol=1e-10, atol=1e-12)
    assert np.abs(want_lap).max() > 0.1  # a curved model: the test could fail


def test_sum_sin_has_its_closed_form() -> None:
    x = rng(3).normal(size=(40, 4)) * 2
    xt = torch.tensor(x)

    def f(z: Any) -> Any:
        return torch.sin(z).sum(-1)

    _, dy, lap = torch_laplacian.run(torch_laplacian.trace(f, xt), [xt], 0)
    np.testing.assert_allclose(lap.numpy(), -np.sin(x).sum(-1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dy.numpy(), np.cos(x).T, rtol=1e-12, atol=1e-12)


def _kernel(model: Any, *arrays: np.ndarray) -> tuple[Any, np.ndarray, tuple[np.ndarray, ...]]:
    spec = normalize(arrays, wrt=None, dtype=None, nan_policy="raise")
    bound = prepare(model, spec, "torch", {})
    kernel = bound.second_kernel("laplacian", "forward-over-reverse", spec.n, True, True)
    u, ctx = spec.chunk(0, spec.n)
    return kernel, u, ctx


def test_kernel_build_follows_changed_weights() -> None:
    """The forward Laplacian build of the Laplacian kernel: the Jacobian and Laplacian of
    torch.func; after the weights change in place, and after one is replaced by a new
    tensor, the new model's."""
    r = rng(4)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    x = r.normal(size=(21, 3))

    def want() -> tuple[np.ndarray, np.ndarray]:
        return references(lambda a, b: model(a), x, np.zeros((21, 0)))

    kernel, u, ctx = _kernel(model, x)
    kernel.use("forward-laplacian")
    for change in (None, "in place", "replaced"):
        if change == "in place":
            with torch.no_grad():
                model[0].weight.mul_(1.7)
        elif change == "replaced":
            model[2].weight = torch.nn.Parameter(torch.tensor(r.normal(size=(2, 8))))
        out = kernel(u, ctx)
        jac, lap = want()
        np.testing.assert_allclose(out["laplacians"], lap, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(out["jacobians"], jac, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(out["outputs"], model(torch.tensor(x)).detach().numpy(),
                                   rtol=1e-12, atol=1e-12)
    assert "a forward Laplacian" in kernel.note


def test_untraceable_model_keeps_the_order_and_says_why() -> None:
    """A model whose Python branches on the values (no ATen graph can hold that) computes
    forward over reverse, the same values, and the note says why."""
    r = rng(5)
    w = torch.tensor(r.normal(size=(3, 2)))

    def branching(z: Any) -> Any:
        if float(z.abs().max()) > 100:
            z = z / 100
        return torch.tanh(z @ w)

    x = r.normal(size=(9, 3))
    kernel, u, ctx = _kernel(branching, x)
    kernel.use("forward-laplacian")
    out = kernel(u, ctx)
    # (no |x| reaches 100: the branch is not taken, and torch.func cannot vmap it)
    _, lap = references(lambda a, b: torch.tanh(a @ w), x, np.zeros((9, 0)))
    np.testing.assert_allclose(out["laplacians"], lap, rtol=1e-10, atol=1e-12)
    assert kernel.variant == "plain"
    assert "forward Laplacian:" in kernel.note


def test_race_where_the_work_repays_it(monkeypatch: Any) -> None:
    """A first call runs the forward Laplacian untimed; once a race pays, both builds are
    timed and the faster kept, with the closed form's values."""
    x = rng(6).normal(size=(64, 3)) * 2

    def f(z: Any) -> Any:
        return torch.sin(z).sum(-1)

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        lap = batchjac.laplacian(f, x, backend="torch", explain=True)
    assert "a forward Laplacian (one pass) (not timed" in err.getvalue()
    np.testing.assert_allclose(lap, -np.sin(x).sum(-1), rtol=1e-12, atol=1e-12)
    race_now(monkeypatch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        lap = batchjac.laplacian(f, x, backend="torch", explain=True, chunk_size=32)
    assert "timed 32 rows: plain" in err.getvalue(), err.getvalue()
    assert "forward-laplacian" in err.getvalue()
    np.testing.assert_allclose(lap, -np.sin(x).sum(-1), rtol=1e-12, atol=1e-12)


def test_a_race_choice_holds_for_other_chunk_sizes(monkeypatch: Any) -> None:
    x = rng(7).normal(size=(48, 3)) * 2

    def f(z: Any) -> Any:
        return torch.sin(z).sum(-1)

    race_now(monkeypatch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        batchjac.laplacian(f, x, backend="torch", explain=True, chunk_size=48)
        lap = batchjac.laplacian(f, x, backend="torch", explain=True, chunk_size=16)
    notes = [line for line in err.getvalue().splitlines() if "kernel:" in line]
    assert "timed 48 rows" in notes[0], notes
    assert "as timed for another chunk size" in notes[1], notes
    np.testing.assert_allclose(lap, -np.sin(x).sum(-1), rtol=1e-12, atol=1e-12)


def test_the_untimed_first_build_is_the_forward_laplacian_at_any_size() -> None:
    """A first call too small to repay a race takes the forward Laplacian, untimed, however
    few its rows (its trace costs a forward pass; the plain build's first use imports
    torch._dynamo), chunked or not, with torch.func's values."""
    r = rng(8)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    x = r.normal(size=(5, 3))
    _, lap = references(lambda a, b: model(a), x, np.zeros((5, 0)))
    for chunk in (None, 2):
        fresh = torch.nn.Sequential(*(m for m in model))  # a new model: a new first call
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            got = batchjac.laplacian(fresh, x, backend="torch", explain=True, chunk_size=chunk)
        note = next(line for line in err.getvalue().splitlines() if "kernel:" in line)
        assert "a forward Laplacian (one pass) (not timed" in note, note
        np.testing.assert_allclose(got, lap, rtol=1e-10, atol=1e-12)


def test_a_chunk_runs_in_blocks_of_rows_within_the_cache(monkeypatch: Any) -> None:
    """A chunk whose carried values outgrow the cache runs in evened blocks of rows (the
    last one shorter, its own tape), each row the value torch.func gives it; the known
    inputs are cut with the unknowns."""
    from batchjac._backends.torch import TorchSecondKernel

    monkeypatch.setattr("batchjac._config.cache_bytes", lambda: 3 * 4 * 6 * 8 * 10)  # 10 rows
    monkeypatch.setattr(TorchSecondKernel, "MIN_BLOCK_ROWS", 4)
    monkeypatch.setattr(TorchSecondKernel, "PROBE_ROWS", 3)
    f, _, _ = curved(9)
    r = rng(9)
    x, h = r.normal(size=(47, 3)), r.normal(size=(47, 2))
    # (x and h as two arrays: the model is called on their columns side by side)
    kernel, u, ctx = _kernel(lambda z: f(z[:, :3], z[:, 3:]), x, h)
    assert len(ctx) == 1
    kernel.use("forward-laplacian")
    seen: list[int] = []
    real = TorchSecondKernel._block_rows

    def block_rows(self: Any, *args: Any) -> int:
        seen.append(real(self, *args))
        return seen[-1]

    monkeypatch.setattr(TorchSecondKernel, "_block_rows", block_rows)
    out = kernel(u, ctx)
    jac, lap = references(f, x, h)
    # the widest carried value is 6 wide (float64): 3 x 4 x 48 B a row, 10 rows of the cache
    # make 5 blocks of 47 rows: 10, 10, 10, 10, 7
    assert seen == [10]
    assert sorted(key[0][0] for key in kernel._graphs) == [3, 7, 10]
    np.testing.assert_allclose(out["laplacians"], lap, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["jacobians"], jac, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["outputs"], f(torch.tensor(x), torch.tensor(h)).numpy(),
                               rtol=1e-12, atol=1e-12)


def test_in_place_views_and_several_outputs_are_recorded_as_they_compute() -> None:
    """In-place operations (ReLU(inplace=True), ``add_`` through a view of a value) and
    operations of several outputs (``split``, ``unbind``) recorded under functionalize: the
    tape's Laplacian is torch.func's; operations the output does not use are dropped."""
    r = rng(10)
    w = torch.tensor(r.normal(size=(3, 6)))

    def f(x: Any) -> Any:
        z = x @ w
        unused = torch.exp(z).sum()  # noqa: F841 - dropped from the tape
        a, b = z.split(3, dim=-1)
        a = a * 2 + torch.tanh(b)
        a[:, 0].add_(torch.sin(b[:, 1]))  # mutates a through a view of it
        a = torch.nn.functional.relu(a, inplace=True)
        cols = a.unbind(-1)
        return (cols[0] * cols[1] + cols[2] ** 2)[:, None]

    x = r.normal(size=(11, 3))
    xt = torch.tensor(x)
    tape = torch_laplacian.trace(f, xt)
    names = [torch_laplacian._name(op[0]) for op in tape.ops]
    assert "exp" not in names, names
    assert "split" in names, names
    assert "unbind" in names, names
    y, dy, lap = torch_laplacian.run(tape, [xt], 0)
    jac, want = references(lambda a, b: f(a), x, np.zeros((11, 0)))
    np.testing.assert_allclose(y.numpy(), f(torch.tensor(x)).numpy(), rtol=1e-12)
    np.testing.assert_allclose(lap.numpy(), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dy.permute(1, 2, 0).numpy(), jac, rtol=1e-10, atol=1e-12)


def test_a_fresh_process_computes_the_laplacian_without_torch_dynamo() -> None:
    """The first Laplacian of a fresh process imports neither TorchDynamo nor Inductor
    (``make_fx`` would: 2.2 s of W7's first call) nor forward mode's decompositions."""
    out = run_in_fresh_process("""
        import sys
        import numpy as np
        import torch
        import batchjac
        net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        x = np.random.default_rng(11).normal(size=(700, 3)).astype(np.float32)
        lap = batchjac.laplacian(net, x)
        print(lap.shape, sorted(m for m in ("torch._dynamo", "torch._inductor",
              "torch._decomp.decompositions_for_jvp") if m in sys.modules))
    """)
    assert out.strip() == "(700, 1) []", out
