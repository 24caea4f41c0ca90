"""The second-order bench (W6, W7, W7H, W8): its native baselines compute the right thing in
every framework (against float64 central differences of the closed-form Jacobian, no framework
involved), and its reports render from synthetic results."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from batchjac._bench import second, w8
from batchjac._bench.run import summarise
from batchjac.examples import WORKLOADS, mlp_jacobian, mlp_weights

BACKENDS = ["tensorflow", "torch", "jax"]


def _reference_hessian(base: str, unknown: np.ndarray, known: np.ndarray | None) -> np.ndarray:
    """``(N, m, k, k)``: central differences (float64) of the analytic Jacobian."""
    w = WORKLOADS[base]
    layers = mlp_weights(w.sizes)
    x = unknown.astype(np.float64) if known is None else \
        np.concatenate([unknown, known], axis=1).astype(np.float64)
    k, eps = unknown.shape[1], 1e-5
    cols = []
    for j in range(k):
        step = np.zeros_like(x)
        step[:, j] = eps
        d = (mlp_jacobian(layers, x + step) - mlp_jacobian(layers, x - step)) / (2 * eps)
        cols.append(d[:, :, :k])  # d J[:, :, :k] / d x_j
    return np.stack(cols, axis=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("workload", ["W6", "W7", "W7H"])
def test_native_baselines_compute_the_hessian_or_laplacian(workload: str, backend: str) -> None:
    pytest.importorskip(backend)
    model, unknown, known = second.model_and_inputs(workload, backend, 6)
    got = second.native(workload, backend, model)(unknown, known)
    ref = _reference_hessian(second.SECOND[workload].base, unknown, known)
    if second.SECOND[workload].kind == "laplacian":
        ref = np.trace(ref, axis1=-2, axis2=-1)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-4 * np.abs(ref).max())


def test_second_order_rows_have_no_first_order_bound() -> None:
    res = {"workload": "W6", "backend": "jax", "n": 10, "k": 5, "m": 4, "order": 2,
           "best_expert": "jit(vmap(hessian))",
           "cases": [{"name": "batchjac", "role": "batchjac", "median_s": 0.002, "compile_s": 0.1,
                      "max_rel_err_vs_best": 1e-7},
                     {"name": "jit(vmap(hessian))", "role": "expert", "median_s": 0.004,
                      "compile_s": 0.1, "max_rel_err_vs_best": 0.0},
                     {"name": "F forward", "role": "forward", "median_s": 0.0001, "compile_s": 0.0,
                      "max_rel_err_vs_best": None}],
           "peak_rss_mb_after_batchjac": 100.0}
    s = summarise(res)
    assert s["bound"] is None
    assert s["ratio_best"] == pytest.approx(0.5)


def test_w8_report_states_memory_growth_and_the_crash_test() -> None:
    rows = [{"n": 1_000_000, "seconds": 10.0, "rows_per_second": 1e5, "peak_rss_mb": 900.0,
             "store_mb": 400.0, "check": {"max_rel_err": 1e-7, "rows_checked": 500}},
            {"n": 10_000_000, "seconds": 100.0, "rows_per_second": 1e5, "peak_rss_mb": 990.0,
             "store_mb": 4000.0, "check": {"max_rel_err": 2e-7, "rows_checked": 500}}]
    md = "\n".join(w8.markdown(rows, {"killed_after_chunks": 3, "landed": True,
                                      "resume_seconds": 6.0, "identical": True}))
    assert "(1.10x for 10x the rows)" in md
    assert "SIGKILL after 3 recorded chunks" in md
    assert "**byte-identical**" in md
    bad = "\n".join(w8.markdown(rows, {"killed_after_chunks": 0, "landed": False,
                                       "resume_seconds": 6.0, "identical": False}))
    assert "mid-run: NO" in bad
    assert "**DIFFERENT**" in bad


def test_w10_report_states_ratios_and_whether_the_budget_held() -> None:
    from batchjac._bench import w10

    native = {"impl": "autograd", "first_s": 0.2, "steady_s": 0.1, "step_mb": 100.0,
              "first_mb": 120.0, "grad_err": 0.0, "rounds": 3}
    ours = {"impl": "batchjac", "first_s": 0.1, "steady_s": 0.12, "step_mb": 90.0,
            "first_mb": 100.0, "grad_err": 1e-7, "rounds": 3}
    budget = {"impl": "batchjac, max_memory", "first_s": 0.3, "steady_s": 0.2, "step_mb": 60.0,
              "first_mb": 70.0, "budget_mb": 50.0, "grad_err": 2e-7, "rounds": 3}
    md = "\n".join(w10.markdown([{"backend": "torch", "cases": [native, ours, budget],
                                  "best": "autograd"}]))
    assert "| torch | batchjac (3 processes) | 100 ms | **0.50** | 120.0 ms | **1.20** |" in md
    assert "(budget 50 MB: **OVER**)" in md
    budget["step_mb"] = 40.0
    md = "\n".join(w10.markdown([{"backend": "torch", "cases": [native, ours, budget],
                                  "best": "autograd"}]))
    assert "(budget 50 MB: **fits**)" in md


def test_w10_budget_row_is_not_run_where_no_native_step_memory_was_measured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Half of a step memory the host did not show (its allocator kept the memory) is no
    budget: the row says so instead of running thousands of kB-sized chunks."""
    from batchjac._bench import w10

    ran: list[Any] = []

    def rounds(backend: str, impls: list[str], max_memory: Any, tmp: str, log: Any) -> Any:
        ran.append(max_memory)
        return {i: {"impl": i, "first_s": 0.1, "steady_s": 0.05, "first_mb": 100.0,
                    "step_mb": 0.5, "rounds": 3} for i in impls}

    monkeypatch.setattr(w10, "_rounds", rounds)
    monkeypatch.setattr(w10, "_grad_error", lambda a, b: 0.0)
    row = w10.measure("torch", "/nonexistent")
    assert ran == [None]  # (the budgeted case never ran)
    md = "\n".join(w10.markdown([row]))
    assert "| torch | batchjac, max_memory | not run: a native steady step added 0.50 MB" in md


def test_w10_step_runs_and_matches_the_native_gradients(tmp_path: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's own step, small: batchjac's first gradients equal nested autograd's."""
    pytest.importorskip("torch")
    from batchjac._bench import w10

    monkeypatch.setattr(w10, "N", 64)
    monkeypatch.setattr(w10, "STEPS", 2)
    monkeypatch.setattr(w10, "MEMORY_STEPS", 1)
    for impl in ("autograd", "batchjac"):
        res = w10.run_step("torch", impl, None, str(tmp_path / f"{impl}.npz"))
        assert res["steady_s"] > 0
        assert res["step_mb"] >= 0
    assert w10._grad_error(str(tmp_path / "batchjac.npz"), str(tmp_path / "autograd.npz")) < 1e-4
