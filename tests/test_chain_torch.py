"""Mixed-mode accumulation in PyTorch (batchjac._backends.torch.chain): the chain read from a
recording of the model's ATen operations, the Jacobians accumulated through its bottleneck
against torch.func's own pure modes and float64 finite differences, the recording made again
when the weights change, and the pure modes kept where no cut pays."""

from __future__ import annotations

import copy
import itertools
import re
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import batchjac  # noqa: E402

from .helpers import assert_jac_close, central_differences  # noqa: E402
from .test_backend_torch import bound_of  # noqa: E402

#: counted 2.7x fewer operations than the better pure mode: offered, raced later
BOTTLENECK = (128, 96, 2, 96, 128)
#: counted 3.3x: the pure modes not raced
SURE = (128, 128, 2, 128, 128)


def mlp(sizes: tuple[int, ...], seed: int, dtype: Any = torch.float32) -> Any:
    torch.manual_seed(seed)
    layers: list[Any] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(torch.nn.Linear(a, b, dtype=dtype))
        if i < len(sizes) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def torch_reference(f: Any, *inputs: np.ndarray) -> np.ndarray:
    """torch.func's own reverse mode, row by row, w.r.t. the first input."""
    ts = [torch.from_numpy(a) for a in inputs]
    with torch.no_grad():
        return torch.func.vmap(torch.func.jacrev(
            lambda *row: f(*(r[None] for r in row))[0]))(*ts).numpy()


def kernel_of(model: Any) -> Any:
    return next(iter(bound_of(model)._kernels.values()))


def test_a_bottlenecked_mlp_is_accumulated_through_its_narrow_layer(capsys: Any) -> None:
    model = mlp(BOTTLENECK, seed=1)
    x = np.random.default_rng(2).normal(0, 1, (37, 128)).astype(np.float32)
    jac = batchjac.jacobian(model, x, explain=True)
    err = capsys.readouterr().err
    assert "mixed mode: reverse from the unknowns to the 2 values after tanh (2 backward " \
           "passes), then forward from the 2 values after tanh to the outputs (2 tangents)" in err
    assert "the pure build races it once the work repays it" in err
    assert re.search(r"computed 37 rows in [0-9.e-]+ s", err)
    kernel = kernel_of(model)
    assert kernel.variant == "mixed"
    assert kernel.variants == ("mixed", "vmap")
    assert_jac_close(jac, torch_reference(model, x))
    twin = copy.deepcopy(model).double()

    def forward64(v: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return twin(torch.from_numpy(v)).numpy()

    assert_jac_close(jac, central_differences(forward64, x.astype(np.float64)))


def test_the_pure_build_gives_the_same_jacobians_and_a_sure_gain_races_none() -> None:
    model = mlp(BOTTLENECK, seed=3)
    x = np.random.default_rng(4).normal(0, 1, (6, 128)).astype(np.float32)
    y, _ = batchjac.jacobian(model, x, return_outputs=True)
    with torch.no_grad():
        np.testing.assert_allclose(y, model(torch.from_numpy(x)).numpy(), rtol=1e-6, atol=1e-6)
    kernel = kernel_of(model)
    assert kernel.build("mixed").stage == 0
    assert kernel.build("vmap").stage == 1
    kernel.use("vmap")
    assert_jac_close(kernel(x, ())[1], torch_reference(model, x))
    sure = mlp(SURE, seed=5)
    batchjac.jacobian(sure, x)
    assert kernel_of(sure).variants == ("mixed",)


def test_known_inputs_branches_and_integer_values_around_the_cut() -> None:
    torch.manual_seed(6)
    w0, w1 = torch.randn(128, 128) * 0.1, torch.randn(128, 2) * 0.3
    wa, wb, wh = torch.randn(2, 128) * 0.5, torch.randn(2, 128) * 0.5, torch.randn(6, 128) * 0.5

    def f(x: Any, h: Any) -> Any:
        code = torch.tanh(torch.tanh(x @ w0) @ w1)
        y = torch.sin(code @ wa) * torch.tanh(code @ wb) + h @ wh
        pick = torch.argmax(code, dim=-1)
        return y * (1.0 + (pick[..., None] == torch.arange(128) % 2))

    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (11, 128)).astype(np.float32)
    h = rng.normal(0, 1, (11, 6)).astype(np.float32)
    jac = batchjac.jacobian(f, (x, h), wrt=0)
    assert kernel_of(f).variant == "mixed"
    assert_jac_close(jac, torch_reference(f, x, h))


def test_weights_changed_in_place_are_read_again() -> None:
    model = mlp(BOTTLENECK, seed=8)
    x = np.random.default_rng(9).normal(0, 1, (5, 128)).astype(np.float32)
    batchjac.jacobian(model, x)
    with torch.no_grad():  # an optimizer's step, in place
        for p in model.parameters():
            p.mul_(0.7).add_(0.01)
    jac = batchjac.jacobian(model, x)
    assert kernel_of(model).variant == "mixed"
    assert_jac_close(jac, torch_reference(model, x))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_mode_asked_for_is_computed_in_that_mode(mode: str) -> None:
    model = mlp(BOTTLENECK, seed=10)
    x = np.random.default_rng(11).normal(0, 1, (5, 128)).astype(np.float32)
    jac = batchjac.jacobian(model, x, mode=mode)
    assert kernel_of(model).variant != "mixed"
    assert_jac_close(jac, torch_reference(model, x))


def test_no_bottleneck_and_a_model_that_branches_on_values_keep_the_pure_mode() -> None:
    wide = mlp((40, 64, 64, 40), seed=12)
    x = np.random.default_rng(13).normal(0, 1, (5, 40)).astype(np.float32)
    batchjac.jacobian(wide, x)
    assert bound_of(wide).accumulation() is None
    inner = mlp(BOTTLENECK, seed=14)

    def branching(v: Any) -> Any:
        out = inner(v)
        return out * 2 if float(out.abs().sum()) > 0 else out  # a value read in Python

    x = np.random.default_rng(15).normal(0, 1, (5, 128)).astype(np.float32)
    jac = batchjac.jacobian(branching, x)
    assert bound_of(branching).accumulation() is None
    ref = [torch.autograd.functional.jacobian(lambda v: branching(v[None])[0], torch.from_numpy(r))
           for r in x]
    assert_jac_close(jac, np.stack([r.numpy() for r in ref]))


def test_a_store_records_the_mixed_build_and_resumes_in_it(tmp_path: Any) -> None:
    import json

    model = mlp(BOTTLENECK, seed=16)
    x = np.random.default_rng(17).normal(0, 1, (40, 128)).astype(np.float32)
    path = tmp_path / "j.npy"
    first = batchjac.jacobian(model, x, out=str(path), chunk_size=16)
    again = batchjac.jacobian(model, x, out=str(path), chunk_size=16)
    assert first.computed_chunks == 3
    assert again.resumed_chunks == 3
    assert json.loads((tmp_path / "j.manifest.json").read_text())["plan"]["variant"] == "mixed"
    assert_jac_close(np.asarray(again.open()[:]), torch_reference(model, x))


@pytest.mark.parametrize("workload", ["W1", "W2", "W3", "W4"])
def test_the_other_benchmark_workloads_read_no_chain(workload: str) -> None:
    from batchjac.examples import workload_inputs, workload_model

    model = workload_model(workload, "torch")
    unknown, known = workload_inputs(workload, 4)
    batchjac.jacobian(model, unknown, *(() if known is None else (known,)))
    assert bound_of(model).accumulation() is None
    assert kernel_of(model).variant != "mixed"
