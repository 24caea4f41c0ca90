"""PyTorch's working set of a row (``_backends/torch_cost``), counted in the probes' forward pass,
and the cache-sized chunks the planner cuts from it (``batchjac._plan.fit_cache``)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchjac import _plan

from .helpers import assert_jac_close, run_in_fresh_process

torch = pytest.importorskip("torch")


def _mlp(seed: int, sizes: tuple[int, ...]) -> Any:
    torch.manual_seed(seed)
    layers: list[Any] = []
    for a, b in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _in_a_small_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, verb: Any, model: Any,
                      x: np.ndarray, **options: Any) -> tuple[Any, Any]:
    """``verb(model, x)`` planned for a 1 MB cache (tuning decisions in ``tmp_path``), and the
    bound model it used."""
    from batchjac import _backends

    monkeypatch.setenv("BATCHJAC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_plan, "cache_bytes", lambda: 1 << 20)
    result = verb(model, x, **options)
    return result, next(iter(_backends._bound[model].values()))


def test_the_count_is_a_rows_intermediates_not_its_weights_nor_views() -> None:
    from batchjac._backends.torch import cost as torch_cost

    model = _mlp(1, (6, 16, 3))  # addmm 16, tanh 16, addmm 3 floats a row
    for rows in (4, 16):
        x = torch.randn(rows, 6)
        y, per_row = torch_cost.counted(lambda x=x: model(x), rows)
        assert per_row == (16 + 16 + 3) * 4
        torch.testing.assert_close(y, model(x))
    w = torch.randn(6, 6)

    def viewed(x: Any) -> Any:
        scaled = w * 2.0  # a weight-sized array made per call: not a row's
        return (x.view(x.shape[0], 2, 3).reshape(x.shape[0], 6) @ scaled).sin()

    x5 = torch.randn(5, 6)
    _, per_row = torch_cost.counted(lambda: viewed(x5), 5)
    assert per_row == (6 + 6) * 4  # the product and the sine; the views share their storage
    # float64 rows count 8 bytes a value
    x3, double = torch.randn(3, 6, dtype=torch.float64), model.double()
    _, per_row = torch_cost.counted(lambda: double(x3), 3)
    assert per_row == (16 + 16 + 3) * 8


def test_a_convolution_gets_no_estimate() -> None:
    """oneDNN tiles its convolutions itself, and each new chunk shape costs its setup on the
    first call (W4: 0.32 s whole against 0.42-0.45 s in cache-sized chunks): no estimate."""
    from batchjac._backends.torch import cost as torch_cost

    torch.manual_seed(2)
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Tanh(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    images = torch.randn(3, 1, 6, 6)
    y, per_row = torch_cost.counted(lambda: conv(images), 3)
    assert per_row is None
    assert y.shape == (3, 2)


def test_counting_loads_no_torchdynamo_and_the_call_sets_the_first_pass() -> None:
    """A dispatch mode's default wraps its handler in ``torch._dynamo.disable``, whose first
    call imports TorchDynamo (0.6-0.9 s): the count must not. The plain-autograd first pass is
    chosen by the call's rows: a small call takes the replicated pass; a large one the looped
    pass, even in cache-sized chunks that are small (W4's conv net, 2,000 images in chunks of
    143, ran its forward 10 times a chunk replicated: 0.61 s against 0.37 looped). In a fresh
    process: the plain passes are first builds only while torch.func has not loaded TorchDynamo."""
    code = """
        import sys
        import numpy as np, torch, batchjac
        from batchjac import _backends, _plan
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
        rng = np.random.default_rng(1)
        batchjac.jacobian(model, rng.normal(size=(40, 5)).astype(np.float32), mode="reverse")
        (bound,) = _backends._bound[model].values()
        (small,) = bound._kernels.values()
        _plan.cache_bytes = lambda: 1 << 16
        batchjac.jacobian(model, rng.normal(size=(3000, 5)).astype(np.float32), mode="reverse")
        large = list(bound._kernels.values())[-1]
        print("ROWBYTES", bound.row_bytes, "SMALL", small.variant, "LARGE", large.variant,
              large.chunk_size, "DYNAMO", "torch._dynamo" in sys.modules)
    """
    stdout = run_in_fresh_process(code)
    # 64 KB / (0.75 x 3 passes x 524 bytes): chunks of 64 rows (the least), 3 outputs each
    assert f"ROWBYTES {(64 + 64 + 3) * 4.0} SMALL replicated LARGE looped" in stdout, stdout
    assert "DYNAMO False" in stdout, stdout
    chunk = int(stdout.split("LARGE looped ")[1].split()[0])
    assert chunk * 3 <= 2048 < 3000 * 3


def test_a_large_call_computes_in_cache_sized_chunks_and_remembers_the_count(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With a small (patched) cache the first call plans chunks that fit it, takes the looped
    reverse pass for them (the call is large, though each chunk is small), computes torch's own
    Jacobians of the whole batch, and writes the count with the probes' verdict."""
    import batchjac
    from batchjac._bind import _PROBES
    from batchjac._tune import policy as _tuning

    model = _mlp(3, (7, 64, 64, 6))
    x = np.random.default_rng(5).normal(size=(3000, 7)).astype(np.float32)
    jac, bound = _in_a_small_cache(monkeypatch, tmp_path, batchjac.jacobian, model, x,
                                   mode="reverse")
    assert bound.row_bytes == (64 * 4 + 6) * 4
    (kernel,) = bound._kernels.values()
    # 0.75 a pass x 6 backward passes x 1,048 bytes: ~4.7 KB a row, 1 MB: chunks of ~200 rows
    assert kernel.chunk_size == pytest.approx((1 << 20) / (0.75 * 6 * 1048), rel=0.1)
    whole = torch.func.vmap(torch.func.jacrev(lambda r: model(r[None])[0]))(torch.from_numpy(x))
    assert_jac_close(jac, whole.detach().numpy())
    _PROBES.submit(lambda: None).result()  # (the verdict's write is queued there)
    stored = [json.loads(p.read_text()) for p in tmp_path.rglob("*.json")]
    assert any("row_bytes" in json.dumps(v) for v in stored), stored
    fresh = type(bound).__new__(type(bound))
    fresh.__dict__.update(dict(bound.__dict__.items()))
    fresh.row_bytes, fresh.probed = None, False
    assert _tuning.recall_probes(fresh, "torch")
    assert fresh.row_bytes == pytest.approx(bound.row_bytes)


def test_hessian_chunks_hold_one_outputs_passes(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """PyTorch's first Hessian build (plain autograd, forward over reverse) differentiates one
    output after another: its chunks are cut for one output's ``2k`` passes, not the ``k(m+1)``
    of all ``m`` outputs at once (W6: 3,334 rows, 64 ms steady, against 1,667 rows, 79 ms).
    The Hessians are torch.func's of the whole batch."""
    import batchjac

    model = _mlp(7, (3, 64, 64, 4))
    x = np.random.default_rng(8).normal(size=(2500, 3)).astype(np.float32)
    hess, bound = _in_a_small_cache(monkeypatch, tmp_path, batchjac.hessian, model, x,
                                    mode="forward-over-reverse")
    row = (64 * 4 + 4) * 4
    assert bound.row_bytes == row
    (kernel,) = bound.__dict__["_second_kernels"].values()
    one_output = (1 << 20) / (_plan.PASS_FACTOR * _plan.hessian_passes("forward-over-reverse", 3, 1) * row)
    assert kernel.chunk_size == pytest.approx(one_output, rel=0.1)
    # (reverse over reverse: torch.func's forward mode would load its decompositions, which warn)
    hessian = torch.func.jacrev(torch.func.jacrev(lambda r: model(r[None])[0]))
    whole = torch.func.vmap(hessian)(torch.from_numpy(x))
    assert_jac_close(hess.reshape(2500, 4, 9), whole.detach().numpy().reshape(2500, 4, 9))
