"""The one chooser (batchjac._tune.chooser): the order of a kernel's first call and the one
margin rule every race decides by, on injected timings; and that no backend keeps a margin of
its own."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchjac._backends import CallBudget
from batchjac._backends._base import UNTUNED, Kernel
from batchjac._tune import chooser

SRC = Path(__file__).resolve().parents[1] / "src" / "batchjac"


@pytest.mark.parametrize(("challenger", "expected"), [
    (0.96, "default"),     # 4% faster: within the margin, the build in use stays
    (0.94, "no-ynnpack"),  # 6% faster: past it
    (1.20, "default"),
])
def test_a_challenger_must_win_by_the_margin(challenger: float, expected: str) -> None:
    assert chooser.MARGIN == 0.05
    times = {"default": 1.0, "no-ynnpack": challenger}
    assert chooser.winner(times, "default") == expected


def test_the_fastest_challenger_is_weighed_and_stages_chain() -> None:
    times = {"default": 1.0, "no-ynnpack": 0.9, "default/128": 0.8, "no-ynnpack/128": 0.86}
    first = chooser.winner(times, "default", ["no-ynnpack"])
    assert first == "no-ynnpack"
    # the blocked builds against the first stage's winner: 0.8 < 0.95 * 0.9
    assert chooser.winner(times, first, ["default/128", "no-ynnpack/128"]) == "default/128"
    # a challenger not timed (pruned, failed) is no rival; none at all keeps the incumbent
    assert chooser.winner(times, "default", ["xla"]) == "default"
    assert chooser.winner({"graph": 1.0}, "graph") == "graph"


def test_a_wider_margin_where_a_switch_costs_more() -> None:
    per_row = {4096: 1.0, 1024: 0.85}  # chunk sizes as keys: 15% faster per row
    assert chooser.winner(per_row, 4096, [1024]) == 1024
    assert chooser.winner(per_row, 4096, [1024], margin=0.25) == 4096


def kernel(fixed: str | None = None, builds: int = 2) -> SimpleNamespace:
    return SimpleNamespace(fixed=fixed, variants=tuple(f"b{i}" for i in range(builds)))


def test_the_order_of_a_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """fixed -> only -> race (where the budget repays it) -> untimed; autotune off: untimed."""
    race, plain = CallBudget(race=True), CallBudget(rows=10_000)
    assert chooser.first_step(kernel("b1"), race) == "fixed"
    assert chooser.first_step(kernel(builds=1), race) == "only"
    assert chooser.first_step(kernel(), race) == "race"
    assert chooser.first_step(kernel(), plain) == "untimed"
    assert chooser.first_step(kernel(builds=1), race, builds=3) == "race"
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", "off")
    assert chooser.first_step(kernel(), race) == "untimed"


def test_no_backend_keeps_a_margin_or_a_race_loop_of_its_own() -> None:
    """Every race of builds decides through chooser.winner: no class constant named *MARGIN
    and no comparison of a timing against a scaled timing in the backends."""
    found = []
    for path in sorted((SRC / "_backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                found += [f"{path.name}: {n}" for n in names if n.endswith("MARGIN")]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id == "min" and any(isinstance(k, ast.keyword) and k.arg == "key"
                                                  and "times" in ast.unparse(k.value)
                                                  for k in node.keywords) and \
                    "rivals" not in ast.unparse(node):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_the_stages_of_a_race_follow_the_build_records() -> None:
    """The stage-0 build defends; each later stage challenges the build kept before it."""
    builds = [chooser.Build("default", 0), chooser.Build("no-ynnpack", 1),
              chooser.Build("default/128", 2), chooser.Build("no-ynnpack/128", 2)]
    times = {"default": 1.0, "no-ynnpack": 0.9, "default/128": 0.8, "no-ynnpack/128": 0.86}
    assert chooser.pick(times, builds, "default") == "default/128"
    # blocks 4% faster than the kept build: within the margin
    assert chooser.pick({**times, "default/128": 0.87}, builds, "default") == "no-ynnpack"
    # no challenger past the margin at any stage: the stage-0 build stays
    assert chooser.pick({"default": 1.0, "no-ynnpack": 0.97, "default/128": 0.99,
                         "no-ynnpack/128": 0.96}, builds, "default") == "default"
    # one stage of all (second order): the fastest past the margin, against the one in use
    flat = [chooser.Build(n) for n in ("graph", "xla", "tapes")]
    assert chooser.pick({"graph": 1.0, "xla": 0.7, "tapes": 0.8}, flat, "tapes") == "xla"
    assert chooser.pick({"graph": 1.0, "xla": 0.78, "tapes": 0.8}, flat, "tapes") == "tapes"


class Fake(Kernel):
    """A kernel that only declares its builds and how to run one: the chooser does the rest.
    Build "slow" fails for the model where ``broken`` says so."""

    def __init__(self, times: dict[str, float], broken: tuple[str, ...] = (),
                 known: str | None = None) -> None:
        self.mode, self.chunk_size, self.with_outputs = "reverse", 4, False
        self.variants, self.variant, self.times = tuple(times), None, times
        self.broken, self._known, self.runs = broken, known, []

    def build(self, name: str) -> chooser.Build:
        return chooser.Build(name, int(name != "a"))

    @property
    def known(self) -> str | None:
        return self._known

    def untimed_first(self, u, ctx, budget):  # type: ignore[no-untyped-def]
        return "c", "c (cheap)", True

    def contenders(self, u, ctx):  # type: ignore[no-untyped-def]
        works = tuple(v for v in self.variants if v not in self.broken)
        if len(works) < 2:
            self._select(works[0], f"{works[0]} (the others failed)")
        return works

    def run_build(self, name, u, ctx):  # type: ignore[no-untyped-def]
        self.runs.append(name)

    def call(self, u, ctx, budget=UNTUNED):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race's timings from the fake kernel's table, each build run once."""
    def race(run, names, **options):  # type: ignore[no-untyped-def]
        kernel_times = {}
        for name in names:
            run(name)
            kernel_times[name] = Fake.current.times[name]
        return kernel_times

    monkeypatch.setattr(chooser, "race", race)


def _first(kernel: Fake, budget: CallBudget) -> Fake:
    Fake.current = kernel  # type: ignore[attr-defined]
    kernel.choose(None, (), budget)
    return kernel


@pytest.mark.usefixtures("timed")
def test_the_state_machine_of_a_first_call_and_its_later_race() -> None:
    race, plain = CallBudget(race=True), CallBudget(rows=10)
    times = {"a": 1.0, "b": 0.5, "c": 0.97}
    k = _first(Fake(times), race)  # race: "b" beats the stage-0 "a" past the margin
    assert (k.variant, k.untimed, sorted(set(k.runs))) == ("b", False, ["a", "b", "c"])
    assert k.note.startswith("b (timed one chunk: a 1000.00 ms")
    k = _first(Fake({"a": 1.0, "c": 0.97}), race)  # within the margin: "a" stays
    assert k.variant == "a"
    k = Fake(times)
    k.use("c", "a store's record")
    _first(k, race)  # fixed: taken, nothing timed
    assert (k.variant, k.note, k.runs) == ("c", "c (a store's record)", [])
    k = _first(Fake(times, known="b"), race)  # known for another chunk size: taken
    assert (k.variant, k.runs) == ("b", [])
    assert "another chunk size" in k.note
    k = _first(Fake({"a": 1.0}), race)  # one build
    assert (k.variant, k.runs) == ("a", [])
    k = _first(Fake(times, broken=("b", "c")), race)  # the others fail: no race, said so
    assert (k.variant, k.note, k.runs) == ("a", "a (the others failed)", [])

    k = _first(Fake(times), plain)  # untimed: the cheap build, marked for a later race
    assert (k.variant, k.untimed, k.runs) == ("c", True, [])
    k.retune(None, ())
    assert (k.variant, k.untimed) == ("b", False)
    k.runs.clear()
    k.retune(None, ())  # raced already: nothing more
    assert k.runs == []
    k = _first(Fake(times), plain)
    k.use("c")  # fixed after the first call: never raced
    k.retune(None, ())
    assert (k.variant, k.runs) == ("c", [])


def test_no_kernel_holds_a_state_machine_or_a_race() -> None:
    """The backends declare builds and run them; only the chooser times and decides: no
    backend module calls race, winner or pick, nor defines a first call's or a retune's
    method of its own."""
    found = []
    for path in sorted((SRC / "_backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else \
                    node.func.attr if isinstance(node.func, ast.Attribute) else ""
                if name in ("race", "winner", "pick", "race_builds", "first_call") and \
                        path.name != "_base.py":  # (Kernel.choose: the chooser's entry)
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.FunctionDef) and (node.name in ("_first_call", "_race") or
                                                      node.name.startswith("_race_")):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: def {node.name}")
            if isinstance(node, ast.FunctionDef) and node.name == "retune" and \
                    path.name != "_base.py":
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: def retune")
    assert not found, found


class CallRacing(Fake):
    """The fake kernel whose later race rides on the calls; "slow" is made beside the calls
    and is ready only once ``made`` says so."""

    races_on_calls = True
    race_options = {"prune": 1.3}  # noqa: RUF012 - read only

    def __init__(self, times: dict[str, float]) -> None:
        super().__init__(times)
        self.made: set[str] = set()

    def contenders_beside(self, u, ctx):  # type: ignore[no-untyped-def]
        return self.variants

    def ready(self, name: str) -> bool:
        return name != "slow" or "slow" in self.made


def _calls(k: CallRacing, n: int) -> list[str]:
    """``n`` user calls through the chooser's call race, each taking its build's time; the
    builds that computed them."""
    ran = []
    for _ in range(n):
        name = chooser.before_call(k)
        ran.append(k.variant)
        chooser.after_call(k, name, k.times[k.variant])
    return ran


def test_a_race_on_the_calls_keeps_every_result_and_decides_on_their_times() -> None:
    """Each call runs one contender (its result the call's: nothing is computed twice), a
    contender's first call is not counted, the medians decide by the margin, the race waits
    for a build not made yet, and one far slower than the fastest leaves after its first counted call."""
    k = CallRacing({"a": 1.0, "b": 0.5, "c": 0.97, "slow": 5.0})
    _first(k, CallBudget(rows=10))
    assert (k.variant, k.untimed) == ("c", True)
    k.retune(None, ())
    assert k.call_race is not None
    assert k.runs == []  # nothing was run for the race alone
    ran = _calls(k, 6)
    assert "slow" not in ran  # not made yet
    assert k.call_race is not None
    # nothing is timed while a contender is still being made beside the calls (its making
    # shares the cores with the call): the build in use answers them
    assert ran == ["c"] * 6
    assert not any(k.call_race.samples.values())
    k.made.add("slow")
    ran += _calls(k, 40)
    assert k.call_race is None
    assert k.raced
    assert k.variant == "b"
    assert k.note.startswith("b (timed one chunk: a 1000.00 ms")
    assert ran.count("slow") == 2  # its first call (not counted) and one more: pruned
    # the incumbent and the winner timed fully; the race ended, then "b" ran every call
    assert all(ran.count(name) >= 1 + chooser.CallRace.SAMPLES for name in "ab")
    assert ran[-5:] == ["b"] * 5
    assert k.runs == []
    assert chooser.before_call(k) is None  # the race is over: calls run "b" untouched


def test_a_call_race_keeps_the_incumbent_within_the_margin() -> None:
    k = CallRacing({"a": 1.0, "b": 0.97})
    _first(k, CallBudget(rows=10))
    k.retune(None, ())
    _calls(k, 40)
    assert (k.variant, k.call_race) == ("a", None)


def _raced(times: dict[str, float], **options: object) -> tuple[dict[str, float], list[str]]:
    """``chooser.race`` over builds that take ``times`` seconds a run, on a clock that the runs
    advance (no wall-clock time), and the runs in order."""
    now, runs = [0.0], []

    def run(name: str) -> None:
        runs.append(name)
        now[0] += times[name]

    real = chooser.time
    chooser.time = SimpleNamespace(perf_counter=lambda: now[0])  # type: ignore[assignment]
    try:
        return chooser.race(run, list(times), **options), runs  # type: ignore[arg-type]
    finally:
        chooser.time = real


def test_a_race_of_slow_builds_prunes_on_their_first_run() -> None:
    """Where a run takes a whole slow chunk, a build ``prune`` times slower than the fastest at
    its first run is not run again; without ``prune`` every build gets ``SLOW_RUNS`` runs."""
    times = {"rules": 0.2, "tapes": 0.6, "graph": 1.1, "xla": 0.22}
    found, runs = _raced(times, prune=1.3)
    assert runs.count("tapes") == runs.count("graph") == 1
    assert runs.count("rules") == runs.count("xla") == chooser.SLOW_RUNS
    assert found == pytest.approx(times)
    _, runs = _raced(times)
    assert all(runs.count(name) == chooser.SLOW_RUNS for name in times)
    # fast builds: the best of three first (a fresh build's first runs are slow), then pruned
    # (one left: no rounds)
    _, runs = _raced({"a": 0.001, "b": 0.004}, prune=1.3)
    assert runs == ["a", "b"] * 3


def test_a_call_race_of_fast_calls_prunes_on_the_best_of_two() -> None:
    """Calls under SLOW_CALL: a contender whose first counted call is slow (a fresh
    executable's second run) stays while its best of two is within ``prune``; one slow twice
    leaves. A slow call (0.05 s or more) prunes at its first counted call."""
    builds = [chooser.Build(n) for n in ("a", "b", "c")]
    race_ = chooser.CallRace(builds, "a", prune=1.3)
    for name in ("a", "b", "c"):
        race_.record(name, 1.0)  # (the first calls: not counted)
    for name, seconds in (("a", 0.010), ("b", 0.016), ("c", 0.016)):
        race_.record(name, seconds)
    assert not race_.out  # (one sample each: not yet)
    for name, seconds in (("a", 0.010), ("b", 0.009), ("c", 0.015)):
        race_.record(name, seconds)
    assert race_.out == {"c"}
    slow = chooser.CallRace(builds, "a", prune=1.3)
    for name, seconds in (("a", 1.0), ("b", 1.0), ("c", 1.0), ("a", 0.1), ("b", 0.16), ("c", 0.12)):
        slow.record(name, seconds)
    assert slow.out == {"b"}
