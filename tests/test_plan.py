"""Planner: mode choice and chunk sizes."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac._config import parse_bytes
from batchjac._plan import MAX_CHUNK, bytes_per_row, make_plan
from batchjac._tune.races import TUNE_MIN_ROWS


def plan(**kw):
    args = {"n": 1000, "k": 5, "m": 4, "in_elems": 8, "dtype": np.dtype(np.float32), "mode": "auto",
            "chunk_size": None, "max_memory": 10**9}
    args.update(kw)
    # a plan made now, not the planner's cached one from an earlier call (in `make mutate`,
    # one made before the mutant under test was switched on, which would hide it)
    from batchjac._plan import _make_plan

    _make_plan.cache_clear()
    return make_plan(**args)


def test_auto_mode_follows_shapes() -> None:
    assert plan(k=4, m=512).mode == "forward"  # W3, wide output
    assert plan(k=784, m=10).mode == "reverse"  # W2, wide input
    assert plan(k=5, m=4).mode == "reverse"
    # a backend whose backward pass weighs 1.5 tangent passes (JAX): forward below 1.5 m
    assert plan(k=5, m=4, forward_bias=1.5).mode == "forward"
    assert "tangent passes cost less" in plan(k=5, m=4, forward_bias=1.5).reason
    assert plan(k=6, m=4, forward_bias=1.5).mode == "reverse"
    assert plan(k=5, m=4, forward_bias=1.5, mode="reverse").mode == "reverse"
    assert plan(k=4, m=512, mode="reverse").mode == "reverse"
    assert "forward mode" in plan(k=4, m=512).reason


def test_chunks_fit_budget_and_compile_few_shapes() -> None:
    p = plan(n=1000)
    assert (p.chunk_size, p.n_chunks) == (1000, 1)
    p = plan(n=100_000)  # a 1 GB budget at ~21.8 kB a row: 45,955 rows at most
    assert p.n_chunks == 3
    assert p.chunk_size == 33_344  # balanced: 3 x 33,344, not 45,955 + 45,955 + 8,090
    assert p.chunk_size * bytes_per_row(5, 4, 8, 4) <= 10**9
    big = plan(n=10**6, max_memory=10**10)
    assert big.chunk_size <= MAX_CHUNK < big.chunk_size * 1.05  # capped, then balanced
    small_budget = plan(n=100_000, k=784, m=10, in_elems=784, max_memory=10**8)
    per_row = bytes_per_row(784, 10, 784, 4)
    assert small_budget.chunk_size * per_row <= 10**8
    padding = small_budget.chunk_size * small_budget.n_chunks - 100_000
    assert 0 <= padding < 0.02 * small_budget.chunk_size * small_budget.n_chunks  # balanced chunks
    sizes = {plan(n=n).chunk_size for n in range(2**14, 2**15)}
    assert len(sizes) <= 1025  # multiples of 16 in one octave of N, plus its upper end
    assert all(n <= plan(n=n).chunk_size <= n * 1.001 for n in range(1, 30000, 7))
    assert plan(n=10_000).chunk_size == 10_000  # round sizes need no padding


def test_bad_plan_options() -> None:
    with pytest.raises(batchjac.InputError, match="`mode` must be 'auto', 'forward' or 'reverse'"):
        plan(mode="fast")
    with pytest.raises(batchjac.InputError, match="`chunk_size` must be a positive integer; got 0"):
        plan(chunk_size=0)
    with pytest.raises(batchjac.InputError, match="`max_memory` must be a number of bytes or a string"):
        parse_bytes("lots")
    assert parse_bytes("512MiB") == 512 * 2**20


# -- decisions taken by timing (_autotune), on injected timings ---------------------------------
class _Clock:
    """The clock :mod:`batchjac._tune.races` reads; only the fake kernels advance it, so every
    decision below is taken on exactly the timings the test chose (no sleeps a busy machine
    stretches: a 4% slowdown flipped the old sleeping version's "2% faster" case)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    import batchjac._tune.races

    fake = _Clock()
    monkeypatch.setattr(batchjac._tune.races, "clock", fake)
    return fake


class _FakeKernel:
    """Takes ``rows * cost`` seconds of the fake clock per call: a kernel whose time per row we
    choose."""

    variants = ("default",)
    variant = "default"
    note = ""

    def __init__(self, clock: _Clock, size: int, cost: float, computes: str = "reverse") -> None:
        self.clock, self.chunk_size, self.cost, self.computes = clock, size, cost, computes
        self.calls = 0

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[None, np.ndarray]:
        self.calls += 1
        self.clock.now += self.chunk_size * self.cost
        return None, np.ones((self.chunk_size, 1, 1), np.float32)

    provisional = __call__


US = 1e-6


def _ladder(cost: dict[int, float], planned: int = 4096) -> tuple[int, list[int]]:
    """Run a :class:`RowsRace` to its decision on calls whose seconds per row are ``cost``
    (per chunk size): the size decided and the size each call ran."""
    from batchjac._tune.races import RowsRace

    race, ran = RowsRace(planned), []
    while race.decided is None:
        size = race.next()
        ran.append(size)
        race.record(size, cost[size])
        assert len(ran) < 50, ran
    return race.decided, ran


def test_the_ladder_takes_a_smaller_chunk_when_clearly_faster() -> None:
    # 1,024 rows 30% faster per row than 4,096: taken; 256 rows 3x slower at its first call:
    # the descent stops there (STOP_RATIO), 64 is never run
    best, ran = _ladder({4096: 10 * US, 1024: 7 * US, 256: 30 * US, 64: 1 * US})
    assert best == 1024
    assert 64 not in ran
    assert ran.count(256) == 1
    # the descent (each size on TIMED_RUNS calls), then the two that decide, in turn
    assert ran == [4096, 4096, 1024, 1024, 256, 4096, 1024, 4096, 1024]


def test_the_ladder_prefers_the_larger_of_near_sizes() -> None:
    # 256 rows a little faster per row than 1,024 (within NEAR = 5%): the larger, fewer chunks
    assert _ladder({4096: 20 * US, 1024: 14.2 * US, 256: 13.8 * US, 64: 60 * US})[0] == 1024
    # 256 rows clearly faster (more than NEAR) than 1,024: 256
    assert _ladder({4096: 20 * US, 1024: 14.2 * US, 256: 13.0 * US, 64: 60 * US})[0] == 256


@pytest.mark.parametrize(("faster", "chosen"), [(0.98, 4096), (0.96, 4096), (0.94, 1024)])
def test_the_ladder_margin(faster: float, chosen: int) -> None:
    """A smaller size must be more than ROWS_MARGIN (5%) faster per row than the planned one:
    2% and 4% are within the noise and keep the plan, 6% changes it."""
    from batchjac._tune.races import ROWS_MARGIN

    assert ROWS_MARGIN == 0.05
    assert _ladder({4096: 10 * US, 1024: faster * 10 * US, 256: 30 * US})[0] == chosen


def test_the_ladder_decides_by_medians_and_skips_compiling_calls() -> None:
    """A call that compiled its size's kernel is not counted; one slow spell of the planned
    size's calls does not decide: the confirming calls' medians do."""
    from batchjac._tune.races import RowsRace

    race = RowsRace(4096)
    race.record(4096, 10 * US)
    race.record(4096, 10 * US)
    race.record(1024, 50 * US, counted=False)  # its kernel's compilation
    assert race.next() == 1024
    assert race.per_row() == {4096: 10 * US}
    race.record(1024, 7 * US)
    race.record(1024, 7 * US)
    race.record(256, 30 * US)  # descent over
    for size, t in [(4096, 30 * US), (1024, 7 * US), (4096, 10 * US), (1024, 7 * US)]:
        assert race.next() == size
        race.record(size, t)
    assert race.decided == 1024
    assert race.per_row()[4096] == 10 * US  # the median of 10, 10, 30, 10
    race.record(4096, 1.0)  # a call planned before the decision changes nothing
    assert race.decided == 1024


def test_the_ladder_skips_small_chunks() -> None:
    from batchjac._tune.races import rows_plan

    asked = []
    got, report = rows_plan(None, _spec(500), plan(n=500), False, mode="reverse",  # type: ignore[arg-type]
                            start=lambda: asked.append(1) or True)
    assert (got.chunk_size, report, asked) == (500, None, [])


def test_a_decided_ladder_is_not_raced_again() -> None:
    """A size decided (by an earlier race, or remembered on disk) is the plan's at once: no
    race is started or asked about."""
    from types import SimpleNamespace

    from batchjac._tune.races import rows_plan

    bound = SimpleNamespace(
        tuned_rows={("rows", "reverse", 4096, False): (1024, "4096 rows 10.00 us, 1024 rows 7.00 us")},
        tuning=SimpleNamespace(rows_races={}))
    got, report = rows_plan(bound, _spec(4096), plan(n=4096, chunk_size=4096), False,  # type: ignore[arg-type]
                            mode="reverse", start=lambda: pytest.fail("asked to start a race"))
    assert (got.chunk_size, got.n_chunks, report) == (1024, 4, None)
    assert "timed per row: 4096 rows 10.00 us" in got.reason
    assert bound.tuning.rows_races == {}


def _spec(n: int) -> object:
    from batchjac._validate import normalize

    return normalize((np.random.default_rng(0).normal(size=(n, 1)).astype("f4"),), wrt=None,
                     dtype=None, nan_policy="raise")


def _mode_race(prior: str, times: dict[str, list[float]]) -> tuple[Any, list[str]]:
    """Drive a ModeRace with per-row times for each mode's calls, in the order it asks (the
    other mode's first call, which made its kernel, takes 99 s: not counted)."""
    from batchjac._tune.races import ModeRace

    race = ModeRace(prior)  # type: ignore[arg-type]
    left = {m: list(t) for m, t in times.items()}
    order = []
    for _ in range(20):
        if race.decided is not None:
            break
        mode = race.next()
        order.append(mode)
        race.record(mode, 99.0 if mode == race.other and not race.made else left[mode].pop(0))
    return race, order


@pytest.mark.parametrize(("other_cost", "winner"), [
    (0.9, "other"),  # 10% faster than the cost model's choice on the calls: taken
    (0.97, "prior"),  # 3%, within the chooser's MARGIN = 5%: the prior stays
    (1.2, "prior"),
])
def test_the_modes_race_on_the_calls_in_turn(other_cost: float, winner: str) -> None:
    from batchjac._tune import chooser
    from batchjac._tune.races import MODE_RUNS

    assert chooser.MARGIN == 0.05
    race, order = _mode_race("reverse", {"reverse": [1.0, 1.3, 1.0], "forward": [other_cost] * 3})
    # the other mode's kernel first (its first call not timed), then each mode in turn
    assert order == ["forward"] + ["reverse", "forward"] * MODE_RUNS
    assert race.decided == (race.other if winner == "other" else race.prior)
    assert "reverse 1e+06 us a row" in race.why  # (medians: the 1.3 is an outlier)


def test_a_mode_clearly_slower_at_its_first_call_loses_at_once() -> None:
    race, order = _mode_race("forward", {"forward": [1.0], "reverse": [1.6]})
    assert order == ["reverse", "forward", "reverse"]
    assert race.decided == "forward"
    race, order = _mode_race("forward", {"forward": [1.6], "reverse": [1.0]})
    assert race.decided == "reverse"


def test_the_modes_race_waits_for_the_kernel_made_beside_the_calls() -> None:
    import concurrent.futures

    from batchjac._tune.races import ModeRace

    race = ModeRace("forward")
    race.making = concurrent.futures.Future()
    assert not race.ready()  # (the calls run the prior mode meanwhile, untimed)
    race.making.set_result(None)
    assert race.ready()
    assert race.next() == "reverse"


def test_a_mode_that_fails_for_the_model_loses_the_race_on_the_calls() -> None:
    from batchjac._tune.races import ModeRace

    race = ModeRace("reverse")
    race.record("forward", 1e-6, failed=True)  # its kernel computed in reverse mode
    assert race.decided == "reverse"
    assert "forward mode fails" in race.why
    race = ModeRace("reverse")
    race.record("reverse", 1e-6)  # (not its turn: a call another thread planned before)
    assert race.next() == "forward"
    assert not race.samples["reverse"]


@pytest.mark.parametrize(("forward_cost", "prior", "winner"), [
    (0.9, "reverse", "forward"),  # 10% faster than the cost model's choice: taken
    (0.97, "reverse", "reverse"),  # 3% (within the chooser's MARGIN = 5%): the prior stays
    (1.1, "forward", "reverse"),
    (1.03, "forward", "forward"),
])
def test_time_modes_switches_only_past_the_margin(clock: _Clock, forward_cost: float, prior: str,
                                                  winner: str) -> None:
    from batchjac._tune import chooser
    from batchjac._tune.races import time_modes

    assert chooser.MARGIN == 0.05

    class Bound:
        def __init__(self) -> None:
            self.tuned = {}
            self.kernels: dict[str, _FakeKernel] = {}

        def kernel(self, mode: str, size: int, with_outputs: bool, **_: object) -> _FakeKernel:
            cost = forward_cost * US if mode == "forward" else US
            self.kernels[mode] = _FakeKernel(clock, size, cost, computes=mode)
            return self.kernels[mode]

    bound = Bound()
    u = np.random.default_rng(1).normal(size=(512, 3)).astype(np.float32)
    mode, measured = time_modes(bound, u, (), False, prior)  # type: ignore[arg-type]
    assert mode == winner, measured
    assert f"forward {512 * forward_cost * US * 1e3:.2f} ms" in measured
    calls = bound.kernels["forward"].calls
    assert time_modes(bound, u, (), False, prior)[0] == winner  # remembered: not timed again
    assert bound.kernels["forward"].calls == calls


def test_tuned_chunks_give_the_same_jacobians(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("jax")
    from batchjac._backends._base import made_beside
    from batchjac.examples import mlp_jacobian, mlp_weights, workload_inputs, workload_model

    model = workload_model("W1", "jax")
    unknown, known = workload_inputs("W1", 5000, seed=3)
    ref = mlp_jacobian(mlp_weights((8, 64, 64, 4)), np.concatenate([unknown, known], 1))[:, :, :5]
    sizes = []
    with monkeypatch.context() as patch:
        import batchjac._tune.policy

        patch.setattr(batchjac._tune.policy, "worth", lambda *a, **k: True)  # a job that repays it
        for _ in range(40):
            jac = batchjac.jacobian(model, unknown, known, explain=True)
            np.testing.assert_allclose(jac, ref, rtol=2e-4, atol=2e-5 * np.abs(ref).max())
            made_beside(30)  # (the race's kernel of the other mode, made beside the calls)
            err = capsys.readouterr().err
            # the ladder starts at the planned chunk: the whole batch, or less where the CPU's
            # cache holds fewer rows' temporaries (a 16 MB cache: chunks of 2,500 rows)
            sizes.append(int(re.findall(r"chunks of (\d+) rows", err)[0]))
            if "racing" not in err and len(sizes) > 1:  # (the modes race first, then the sizes)
                break
    assert re.search(r"(kept after timing|timed per row:) (\d+) rows", err), err
    assert TUNE_MIN_ROWS <= sizes[0] <= 5000, sizes
    assert len(set(sizes)) >= 2, sizes
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "off")
    import batchjac._tune.chooser
    import batchjac._tune.races

    def no_timing(*a: Any, **k: Any) -> Any:
        raise AssertionError("timed with BATCHJAC_AUTOTUNE=off")

    monkeypatch.setattr(batchjac._tune.chooser, "race", no_timing)
    monkeypatch.setattr(batchjac._tune.races, "clock", no_timing)
    jac = batchjac.jacobian(model, unknown[:4000], known[:4000], explain=True)
    np.testing.assert_allclose(jac, ref[:4000], rtol=2e-4, atol=2e-5 * np.abs(ref).max())
    err = capsys.readouterr().err
    assert "racing" not in err, err
    # the decisions taken earlier are said again ("timed ..." where they were timed); the chunks
    # are the tuned size where it is below 4,000 rows, a compiled size whose padding costs less
    # than a compilation, or one chunk of 4,000 rows
    used = int(re.findall(r"chunks of (\d+) rows", err)[0])
    assert used in {*sizes, 4000} or "a compiled kernel reused" in err, (used, sizes, err)
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "maybe")
    with pytest.raises(batchjac.InputError, match="BATCHJAC_AUTOTUNE must be 'on' or 'off'"):
        batchjac.jacobian(model, unknown[:3000], known[:3000])


# -- second order: the order of the two differentiations, the estimate, the plan ----------------
ORDER_CASES = [
    # (kind, k, m, reductions_over_forward, expected order); the boundaries k == m and m == k + 1
    ("hessian", 3, 3, True, "forward-over-reverse"),  # m <= k: m gradients along k tangents
    ("hessian", 3, 4, True, "forward-over-forward"),  # k < m: k*k tangent pairs < m*k
    ("hessian", 3, 4, False, "forward-over-forward"),  # the backend flag is for reductions only
    ("hvp", 1, 5, True, "forward-over-reverse"),  # one tangent, however few the unknowns
    ("diagonal", 5, 2, True, "forward-over-forward"),
    ("laplacian", 5, 2, True, "forward-over-forward"),
    ("diagonal", 3, 3, False, "forward-over-reverse"),  # dear second forward pass, m <= k
    ("laplacian", 3, 3, False, "forward-over-reverse"),
    ("diagonal", 3, 4, False, "forward-over-forward"),  # more outputs than unknowns
    ("laplacian", 3, 4, False, "forward-over-forward"),
]


@pytest.mark.parametrize(("kind", "k", "m", "cheap_forward", "expected"), ORDER_CASES)
def test_auto_order_follows_the_shapes(kind: str, k: int, m: int, cheap_forward: bool,
                                       expected: str) -> None:
    from batchjac._plan import choose_order

    order, why = choose_order("auto", kind, k, m, cheap_forward)  # type: ignore[arg-type]
    assert order == expected, why
    if kind == "hvp":
        assert why == "one tangent per instance pushed through the reverse-mode Jacobian"


def test_auto_order_of_reductions_defaults_to_a_cheap_second_forward_pass() -> None:
    """JAX's (the default backend flag): the Laplacian of one output by forward over forward."""
    from batchjac._plan import choose_order, make_second_plan

    assert choose_order("auto", "laplacian", 3, 1)[0] == "forward-over-forward"
    got = make_second_plan(kind="laplacian", n=10, k=3, m=1, in_elems=3, dtype=np.dtype("f8"),
                           order="auto", chunk_size=None, max_memory=10**9)
    assert got.order == "forward-over-forward"


@pytest.mark.parametrize("order", ["forward-over-reverse", "forward-over-forward"])
def test_asked_order_is_kept(order: str) -> None:
    from batchjac._plan import choose_order

    # a Hessian of more outputs than unknowns would take forward over forward by itself
    assert choose_order(order, "hessian", 2, 9) == (order, f"mode={order!r} was asked for")  # type: ignore[arg-type]


def test_bad_second_order_mode_is_named() -> None:
    from batchjac._plan import choose_order

    with pytest.raises(batchjac.InputError, match=r"`mode` of a second-order call must be 'auto', "
                       r"'forward-over-reverse' or 'forward-over-forward'; got 'reverse'\."):
        choose_order("reverse", "hessian", 2, 2)  # type: ignore[arg-type]


# The estimate of second_bytes_per_row worked by hand from its docstring for k=3 unknowns,
# m=2 outputs, 5 input elements, 4-byte floats: activations 2*(5+2)+512 = 526 a pass;
# results (kind's + m*k Jacobian + m outputs): hessian 18+6+2 = 26, diagonal 6+6+2 = 14,
# laplacian 2+6+2 = 10, hvp 6+6+2 = 14; bytes = 2*4*(2*results + temporaries + passes*526).
SECOND_ROWS = [
    # forward over reverse: temporaries tangents*m*k, passes (1+m)*(1+tangents); tangents k (1: hvp)
    ("hessian", "forward-over-reverse", 8 * (52 + 18 + 12 * 526)),
    ("diagonal", "forward-over-reverse", 8 * (28 + 18 + 12 * 526)),
    ("laplacian", "forward-over-reverse", 8 * (20 + 18 + 12 * 526)),
    ("hvp", "forward-over-reverse", 8 * (28 + 6 + 6 * 526)),
    # forward over forward: a Hessian k*k*m temporaries and 2*k*k+1 passes, else 2*k*m and 2*k+1
    ("hessian", "forward-over-forward", 8 * (52 + 18 + 19 * 526)),
    ("diagonal", "forward-over-forward", 8 * (28 + 12 + 7 * 526)),
    ("laplacian", "forward-over-forward", 8 * (20 + 12 + 7 * 526)),
    ("hvp", "forward-over-forward", 8 * (28 + 12 + 7 * 526)),
]


@pytest.mark.parametrize(("kind", "order", "expected"), SECOND_ROWS)
def test_second_order_estimate_by_hand(kind: str, order: str, expected: int) -> None:
    from batchjac._plan import second_bytes_per_row

    assert second_bytes_per_row(kind, order, 3, 2, 5, 4) == expected  # type: ignore[arg-type]


def test_plan_counts_k_squared_per_output() -> None:
    """The memory estimate of a full Hessian grows with k*k per output, the diagonal's with
    k: under one budget a Hessian chunk holds fewer rows than a Jacobian's."""
    from batchjac._plan import second_bytes_per_row

    k, m = 32, 4
    jac = bytes_per_row(k, m, k, 8)
    full = second_bytes_per_row("hessian", "forward-over-reverse", k, m, k, 8)
    diag = second_bytes_per_row("diagonal", "forward-over-forward", k, m, k, 8)
    assert full > 8 * 2 * m * k * k  # at least the result and its copy
    assert full > 4 * jac
    assert full > 2 * diag
    assert second_bytes_per_row("hessian", "forward-over-reverse", 2 * k, m, 2 * k, 8) > 2 * full


def test_second_plan_chunks_by_the_budget() -> None:
    from batchjac._plan import make_second_plan, second_bytes_per_row

    per_row = second_bytes_per_row("hessian", "forward-over-reverse", 3, 2, 5, 4)
    assert per_row == SECOND_ROWS[0][2]
    args = {"kind": "hessian", "k": 3, "m": 2, "in_elems": 5, "dtype": np.dtype("f4"),
            "order": "auto"}
    # 1,000 rows under a budget of 300 rows: 4 balanced chunks of 250
    got = make_second_plan(n=1000, chunk_size=None, max_memory=300 * per_row + 7, **args)
    assert (got.order, got.chunk_size, got.n_chunks, got.budget_rows) == (
        "forward-over-reverse", 250, 4, 300)
    assert got.memory_note == ""
    assert got.reason.startswith("hessian: forward-over-reverse (2 outputs <= 3 unknowns")
    assert f"memory budget 15 MB at ~{per_row} B per row" in got.reason  # 300 x 51,056 B
    # no rows: no chunks
    assert make_second_plan(n=0, chunk_size=None, max_memory=10**9, **args).n_chunks == 0
    # 1,001 rows in chunks of 100 given: 11 chunks, the last short
    given = make_second_plan(n=1001, chunk_size=100, max_memory=10**9, **args)
    assert (given.chunk_size, given.n_chunks, given.budget_rows) == (100, 11, None)


def test_second_plan_over_the_budget_warns_and_keeps_the_chunk() -> None:
    from batchjac._plan import ChunkMemoryWarning, make_second_plan, second_bytes_per_row

    per_row = second_bytes_per_row("diagonal", "forward-over-forward", 3, 2, 5, 4)
    with pytest.warns(ChunkMemoryWarning, match=r"^batchjac: chunk_size=64 needs ~\d+ MB by the "
                      rf"planner's estimate \(~{per_row} B per row\).*\(at most 10 rows\)") as caught:
        got = make_second_plan(kind="diagonal", n=640, k=3, m=2, in_elems=5, dtype=np.dtype("f4"),
                               order="forward-over-forward", chunk_size=64,
                               max_memory=10 * per_row)
    assert os.path.basename(caught[0].filename) != "_plan.py"  # points outside the planner
    assert (got.chunk_size, got.n_chunks) == (64, 10)
    assert got.memory_note.startswith("chunk_size=64 needs")
    assert got.memory_note in got.reason


# -- the first-order plan at its boundaries -------------------------------------------------------
def test_asked_mode_and_the_auto_boundary() -> None:
    assert plan(k=784, m=10, mode="forward").mode == "forward"  # kept against the shapes
    assert "mode='forward' was asked for" in plan(k=784, m=10, mode="forward").reason
    assert plan(k=6, m=6).mode == "reverse"  # k == m: m backward passes, no more than k tangents
    assert plan(k=6, m=7).mode == "forward"


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", True, None])
def test_chunk_size_must_be_a_positive_integer(bad: Any) -> None:
    from batchjac._plan import check_options

    if bad is None:  # None: chosen from the budget
        check_options("auto", None, None)
        return
    with pytest.raises(batchjac.InputError, match=rf"`chunk_size` must be a positive integer; got {bad!r}\."):
        check_options("auto", bad, None)


def test_smallest_chunk_size_is_one_row() -> None:
    from batchjac._plan import check_options

    check_options("forward", 1, "1GB")
    check_options("reverse", np.int64(1), None)
    assert (plan(n=3, chunk_size=1).chunk_size, plan(n=3, chunk_size=1).n_chunks) == (1, 3)


def test_bytes_per_row_worked_by_hand() -> None:
    """k=5 unknowns, m=4 outputs, 8 input elements, float32: activations 2*(8+4)+512 = 536 a
    basis vector, min(k, m) = 4 of them plus the primal; 2*4*(2*4*5 + 5*536) bytes."""
    assert bytes_per_row(5, 4, 8, 4) == 8 * (40 + 5 * 536) == 21_760
    assert bytes_per_row(1, 1, 180, 4) == 8 * (2 + 2 * 874) == 14_000


def test_given_chunk_size_is_capped_past_four_times_the_rows() -> None:
    assert plan(n=10, chunk_size=40).chunk_size == 40  # 4x the rows: kept (one compiled shape)
    capped = plan(n=10, chunk_size=41)
    assert (capped.chunk_size, capped.n_chunks) == (10, 1)
    assert "chunk_size was given as 41, more than 4 times the rows: capped at the 10 rows" in capped.reason
    assert plan(n=1, chunk_size=5).chunk_size == 1
    kept = plan(n=1000, chunk_size=100)
    assert kept.reason.endswith("chunks of 100 rows (chunk_size was given)")
    assert kept.budget_rows is None


def test_chunk_size_over_the_budget_is_kept_with_a_warning_that_says_by_how_much() -> None:
    per_row = bytes_per_row(1, 1, 180, 4)  # 14,000 B
    exact = {"n": 1000, "k": 1, "m": 1, "in_elems": 180, "chunk_size": 250}
    assert plan(max_memory=250 * per_row, **exact).memory_note == ""  # exactly the budget: fits
    note = ("chunk_size=250 needs ~4 MB by the planner's estimate (~14000 B per row), more than "
            "the memory budget (max_memory) of 2 MB: pass a smaller chunk_size (at most 107 rows), "
            "a larger max_memory, or no chunk_size to let batchjac choose")  # 3.5 MB, 1.5 MB
    with pytest.warns(batchjac.ChunkMemoryWarning) as got:
        over = plan(max_memory=1_500_000, **exact)
    assert str(got[0].message) == f"batchjac: {note}."
    # it points outside the planner, at its caller (not at the exact frame: under mutmut a
    # trampoline of mutmut's module is that caller)
    assert os.path.basename(got[0].filename) != "_plan.py"
    assert over.memory_note == note
    assert (over.chunk_size, over.n_chunks) == (250, 4)
    assert over.reason.endswith(f"chunks of 250 rows (chunk_size was given; {note})")
    with pytest.warns(batchjac.ChunkMemoryWarning, match=r"\(at most 1 rows\)"):
        plan(max_memory=per_row + 1, **exact)


def test_budget_of_one_row_and_of_exactly_the_rows() -> None:
    per_row = bytes_per_row(1, 1, 180, 4)
    one = plan(n=3, k=1, m=1, in_elems=180, max_memory=per_row + 1)
    assert (one.chunk_size, one.n_chunks, one.budget_rows) == (1, 3, 1)
    fits = plan(n=300, k=1, m=1, in_elems=180, max_memory=300 * per_row)
    assert (fits.chunk_size, fits.n_chunks, fits.budget_rows) == (300, 1, 300)
    assert fits.reason.endswith("(all 300 rows fit the memory budget in one chunk)")
    balanced = plan(n=1000, k=1, m=1, in_elems=180, max_memory=1_500_000)  # 107 rows a chunk
    assert (balanced.chunk_size, balanced.n_chunks, balanced.budget_rows) == (100, 10, 107)
    assert balanced.reason.endswith("(memory budget 2 MB at ~14000 B per row)")  # 1.5 MB


def test_second_order_choices_reach_the_plan() -> None:
    from batchjac._plan import choose_order, make_second_plan

    assert choose_order("auto", "hessian", 3, 4)[1] == "3 unknowns < 4 outputs: 9 tangent pairs < 12"
    got = make_second_plan(kind="laplacian", n=10, k=3, m=3, in_elems=3, dtype=np.dtype("f8"),
                           order="auto", chunk_size=None, max_memory=10**9,
                           reductions_over_forward=False)
    assert got.order == "forward-over-reverse"


def test_auto_mode_without_a_measured_bias_is_reverse_from_k_equal_m() -> None:
    """A backward pass weighs one tangent pass unless the backend measured otherwise: with
    more unknowns than outputs auto mode is reverse (a bias of 2 would make it forward)."""
    from batchjac._plan import choose_mode

    assert choose_mode("auto", 3, 2)[0] == "reverse"
    assert choose_mode("auto", 3, 2, forward_bias=2.0)[0] == "forward"
    assert choose_mode("auto", 2, 3)[0] == "forward"


def test_a_forward_hessian_is_weighed_against_forward_over_reverse() -> None:
    """A backend that pushes a full Hessian forward (JAX) takes it where its
    ``1 + k + k(k+1)/2`` Taylor terms are fewer than forward over reverse's ``(1 + k)(1 + m)``:
    W6's shapes (5 unknowns, 4 outputs: 21 < 30), not W7H's (3 unknowns, 1 output: 10 > 8);
    a backend without one keeps the old rule."""
    from batchjac._plan import choose_order

    order, why = choose_order("auto", "hessian", 5, 4, forward_hessian=True)
    assert order == "forward-over-forward", why
    assert why.startswith("21 second-order Taylor terms"), why
    assert "< 30" in why, why
    assert choose_order("auto", "hessian", 3, 1, forward_hessian=True)[0] == "forward-over-reverse"
    assert choose_order("auto", "hessian", 5, 4)[0] == "forward-over-reverse"
    assert choose_order("auto", "hessian", 8, 4, forward_hessian=True)[0] == "forward-over-reverse"
