"""Chunks cut to the CPU's cache by the cost model (``batchjac._plan.fit_cache``), from the
working set of a row read from the trace that told JAX's output shape (``jax_cost.peak_row_bytes``),
and the quick first build weighed against all the chunks of a call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchjac import _config, _plan
from batchjac._plan import Plan, fit_cache

from .helpers import assert_jac_close


def _plan_of(n: int, size: int) -> Plan:
    return Plan(mode="reverse", chunk_size=size, n_chunks=-(-n // size),
                reason="reverse mode (why); chunks of 2000 rows (all 2000 rows fit)")


# -- the planner's rule, on numbers ------------------------------------------------------------

def test_temporaries_beyond_the_cache_cut_the_chunk_into_balanced_cache_sized_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_plan, "cache_bytes", lambda: 32 << 20)
    # W4's numbers: 43 KB a row for one tangent, 10 backward passes, 31 KB of Jacobians a row
    plan = fit_cache(_plan_of(2000, 2000), 2000, row_bytes=43264.0, passes=10,
                     result_row_bytes=31360)
    temp = _plan.PASS_FACTOR * 10 * 43264.0
    assert plan.chunk_size <= (32 << 20) / temp
    assert plan.chunk_size * plan.n_chunks >= 2000 > plan.chunk_size * (plan.n_chunks - 1)
    # balanced: the last chunk is not mostly padding
    assert plan.chunk_size * plan.n_chunks - 2000 < plan.chunk_size / 2
    assert "32 MB cache" in plan.reason
    assert "324 KB a row" in plan.reason
    assert plan.reason.startswith("reverse mode (why); chunks of")
    assert plan.reason.count("chunks of") == 1
    # the chunk is the same for every N above it (one compiled shape serves them, padded)
    again = fit_cache(_plan_of(5000, 5000), 5000, row_bytes=43264.0, passes=10,
                      result_row_bytes=31360)
    assert abs(again.chunk_size - plan.chunk_size) <= plan.chunk_size // 10


@pytest.mark.parametrize(("row_bytes", "passes", "result", "size"), [
    (None, 10, 80, 2000),  # no estimate (TensorFlow, PyTorch, a GPU)
    (4096.0, 10, 31360, 2000),  # W2: temporaries about the size of the results
    (1024.0, 5, 80, 1000),  # W1 at 1,000 rows: 3.8 MB, within the cache
    (1e9, 1, 8, 64),  # already at the smallest chunk
])
def test_the_plan_stays_where_cutting_would_not_pay(monkeypatch: pytest.MonkeyPatch,
                                                    row_bytes: float | None, passes: int,
                                                    result: int, size: int) -> None:
    monkeypatch.setattr(_plan, "cache_bytes", lambda: 32 << 20)
    plan = _plan_of(size, size)
    assert fit_cache(plan, size, row_bytes=row_bytes, passes=passes, result_row_bytes=result) is plan


def test_the_smallest_chunk_is_kept_for_huge_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_plan, "cache_bytes", lambda: 1 << 20)
    plan = fit_cache(_plan_of(10_000, 10_000), 10_000, row_bytes=1e6, passes=4,
                     result_row_bytes=16)
    assert plan.chunk_size == _plan.MIN_CACHE_ROWS
    assert plan.n_chunks == -(-10_000 // _plan.MIN_CACHE_ROWS)


def test_the_cache_size_is_the_machines_last_level_capped_or_the_fallback(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import glob

    for level, size in ((1, "48K"), (2, "2048K"), (3, "16384K")):
        d = tmp_path / f"index{level}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    (tmp_path / "index9").mkdir()  # unreadable entries are skipped
    real = glob.glob
    monkeypatch.setattr(glob, "glob", lambda pattern: sorted(map(str, tmp_path.iterdir()))
                        if "cpu0/cache" in pattern else real(pattern))
    _config.cache_bytes.cache_clear()
    try:
        assert _config.cache_bytes() == 16384 * 1024
        # a virtual machine's share of a large shared L3 (105 MB on 2 cores): capped
        (tmp_path / "index3" / "size").write_text("107520K\n")
        _config.cache_bytes.cache_clear()
        assert _config.cache_bytes() == _config.CACHE_CAP == 32 << 20
        monkeypatch.setattr(glob, "glob", lambda pattern: [])
        _config.cache_bytes.cache_clear()
        assert _config.cache_bytes() == _config.CACHE_FALLBACK
    finally:
        _config.cache_bytes.cache_clear()


# -- JAX: the estimate, and the chunks it gives ------------------------------------------------

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def test_the_peak_of_a_jaxpr_counts_live_batch_arrays_and_not_the_weights() -> None:
    from batchjac._backends.jax import cost as jax_cost

    n = 24
    # sin's result and the product live together once; the sum replaces the product
    chain = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0 + 1.0)(np.ones((5, n), np.float32))
    assert jax_cost.peak_row_bytes(chain, 5) == 2 * n * 4
    # a 64x64 weight matrix is not a row's: the same per row at 4 and at 16 rows
    w = np.random.default_rng(3).normal(size=(n, 64)).astype(np.float32)
    v = np.random.default_rng(4).normal(size=(64, 64)).astype(np.float32)

    def mlp(x: Any) -> Any:
        return jnp.tanh(jnp.tanh(x @ w) @ v)

    per_row = [jax_cost.peak_row_bytes(jax.make_jaxpr(mlp)(np.ones((r, n), np.float32)), r)
               for r in (4, 16)]
    assert per_row[0] == per_row[1] == 2 * 64 * 4
    # nested jaxprs (a jitted inner function) count at their own peak
    inner = jax.jit(lambda x: jnp.exp(x) * jnp.cos(x))
    nested = jax.make_jaxpr(lambda x: inner(x) + 1.0)(np.ones((5, n), np.float32))
    assert jax_cost.peak_row_bytes(nested, 5) >= 2 * n * 4
    # no batch-sized array: no estimate
    assert jax_cost.peak_row_bytes(jax.make_jaxpr(lambda x: x.sum())(np.ones((5, n))), 7) is None


def test_the_estimate_bounds_xlas_own_temporaries() -> None:
    """Against XLA's buffer assignment of the Jacobian kernel (``memory_analysis``): the
    planner's estimate (one tangent's peak, :data:`PASS_FACTOR` a pass) is above it and
    within 3x of it, for an MLP and a convolution."""
    from batchjac._backends.jax import cost as jax_cost
    from batchjac.examples import workload_inputs, workload_model

    for workload, rows in (("W1", 64), ("W4", 16)):
        model = workload_model(workload, "jax")
        unknown, known = workload_inputs(workload, rows, seed=5)

        def batch(u: Any, model: Any = model, known: Any = known) -> Any:
            return model(u if known is None else jnp.concatenate([u, known], axis=-1))

        tangent = jax.make_jaxpr(lambda u, t, batch: jax.jvp(batch, (u,), (t,)),
                                 static_argnums=2)(unknown, unknown, batch)
        one_row = jax_cost.peak_row_bytes(tangent, rows)
        assert one_row is not None
        m = 4 if workload == "W1" else 10

        def one(u: Any, h: Any, model: Any = model) -> Any:
            x = u if h is None else jnp.concatenate([u, h], axis=-1)
            return model(x[None])[0]

        jac = jax.jit(jax.vmap(jax.jacrev(one), in_axes=(0, None if known is None else 0)))
        temp = jac.trace(unknown, known).lower().compile().memory_analysis().temp_size_in_bytes
        estimate = _plan.PASS_FACTOR * m * one_row
        assert temp / rows <= estimate <= 3 * temp / rows, workload


def test_a_model_with_large_temporaries_computes_in_cache_sized_chunks(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A convolution whose temporaries outgrow a (small, patched) cache: the first call plans
    chunks that fit it, computes the Jacobians JAX's own gives in one batch, compiles one kernel
    (the full build: its elementwise work over all the chunks is too much for the quick one),
    and the working set is written with the probes' verdict for later processes."""
    import batchjac
    from batchjac import _backends
    from batchjac._tune import policy as _tuning

    monkeypatch.setenv("BATCHJAC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_plan, "cache_bytes", lambda: 1 << 20)
    rng = np.random.default_rng(61)
    k1 = rng.normal(size=(3, 3, 1, 8)).astype(np.float32) / 3
    dense = rng.normal(size=(8 * 10 * 10, 3)).astype(np.float32) / 30

    def cnn(xp_conv: Any, x: Any) -> Any:
        h = xp_conv(x)
        return (h.reshape(h.shape[0], -1) ** 2) @ dense

    def conv(x: Any) -> Any:
        return jnp.tanh(jax.lax.conv_general_dilated(x, jnp.asarray(k1), (1, 1), "SAME",
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC")))

    def model(x: Any) -> Any:
        return cnn(conv, x)

    from batchjac._backends.jax import JaxKernel

    # a chunk's elementwise work is below this, the call's (its chunks together) above
    monkeypatch.setattr(JaxKernel, "QUICK_ELEMENTS", 2.5e6)
    images = rng.normal(size=(300, 10, 10, 1)).astype(np.float32)
    jac = batchjac.jacobian(model, images, explain=True)
    bound = next(iter(_backends._bound[model].values()))
    assert bound.row_bytes is not None
    assert bound.row_bytes > 0
    kernels = list(bound._kernels.values())
    assert len(kernels) == 1
    (kernel,) = kernels
    assert kernel.chunk_size < 300
    chunks = -(-300 // kernel.chunk_size)
    assert kernel.work.elements <= JaxKernel.QUICK_ELEMENTS < kernel.work.elements * chunks
    assert set(kernel._compiled) == {"default"}

    # the framework's own Jacobian of the whole batch at once (no chunks), row by row
    whole = jax.vmap(jax.jacrev(lambda x: model(x[None])[0]))(images)
    assert_jac_close(jac, np.asarray(whole))
    # the probes' verdict on disk holds the working set; a bound model that reads it back
    # (a later process) plans the same chunks
    from batchjac._bind import _PROBES

    _PROBES.submit(lambda: None).result()  # (the verdict's write is queued there)
    verdicts = [json.loads(p.read_text()) for p in tmp_path.rglob("*.json")]
    stored = [v for v in verdicts if "row_bytes" in json.dumps(v)]
    assert stored, verdicts
    fresh = type(bound).__new__(type(bound))
    fresh.__dict__.update(dict(bound.__dict__.items()))
    fresh.row_bytes = None
    fresh.probed = False
    assert _tuning.recall_probes(fresh, "jax")
    assert fresh.row_bytes == pytest.approx(bound.row_bytes)


def test_hessians_are_planned_in_cache_sized_chunks_too(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    """A full Hessian's kernel holds ``k (m + 1)`` passes' temporaries (forward over reverse):
    with a small (patched) cache the plan cuts its chunks, and the Hessians are JAX's own
    ``jax.hessian`` of the whole batch; an ``out=`` array or a ``chunk_size`` keeps its plan."""
    import batchjac

    monkeypatch.setenv("BATCHJAC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_plan, "cache_bytes", lambda: 1 << 20)
    assert _plan.hessian_passes("forward-over-reverse", 3, 2) == 9
    assert _plan.hessian_passes("forward-over-forward", 3, 2) == 12
    rng = np.random.default_rng(71)
    w1 = rng.normal(size=(4, 32)).astype(np.float32) / 2
    w2 = rng.normal(size=(32, 2)).astype(np.float32) / 6

    def model(x: Any) -> Any:
        return jnp.tanh(jnp.tanh(x @ w1) @ jnp.asarray(np.ones((32, 32), np.float32) / 32)) @ w2

    x = rng.normal(size=(2000, 4)).astype(np.float32)
    import contextlib
    import io

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        hess = batchjac.hessian(model, x, explain=True)
    assert "within the CPU's 1 MB cache" in said.getvalue()
    ref = jax.vmap(jax.hessian(lambda r: model(r[None])[0]))(x)
    assert_jac_close(hess, np.asarray(ref))
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        batchjac.hessian(model, x[:500], chunk_size=500, explain=True)
    assert "cache" not in said.getvalue()
