"""The one chooser (batchjac._tune.chooser): the order of a kernel's first call and the one
margin rule every race decides by, on injected timings; and that no backend keeps a margin of
its own."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchjac._backends import CallBudget
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
