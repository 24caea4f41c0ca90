"""The cold-start part of ``batchjac bench``: the report's cold and warm-cache columns, the JAX
fresh-closure line and the "First call in a fresh process" section rendered from synthetic
results (no subprocess), and one real cold measurement of W1 in PyTorch with a tiny N."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchjac._bench import cold, run


def _steady(workload: str, n: int, backend: str, t: float, t_best: float, best: str) -> dict[str, Any]:
    def case(name: str, role: str, median: float) -> dict[str, Any]:
        return {"name": name, "role": role, "median_s": median, "compile_s": 0.5,
                "max_rel_err_vs_best": 1e-7 if role != "forward" else None, "n_timed": 3,
                "calls_per_sample": 1, "all_s": [median] * 3}

    return {"workload": workload, "backend": backend, "n": n, "k": 5, "m": 4,
            "description": "synthetic", "repeats": 3, "best_expert": best,
            "cases": [case("batchjac", "batchjac", t), case(best, "expert", t_best),
                      case("F forward", "forward", t_best / 4)],
            "batchjac_plan": [], "peak_rss_mb_after_batchjac": 300.0, "peak_rss_mb_end": 310.0}


def _side(first: float, second: float = 0.001, **extra: Any) -> dict[str, Any]:
    return {"first_s": first, "second_s": second, "setup_s": 1.0,
            "calls_s": [first, second, second], **extra}


def _cold(workload: str, n: int, backend: str, bj: list[float], warm: list[float],
          natives: dict[str, list[float]], loop: tuple[list[float], list[float]] | None = None
          ) -> dict[str, Any]:
    rounds = []
    for r in range(len(bj)):
        rnd: dict[str, Any] = {
            "batchjac": _side(bj[r]), "batchjac_warm": _side(warm[r]),
            "native": {name: _side(times[r]) for name, times in natives.items()},
            "max_rel_err": dict.fromkeys(natives, 2e-07),
            "commands": [f"BATCHJAC_CACHE_DIR=$CACHE python -m batchjac._bench.cold batchjac "
                         f"{workload} {backend} {n}"],
        }
        if loop is not None:  # (batchjac's loop; the native function built once, called again)
            rnd["loop_variant"] = "jacrev"
            rnd["loop_batchjac"] = _side(loop[0][0], calls_s=loop[0])
            for name, times in natives.items():
                rnd["native"][name] = _side(times[r], calls_s=[times[r], *loop[1][1:]])
        rounds.append(rnd)
    k, m = cold.shapes(workload)
    return {"workload": workload, "backend": backend, "n": n, "k": k, "m": m, "rounds": rounds}


@pytest.fixture
def synthetic() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    steady = [_steady("W1", 1000, "torch", 0.009, 0.010, "B3 vmap(jacrev)"),
              _steady("W1", 1000, "jax", 0.0008, 0.001, "B4 jit(vmap(jacrev))"),
              _steady("W1", 100_000, "jax", 0.08, 0.1, "B4 jit(vmap(jacrev))")]
    colds = [
        # medians over three rounds: batchjac 3.0, warm 1.5; jacrev 1.0 beats jacfwd 2.0
        _cold("W1", 1000, "torch", [3.0, 2.9, 3.3], [1.5, 1.4, 1.6],
              {"B3 vmap(jacrev)": [1.0, 0.9, 1.1], "B3 vmap(jacfwd)": [2.0, 2.1, 1.9]}),
        _cold("W1", 1000, "jax", [1.2], [0.6], {"B4 jit(vmap(jacrev))": [0.4]},
              loop=([1.0, 0.5, 0.6, 0.4, 0.5], [0.25, 0.2, 0.2, 0.2, 0.2])),
        # a cold case without a steady row (--only-cold, or another N)
        _cold("W3", 250, "jax", [2.0], [2.0], {"B4 jit(vmap(jacfwd))": [0.5]}),
    ]
    return steady, colds


def test_summary_medians_best_native_and_loop(synthetic: Any) -> None:
    _, colds = synthetic
    s = cold.by_key(colds)
    torch = s[("W1", 1000, "torch")]
    assert torch["best_name"] == "B3 vmap(jacrev)"
    assert torch["t"] == pytest.approx(3.0)
    assert torch["ratio"] == pytest.approx(3.0)
    assert torch["ratio_warm"] == pytest.approx(1.5)
    assert torch["natives"]["B3 vmap(jacfwd)"] == pytest.approx(2.0)
    lp = s[("W1", 1000, "jax")]["loop"]
    assert lp["ratio_1"] == pytest.approx(1.0 / 0.4)
    assert lp["ratio_rest"] == pytest.approx(0.5 / 0.2)  # median of calls 2-5 on both sides
    assert s[("W1", 1000, "torch")]["loop"] is None


def test_markdown_has_cold_columns_closure_line_and_section(synthetic: Any, tmp_path: Path) -> None:
    steady, colds = synthetic
    out = tmp_path / "B.md"
    run.write_markdown(out, steady, [], command="batchjac bench --quick", started="now", wall=60,
                       chart=None, cold=colds)
    text = out.read_text()
    summary = text[text.index("## Summary"):text.index("## First call in a fresh process")]
    header = next(line for line in summary.splitlines() if line.startswith("| workload"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[5:8] == ["batchjac / best", "cold: first call / native first call", "warm cache"]

    def row(workload: str, n: str, backend: str) -> list[str]:
        line = next(ln for ln in summary.splitlines() if ln.startswith(f"| {workload} | {n} | {backend} |"))
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(cols), line
        return cells

    torch = row("W1", "1,000", "torch")
    assert torch[5] == "**0.90**"
    assert torch[6] == "**3.00**"
    assert torch[7] == "1.50"
    jax = row("W1", "1,000", "jax")
    assert jax[6] == "**3.00**"
    assert jax[7] == "1.50"
    assert row("W1", "100,000", "jax")[6:8] == ["-", "-"]  # no cold case at that N
    assert row("W3", "250", "jax")[5:8] == ["-", "**4.00**", "4.00"]  # cold only
    # the JAX fresh-closure line: call 1 and the median of calls 2-5
    assert "| W1 | 1,000 | **2.50** | **2.50** | jacrev |" in summary
    section = text[text.index("## First call in a fresh process"):text.index("## All cases")]
    assert "| W1 | 1,000 | torch | 3 s |" in section
    assert "B3 vmap(jacrev) (other: B3 vmap(jacfwd): 2 s)" in section
    assert "median of 3 such processes" in section
    assert "```sh\nBATCHJAC_CACHE_DIR=$CACHE python -m batchjac._bench.cold batchjac W1 torch 1000" in section


def test_failed_cold_case_is_reported(tmp_path: Path) -> None:
    failed = _cold("W1", 1000, "tensorflow", [1.0], [1.0], {"B2 batch_jacobian+XLA": [1.0]})
    failed["rounds"][0]["batchjac"] = {"error": "exit 1: boom"}
    out = tmp_path / "B.md"
    run.write_markdown(out, [], [], command="c", started="now", wall=1, chart=None, cold=[failed])
    text = out.read_text()
    assert "| W1 | 1,000 | tensorflow | - | - | - | failed | - |" in text
    assert "batchjac: exit 1: boom" in text


def test_chart_with_cold_panel(synthetic: Any, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    steady, colds = synthetic
    labels, bars, _ = run.cold_bars(steady, cold.by_key(colds))
    assert labels == ["W1\nN=1,000", "W3\nN=250"]
    kinds = {(b, k) for _, _, b, k in bars}
    assert {("torch", "steady"), ("torch", "cold"), ("torch", "warm"), ("jax", "closure_1"),
            ("jax", "closure_rest")} <= kinds
    assert ("torch", "closure_1") not in kinds
    assert run.write_chart(tmp_path / "c.png", steady, colds)
    assert (tmp_path / "c.png").stat().st_size > 0


def test_cold_jobs_and_variants() -> None:
    assert run.cold_jobs(True, None) == {"W1": 1000}
    assert run.cold_jobs(False, None) == {"W1": 1000, "W2": 10_000, "W3": 1000, "W4": 2000,
                                          "W6": 10_000, "W7": 100_000, "W7H": 100_000}
    assert run.cold_jobs(True, ["W3"]) == {"W3": 250}
    assert cold.native_variants("W1", "tensorflow") == [None]
    assert cold.native_variants("W2", "torch") == ["jacrev"]  # forward mode hopeless: 784 vs 10
    assert cold.native_variants("W3", "jax") == ["jacrev", "jacfwd"]
    assert cold.native_variants("W6", "jax") == [None]  # second order: one native answer
    assert cold.native_name("torch", None, "W7") == "trace of vmap(jacfwd(jacrev))"
    assert cold.cost_model_variant("W3") == "jacfwd"
    assert cold.cost_model_variant("W1") == "jacrev"


@pytest.mark.slow
def test_real_cold_torch_w1_both_sides() -> None:
    pytest.importorskip("torch")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, "bj.npy"), os.path.join(tmp, "native.npy")]
        bj = cold.run_case(cold.command("batchjac", "W1", "torch", 20, check=paths[0]),
                           cache_dir=tmp, timeout=120)
        native = cold.run_case(cold.command("native", "W1", "torch", 20, variant="jacrev",
                                            check=paths[1]), cache_dir=tmp, timeout=120)
        assert "error" not in bj, bj
        assert "error" not in native, native
        for res in (bj, native):
            assert res["first_s"] > 0
            assert res["second_s"] > 0
            assert res["shape"] == [20, 4, 5]
        a, b = np.load(paths[0]), np.load(paths[1])
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_time_to_the_kth_answer_against_the_faster_native_variant_at_each_k() -> None:
    """Cumulative sums per side, the native code at each K the faster of its variants, medians
    over rounds, K only where every round of both sides got there."""
    case = _cold("W3", 1000, "jax", [1.0, 1.0], [0.5, 0.5],
                 {"B4 jit(vmap(jacrev))": [2.0, 2.0], "B4 jit(vmap(jacfwd))": [1.5, 1.5]})
    for rnd in case["rounds"]:
        rnd["batchjac"]["calls_s"] = [1.0, 0.1, 0.1, 0.1, 0.1, 0.1]
        rnd["batchjac_warm"]["calls_s"] = [0.5, 0.1, 0.1]
        rnd["native"]["B4 jit(vmap(jacrev))"]["calls_s"] = [2.0, 0.05, 0.05, 0.05, 0.05, 0.05]
        rnd["native"]["B4 jit(vmap(jacfwd))"]["calls_s"] = [1.5, 0.3, 0.3, 0.3, 0.3]
    case["rounds"][1]["batchjac"]["calls_s"] = [1.0, 0.3, 0.1, 0.1, 0.1, 0.1]  # median: round 0's
    s = cold.summarise(case)
    assert s["kth"] == pytest.approx({1: 1.0 / 1.5, 2: 1.2 / 1.8, 3: 1.3 / 2.1, 5: 1.5 / 2.2})
    assert s["kth_warm"] == pytest.approx({1: 0.5 / 1.5, 2: 0.6 / 1.8, 3: 0.7 / 2.1})
    lines = cold.kth_lines(cold.by_key([case]))
    fresh = next(line for line in lines if "| fresh |" in line)
    assert fresh == "| W3 | 1,000 | jax | fresh | 0.67 | 0.67 | 0.62 | 0.68 | 0.68 |"  # K=10: not reached
    slow = cold.kth(case["rounds"], "native")  # (no side of that name: nothing)
    assert slow == {}
    case["rounds"][0]["batchjac"]["calls_s"] = [3.0, 0.1, 0.1]
    assert cold.summarise(case)["kth"][1] == pytest.approx(2.0 / 1.5)  # median of 3.0 and 1.0
    assert "**1.33**" in "".join(cold.kth_lines(cold.by_key([case])))


def test_the_steady_call_column() -> None:
    """The steady call: the median of a process's calls after its first STEADY_FROM (batchjac's
    warm-cache process), against the native variant fastest there, median over rounds."""
    skip = cold.STEADY_FROM
    case = _cold("W1", 1000, "keras-jax", [0.2, 0.2], [0.1, 0.1],
                 {"B4 jit(vmap(jacrev))": [0.3, 0.3], "B4 jit(vmap(jacfwd))": [0.3, 0.3]})
    for r, rnd in enumerate(case["rounds"]):
        rnd["batchjac_warm"]["calls_s"] = [0.1] + [0.5] * (skip - 1) + [0.002 + r * 0.001] * 5
        rnd["native"]["B4 jit(vmap(jacrev))"]["calls_s"] = [0.3] + [0.004] * 20
        rnd["native"]["B4 jit(vmap(jacfwd))"]["calls_s"] = [0.3] + [0.003] * 20
    s = cold.by_key([case])[("W1", 1000, "keras-jax")]
    assert s["steady"] == pytest.approx(0.0025)  # (the slow calls before it left out)
    assert s["steady_native"] == pytest.approx(0.003)
    assert s["steady_ratio"] == pytest.approx(0.0025 / 0.003)
    text = "\n".join(cold.section([case]))
    assert "| 2.5 ms / 3 ms: 0.83 |" in text
