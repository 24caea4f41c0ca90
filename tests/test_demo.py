"""``batchjac demo`` (the original question): it runs, its Jacobians pass the independent check
it prints, and every figure it reports is there."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")


def test_demo_runs_checks_and_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchjac import _demo

    monkeypatch.setattr(_demo, "LOOP_ROWS", 10)  # the naive loop is slow by design
    monkeypatch.setattr(_demo, "SETTLE_SECONDS", 2.0)
    lines: list[str] = []
    res = _demo.main(120, out=lines.append)
    text = "\n".join(lines)
    assert res["error"] <= 1e-4  # against float64 central differences of the numpy forward pass
    assert "result: J of shape (120, 4, 5)" in text
    assert "(OK, float32 tolerance 1e-4)" in text
    assert "first call, compilation included" in text
    for label in ("batchjac.jacobian", "tape.batch_jacobian + XLA (B2)",
                  "eager tape.batch_jacobian (B1)", "loop of tape.jacobian (B0)"):
        assert label in text
    assert res["loop"] > res["batchjac"]  # the per-instance loop is what batchjac replaces
    assert all(res[k] > 0 for k in ("batchjac", "xla", "eager", "first", "first_xla"))
