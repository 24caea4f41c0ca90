"""The cold-start rule (batchjac._tune.policy): a race runs only when the work it can save repays
its cost; new batch sizes reuse compiled kernels; decisions persist across processes; new
function objects with the same code are not probed again. Decisions are asserted, not times:
the ledger's timings are injected where a test needs a job of a given size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac import ClosedForm, _backends
from batchjac._tune import policy as _tuning
from batchjac._tune.races import MODE_RUNS

D, M = 4, 3  # 4 unknowns, 3 outputs: the cost model cannot tell the modes apart (a race decides)
_rng = np.random.default_rng(5)
A = _rng.normal(size=(M, D))


def f(z: np.ndarray) -> np.ndarray:
    return np.sin(z @ A.T)


def jac(z: np.ndarray) -> np.ndarray:
    return np.cos(z @ A.T)[:, :, None] * A[None]


def bound_of(model: Any) -> Any:
    return next(iter(_backends._bound[model].values()))


def data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, D))


# -- the rule, on injected timings ------------------------------------------------------------------

def test_no_race_before_any_measurement() -> None:
    model = ClosedForm(f, jac)
    z = data(500)
    np.testing.assert_allclose(batchjac.jacobian(model, z), jac(z), rtol=1e-12)
    bound = bound_of(model)
    assert bound.tuned == {}  # the first call took the cost model's mode, untimed
    assert not _tuning.worth(bound, 10**9, compilations=1)  # no steady call measured yet


def test_a_race_waits_for_work_that_repays_it() -> None:
    model = ClosedForm(f, jac)
    batchjac.jacobian(model, data(500))
    bound = bound_of(model)
    book = _tuning.ledger(bound)
    book.compile_seconds = 0.5  # a compilation costs half a second
    book.rows, book.seconds = 500, 0.001  # and a call of 500 rows a millisecond
    assert not _tuning.worth(bound, 500, compilations=1)  # 0.5 * 2 ms < 0.75 s
    for seed in (1, 2, 3):
        batchjac.jacobian(model, data(500, seed))
        book.rows, book.seconds = 500, 0.001  # (the calls here take microseconds)
    assert bound.tuned == {}  # too small a job: no race
    # the work seen grows (the ledger says 3 s of compute so far): the race now pays
    book.seconds, book.rows = 3.0, 1_500_000
    assert _tuning.worth(bound, 500, compilations=1)
    # (a repeated call on the fast path hands the race to the next one; the modes then race
    # on the calls: the other mode's first, then each in turn, every result the call's own)
    for seed in range(2 + 1 + 2 * MODE_RUNS):
        got = batchjac.jacobian(model, data(500, seed))
        np.testing.assert_allclose(got, jac(data(500, seed)), rtol=1e-12)
    assert (500, False) in bound.tuned  # raced, once, and kept
    assert not bound.tuning.mode_races


def test_a_large_first_job_is_still_not_raced_blind() -> None:
    """Nothing measured yet: not even a big job races on its first call (its price is unknown);
    the decision comes with the second call's measurement."""
    model = ClosedForm(f, jac)
    batchjac.jacobian(model, data(20_000))
    assert bound_of(model).tuned == {}


def test_the_fast_path_hands_a_due_race_to_the_full_path() -> None:
    model = ClosedForm(f, jac)
    z = data(300)
    batchjac.jacobian(model, z)
    batchjac.jacobian(model, z)  # a repeated call: the fast path
    bound = bound_of(model)
    book = _tuning.ledger(bound)
    assert book.rows >= 300  # the fast path's calls are counted
    book.compile_seconds = 0.01
    book.seconds, book.rows = 1.0, 10**6
    book.next_check = 0.0  # what a skipped race sets once it is due
    batchjac.jacobian(model, z)  # counted; the entry is dropped
    assert (300, False) not in bound.tuned
    for _ in range(1 + 2 * MODE_RUNS):  # the full path: the modes race on the calls
        np.testing.assert_allclose(batchjac.jacobian(model, z), jac(z), rtol=1e-12)
    assert (300, False) in bound.tuned
    assert not bound.tuning.mode_races


def test_a_race_of_modes_is_priced_by_making_the_other_modes_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger measured the first kernel's making; the other mode's is weighed by the
    backend's forward_build_cost (TensorFlow's forward kernels trace under pfor: about 3x),
    and a job that repays one making but not three waits."""
    model = ClosedForm(f, jac)
    batchjac.jacobian(model, data(500))
    bound = bound_of(model)
    ((mode, size, _),) = bound._kernels
    monkeypatch.setattr(type(bound), "forward_build_cost", 3.0)
    builds = bound.mode_race_builds(mode, size, False)
    assert builds == pytest.approx(3.0 if mode == "reverse" else 1 / 3)
    book = _tuning.ledger(bound)
    book.compile_seconds, book.rows, book.seconds = 0.1, 500, 0.5  # 0.5 * 0.5 s of work
    assert _tuning.worth(bound, 0, compilations=1, timing=0.0)
    assert _tuning.worth(bound, 0, compilations=builds, timing=0.0) == (mode == "forward")


def test_autotune_off_never_races(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ClosedForm(f, jac)
    batchjac.jacobian(model, data(300))
    bound = bound_of(model)
    book = _tuning.ledger(bound)
    book.compile_seconds, book.seconds, book.rows = 0.01, 100.0, 10**6
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "off")
    assert not _tuning.worth(bound, 300, compilations=1)
    batchjac.jacobian(model, data(300, 1))
    assert bound.tuned == {}


# -- new batch sizes --------------------------------------------------------------------------------

@pytest.fixture
def compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy backend as a compiling one (kernels of new sizes cost a compilation)."""
    from batchjac._backends.numpy import NumpyBound

    monkeypatch.setattr(NumpyBound, "compiles_kernels", True)


@pytest.mark.usefixtures("compiling")
def test_new_batch_sizes_reuse_the_compiled_kernel() -> None:
    model = ClosedForm(f, jac)
    batchjac.jacobian(model, data(1000))
    bound = bound_of(model)
    # a compiling backend's prices (the numpy kernels' real timings are microseconds, and a
    # busy machine's noise could make 963 padded rows look dearer than a "compilation")
    book = _tuning.ledger(bound)
    book.compile_seconds, book.first_rows = 0.3, 1000
    kernels = dict(bound._kernels)
    for n in (999, 37, 5000, 1000):
        z = data(n, n)
        np.testing.assert_allclose(batchjac.jacobian(model, z), jac(z), rtol=1e-12)
    assert bound._kernels == kernels  # every N ran on the 1,000-row kernel
    assert bound.trace_count == 1


@pytest.mark.usefixtures("compiling")
def test_padding_that_adds_up_to_a_compilation_gets_its_own_kernel() -> None:
    model = ClosedForm(f, jac)
    batchjac.jacobian(model, data(1000))
    bound = bound_of(model)
    book = _tuning.ledger(bound)
    book.rows, book.seconds, book.compile_seconds = 10**6, 1.0, 0.003  # 1 us a row
    sizes = []
    for seed in range(5):  # 37 rows pad 963: ~1 ms of waste a call, a compilation is 3 ms
        z = data(37, seed)
        np.testing.assert_allclose(batchjac.jacobian(model, z), jac(z), rtol=1e-12)
        batchjac._tune.fastpath._entries.clear()  # each call through the full path
        sizes.append(sorted(bound.kernel_sizes("forward", False) + bound.kernel_sizes("reverse", False)))
    # three calls reuse the 1,000-row kernel (2.9 ms of padding); the fourth compiles 37 rows
    assert [37 in s for s in sizes] == [False, False, False, True, True]


# -- decisions on disk ----------------------------------------------------------------------------

CHILD = textwrap.dedent('''
    import json, sys
    import numpy as np
    import batchjac
    from batchjac import ClosedForm, _backends
    from batchjac._tune import policy as _tuning
    from batchjac._tune.races import MODE_RUNS
    A = np.array(json.loads(sys.argv[1]))
    def f(z): return np.sin(z @ A.T)
    def jac(z): return np.cos(z @ A.T)[:, :, None] * A[None]
    model = ClosedForm(f, jac)
    if sys.argv[2] == "race":
        _tuning.worth = lambda *a, **k: True  # a job large enough to repay the race
    z = np.random.default_rng(0).normal(size=(64, A.shape[1]))
    # (the modes race on the calls: the other mode's first, then each in turn)
    for _ in range(1 + 2 * MODE_RUNS if sys.argv[2] == "race" else 1):
        batchjac.jacobian(model, z, explain=True)
    bound = next(iter(_backends._bound[model].values()))
    print(json.dumps({"tuned": {str(k): v for k, v in bound.tuned.items()}}))
''')


def _child(mode: str, cache: Path, **env: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(A.tolist()), mode],
                         capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "BATCHJAC_CACHE_DIR": str(cache), **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_decision_persists_across_processes(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _child("race", cache)
    assert first["tuned"]  # the first process raced and kept a mode
    assert list(cache.rglob("*.json"))  # ... and wrote it
    second = _child("plain", cache)  # a fresh process, no race allowed: it remembers
    (decision,) = second["tuned"].values()
    assert decision[0] == next(iter(first["tuned"].values()))[0]
    assert decision[1].startswith("remembered")


def test_cache_off_writes_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert _child("race", cache, BATCHJAC_CACHE="off")["tuned"]
    assert not cache.exists()


# -- new function objects ---------------------------------------------------------------------------

def test_same_code_new_objects_skip_the_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchjac import _bind

    calls = []
    original = _bind.run_probes
    monkeypatch.setattr(_bind, "run_probes", lambda *a: calls.append(1) or original(*a))
    base = ClosedForm(f, jac)
    z = data(50)
    for _ in range(5):
        model = ClosedForm(lambda v: base.f(v), lambda v: base.jac(v))
        np.testing.assert_allclose(batchjac.jacobian(model, z), jac(z), rtol=1e-12)
    assert len(calls) == 1  # the first object was probed; the others share its verdict


def test_new_jax_closures_per_call_warn_once() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    w = jnp.asarray(A.T)
    z = data(64).astype(np.float32)
    ref = jac(z.astype(np.float64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):  # a new function object per call, each reading another array
            copy = np.array(w)  # (numpy: a twin needs the same object, see _twins)
            got = batchjac.jacobian(lambda v, w=copy: jnp.sin(v @ w), z)
            np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)
    rebinds = [w for w in caught if issubclass(w.category, batchjac.RebindWarning)]
    assert len(rebinds) == 1
    assert "Define the function once" in str(rebinds[0].message)


@pytest.mark.parametrize("framework", ["tensorflow", "torch", "jax"])
def test_a_sequence_of_batch_sizes_compiles_once(framework: str) -> None:
    """N = 1000, 999, 37, 5000, 1000 on one model: after the first call nothing traces,
    compiles or races, and every result is the closed form's. (PyTorch is eager: it traces
    and compiles nothing, so its kernels are made for each size, free, without padding.)"""
    pytest.importorskip(framework)
    from batchjac.examples import mlp_jacobian, mlp_weights, seed_model, workload_inputs

    model = seed_model(framework)
    layers = mlp_weights((8, 64, 64, 4))
    traces = None
    for n in (1000, 999, 37, 5000, 1000):
        unknown, known = workload_inputs("W1", n, seed=n)
        got = batchjac.jacobian(model, unknown, known)
        ref = mlp_jacobian(layers, np.concatenate([unknown, known], 1))[:, :, :5]
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-5)
        (bound,) = [b for b in _backends._bound[model].values() if b.signature.dtype == np.float32]
        if traces is None and framework == "jax":  # (its steady build, compiled beside the
            from batchjac._backends.jax import executables  # quick first one: the first call's)

            executables.compiled_beside()
        if traces is None:
            traces, kernels = bound.trace_count, set(bound._kernels)
            compiles = getattr(bound, "compile_count", None)  # JAX: XLA compilations
        if bound.compiles_kernels:
            assert bound.trace_count == traces, f"N={n} traced again"
            assert set(bound._kernels) == kernels, f"N={n} built a kernel"
            assert getattr(bound, "compile_count", None) == compiles, f"N={n} compiled again"
        assert not any(k.raced for k in bound._kernels.values()), f"N={n} raced a kernel's builds"
        assert bound.tuned == {}, f"N={n} raced modes"
        assert bound.tuned_rows == {}, f"N={n} raced chunk sizes"


# -- second order: the same sequence, persisted, on the device's budget -------------------------

SECOND_CHILD = textwrap.dedent('''
    import json, sys
    import numpy as np
    import torch
    import batchjac
    from batchjac import _backends
    from batchjac._tune import policy as _tuning
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if sys.argv[1] == "race":
        _tuning.worth = lambda *a, **k: True  # a job large enough to repay every race
    x = np.random.default_rng(int(sys.argv[2])).normal(size=(4096, 3)).astype(np.float32)
    bound = None
    for _ in range(40):  # (the ladder of chunk sizes races on the calls)
        lap = batchjac.laplacian(model, x)
        bound = next(iter(_backends._bound[model].values()))
        if bound.tuned_rows:
            break
    W1, b1 = model[0].weight.detach().double().numpy(), model[0].bias.detach().double().numpy()
    v = model[2].weight.detach().double().numpy()[0]
    t = np.tanh(x.astype(np.float64) @ W1.T + b1)
    ref = ((-2 * t * (1 - t ** 2)) * v) @ (W1 ** 2).sum(1)
    kernels = bound.__dict__["_second_kernels"]
    print(json.dumps({
        "error": float(np.max(np.abs(lap[:, 0] - ref)) / np.max(np.abs(ref))),
        "rows": {str(k): v for k, v in bound.tuned_rows.items()},
        "kernels": [[k.chunk_size, k.variant, k.note, k.remembered] for k in kernels.values()],
    }))
''')


def _second_child(mode: str, cache: Path, seed: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", SECOND_CHILD, mode, str(seed)],
                         capture_output=True, text=True, check=True, timeout=300,
                         env={**os.environ, "BATCHJAC_CACHE_DIR": str(cache)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_order_decisions_persist_across_processes(tmp_path: Path) -> None:
    """A Laplacian's races (the ladder of chunk sizes, the kernel's builds) are written to disk
    like a Jacobian's, and a fresh process's first second-order call reads them instead of
    racing again: the same chunk size, and the build the race chose."""
    pytest.importorskip("torch")
    cache = tmp_path / "cache"
    first = _second_child("race", cache, 1)
    assert first["error"] < 1e-4
    (rows_key, (size, timings)), = first["rows"].items()
    assert "laplacian:" in rows_key
    assert not timings.startswith("remembered")
    raced = [k for k in first["kernels"] if k[0] == size]
    assert raced
    assert "timed" in raced[0][2]  # the kernel of the size kept raced its builds
    chosen = raced[0][1]
    assert list(cache.rglob("*.json"))

    second = _second_child("plain", cache, 2)  # no race allowed: it remembers
    assert second["error"] < 1e-4
    assert second["rows"][rows_key][0] == size
    assert second["rows"][rows_key][1].startswith("remembered")
    (kernel,) = [k for k in second["kernels"] if k[0] == size]  # no other size was built
    variant, note, remembered = kernel[1], kernel[2], kernel[3]
    # the chosen build runs, or waits as the remembered one while its making is not repaid
    assert (variant == chosen and "remembered" in note) or (remembered and remembered[0] == chosen)


def test_a_device_budget_reaches_second_order_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator a Hessian's chunks are planned within the device's free memory, as a
    Jacobian's are, not the host's (emulated: a bound model that reports 256 MB free)."""
    torch = pytest.importorskip("torch")
    from batchjac import _config, _hessian
    from batchjac._backends.torch import TorchBound

    monkeypatch.delenv("BATCHJAC_MAX_MEMORY", raising=False)
    budgets: list[int] = []
    planner = _hessian.make_second_plan
    monkeypatch.setattr(_hessian, "make_second_plan",
                        lambda **kw: budgets.append(kw["max_memory"]) or planner(**kw))
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    x = np.random.default_rng(3).normal(size=(50, 4))
    w1, b1 = model[0].weight.detach().numpy(), model[0].bias.detach().numpy()
    w2 = model[2].weight.detach().numpy()
    t = np.tanh(x @ w1.T + b1)
    ref = np.einsum("oh,nh,hi,hj->noij", w2, -2 * t * (1 - t ** 2), w1, w1)  # closed form

    np.testing.assert_allclose(batchjac.hessian(model, x), ref, rtol=1e-10, atol=1e-12)
    assert budgets[-1] == _config.default_max_memory()  # on the host: the host's budget
    monkeypatch.setattr(TorchBound, "device_free_memory", lambda self: 256 << 20)
    np.testing.assert_allclose(batchjac.hessian(model, x, diagonal=True),
                               np.diagonal(ref, axis1=-2, axis2=-1), rtol=1e-10, atol=1e-12)
    assert budgets[-1] == _config.device_budget(256 << 20) == 128 << 20


def test_a_race_on_one_chunk_is_priced_by_the_chunks_it_runs() -> None:
    """The timed runs of a later race off the calls cost ``SLOW_RUNS`` runs of every build,
    each at least a chunk of the build in use: a fixed ``TIMING_SECONDS`` where chunks are
    fast, more where they are slow (a whole chunk of W7's Laplacians a run); a race on the
    calls whose contenders are made beside them costs its slower contenders' calls."""
    from types import SimpleNamespace

    from batchjac._tune import chooser
    from batchjac._tune.state import Ledger

    book = Ledger(rows=1000, seconds=0.5)  # 0.5 ms a row
    off = SimpleNamespace(races_on_calls=False, race_compilations=3, chunk_size=400,
                          race_rows=None, variants=("rules", "tapes", "graph", "xla"))
    assert _tuning._timing(book, off) == pytest.approx(chooser.SLOW_RUNS * 4 * 0.2)
    off.race_rows = 100  # (a kernel that times its builds on fewer rows than a chunk's)
    assert _tuning._timing(book, off) == pytest.approx(chooser.SLOW_RUNS * 4 * 0.05)
    off.chunk_size = 2
    assert _tuning._timing(book, off) == _tuning.TIMING_SECONDS
    beside = SimpleNamespace(races_on_calls=True, race_compilations=0, chunk_size=400,
                             variants=("xla", "graph"))
    assert _tuning._timing(book, beside) == pytest.approx((chooser.CallRace.SAMPLES + 1) * 0.2)
    assert _tuning._timing(Ledger(), off) == _tuning.TIMING_SECONDS  # nothing measured yet


def test_a_race_against_torch_func_is_priced_with_torch_dynamos_import(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A later race whose contender is a torch.func build, where the builds in use imported
    nothing and the process has not loaded torch._dynamo, costs that import beside its
    compilations: settled only once the work repays both."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from batchjac._backends.torch import compat as torch_compat
    from batchjac._backends.torch.builds import TorchKernel
    from batchjac._backends.torch.second import TorchSecondKernel
    from batchjac._tune.state import Ledger

    second = object.__new__(TorchSecondKernel)
    second.variants, second.variant = ("autograd", "plain"), "autograd"
    first = object.__new__(TorchKernel)
    first.variants, first.variant = ("vmap", "replicated", "looped"), "looped"
    monkeypatch.setattr(torch_compat, "dynamo_loaded", lambda: False)
    assert second.race_setup_seconds == first.race_setup_seconds == torch_compat.DYNAMO_IMPORT_SECONDS
    second.variant = first.variant = None
    assert second.race_setup_seconds == torch_compat.DYNAMO_IMPORT_SECONDS
    second.variant, first.variant = "plain", "vmap"  # (a torch.func build in use: loaded)
    assert second.race_setup_seconds == first.race_setup_seconds == 0.0
    second.variant, first.variant = "autograd", "looped"
    monkeypatch.setattr(torch_compat, "dynamo_loaded", lambda: True)
    assert second.race_setup_seconds == first.race_setup_seconds == 0.0

    raced = []
    kernel = SimpleNamespace(remembered=None, untimed=True, race_compilations=1,
                             races_on_calls=False, chunk_size=1, variants=("autograd", "plain"),
                             race_setup_seconds=torch_compat.DYNAMO_IMPORT_SECONDS, building=threading.Lock(),
                             retune=lambda *a: raced.append(a), call_race=None, raced=False)
    # 0.1 s a compilation, 0.8 s of work seen: a compilation and the timed runs are repaid
    # (the race would be due without the import), the import is not yet
    book = Ledger(rows=80, seconds=0.8, compile_seconds=0.1)
    _tuning.settle(book, kernel, lambda: (None, ()))
    assert raced == []
    book.rows, book.seconds = 400, 4.0
    _tuning.settle(book, kernel, lambda: (None, ()))
    assert len(raced) == 1
