"""`batchjac bench`'s summary table, from results whose ratios are known (the full run takes
twenty minutes and `--quick` two; what they print is built here)."""

from __future__ import annotations

from typing import Any

from click.testing import CliRunner

from batchjac._bench.run import summarise, summary_rows
from batchjac.cli import cli


def result(**over: Any) -> dict[str, Any]:
    res = {
        "workload": "W1", "n": 1000, "backend": "tensorflow", "k": 5, "m": 4,
        "best_expert": "E2", "peak_rss_mb_after_batchjac": 321.0,
        "cases": [
            {"name": "batchjac", "role": "ours", "median_s": 0.020, "compile_s": 0.5,
             "max_rel_err_vs_best": 3e-7},
            {"name": "E2 xla batch_jacobian", "role": "reverse", "median_s": 0.025},
            {"name": "E3 forward", "role": "forward", "median_s": 0.004},
            {"name": "B1 eager batch_jacobian", "role": "baseline", "median_s": 0.2},
            {"name": "B0 loop", "role": "baseline", "median_s": 80.0},
        ],
    }
    res.update(over)
    return res


def test_summary_figures() -> None:
    s = summarise(result())
    assert s["t"] == 0.020
    assert s["ratio_best"] == 0.020 / 0.025  # < 1: batchjac faster than the best expert
    assert s["vs_b1"] == 0.2 / 0.020
    assert s["vs_b0"] == 80.0 / 0.020
    assert s["bound"] == 0.020 / (0.004 * (1 + 4))  # vs one forward pass per min(k, m) + 1


def test_summary_rows() -> None:
    row, failed = summary_rows([result(), result(backend="torch", error="boom: it broke")], {})
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:6] == ["W1", "1,000", "tensorflow", "20 ms", "E2: 25 ms", "**0.80**"]
    assert cells[6:8] == ["-", "-"]  # no cold run
    assert cells[8:] == ["10.0x", "4000x", "1.00", "3.0e-07", "0.50 s", "321 MB"]
    assert "failed: boom: it broke" in failed


def test_bench_help_lists_quick_and_sections() -> None:
    result_ = CliRunner().invoke(cli, ["bench", "--help"])
    assert result_.exit_code == 0
    assert "--quick" in result_.output
    assert "--skip" in result_.output
