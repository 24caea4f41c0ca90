"""Each private or version-specific use of JAX (``batchjac._backends.jax.compat``; the engine
review's census #22-32) removed or renamed, as a JAX release might: batchjac is slower (no
estimate, the generic rule, no disk cache, the value probe) and still right, against closed
forms in float64, never wrong and never a ModelError.

The models are one tanh layer (with a square term where a jaxpr parameter must be read), whose
Jacobians, Hessians and Laplacians are written out below.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import batchjac  # noqa: E402
from batchjac import UnwatchedValuesWarning, _backends  # noqa: E402
from batchjac._backends.jax import (  # noqa: E402
    JaxSecondKernel,
    compat,
    cost as jax_cost,
    executables as jax_executables,
    rows as jax_rows,
    staleness,
)

from .helpers import all_compiled, race_now  # noqa: E402

K, HID, OUT = 3, 5, 2
_r = np.random.default_rng(3434)
W = (_r.normal(size=(K, HID)) * 0.6).astype(np.float32)
V = _r.normal(size=(HID, OUT)).astype(np.float32)
RTOL, ATOL = 2e-4, 2e-5
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU options")


def inputs(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, K)).astype(np.float32)


def model(square: bool = False) -> Any:
    """``tanh(x W) V`` (+ ``sum_k x_k^2`` on every output): a new function object each time,
    so that each test binds its own model."""
    w, v = W.copy(), V.copy()  # (numpy copies: another model each, not a twin, see _twins)

    def f(x: Any) -> Any:
        y = jnp.tanh(x @ w) @ v
        return y + jnp.sum(x ** 2, axis=-1, keepdims=True) if square else y

    return f


def closed_forms(x: np.ndarray, square: bool = False) -> dict[str, np.ndarray]:
    """The Jacobian (N, OUT, K), Hessian (N, OUT, K, K) and Laplacian (N, OUT), float64."""
    w, v, x = W.astype(np.float64), V.astype(np.float64), x.astype(np.float64)
    t = np.tanh(x @ w)
    d1, d2 = 1 - t * t, -2 * t * (1 - t * t)
    jac = np.einsum("ho,nh,kh->nok", v, d1, w)
    hes = np.einsum("ho,nh,kh,lh->nokl", v, d2, w, w)
    if square:
        jac = jac + 2 * x[:, None, :]
        hes = hes + 2 * np.eye(K)
    return {"jacobian": jac, "hessian": hes, "laplacian": np.trace(hes, axis1=-2, axis2=-1)}


def close(got: Any, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)


def bound_of(f: Any) -> Any:
    (bound,) = _backends._bound[f].values()
    return bound


def laplacian_note(f: Any, x: np.ndarray, **options: Any) -> tuple[np.ndarray, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        lap = batchjac.laplacian(f, x, backend="jax", explain=True, **options)
    notes = [line for line in err.getvalue().splitlines() if "kernel:" in line]
    assert notes, err.getvalue()
    return np.asarray(lap), notes[-1]


def renamed(hook: str, error: type[Exception]) -> Any:
    """A stand-in for ``compat.<hook>`` that raises what a renamed internal raises."""
    def raising(*args: Any, **kwargs: Any) -> Any:
        raise error(f"{hook} renamed in this JAX")
    return raising


# ---- #22-23: XLA's option names ------------------------------------------------------------


def test_xla_accepts_tells_the_options_this_xla_knows() -> None:
    """What the tests of the builds ask before testing one (tests/test_backend_jax.py)."""
    assert compat.xla_accepts({})
    assert compat.xla_accepts({compat.OPTIMIZATION_LEVEL: "0"})  # (every XLA batchjac supports)
    assert not compat.xla_accepts({"xla_no_such_option_here": True})
    assert not compat.xla_accepts({compat.OPTIMIZATION_LEVEL: "0", "xla_no_such_option_here": True})


def test_steady_builds_take_the_cpu_options_on_the_cpu_only() -> None:
    cpu, gpu = compat.builds("cpu"), compat.builds("gpu")
    assert gpu is compat.BUILDS  # (level 1 would lower a GPU's optimisation too)
    assert cpu["default"] == compat.CPU_STEADY
    assert cpu["no-ynnpack"] == {**compat.BUILDS["no-ynnpack"], **compat.CPU_STEADY}
    assert cpu["quick"] == compat.BUILDS["quick"]
    assert compat.xla_accepts(compat.CPU_STEADY) or not compat.xla_accepts(compat.BUILDS["quick"])


@cpu_only
def test_steady_cpu_options_xla_refuses_compile_its_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that renamed the steady builds' CPU options: the first build, a fixed
    "default" and a fixed "no-ynnpack" each compile (XLA's defaults), with the same numbers."""
    monkeypatch.setattr(compat, "CPU_STEADY", {"xla_renamed_emitters_option": False})
    x = inputs(40)
    want = closed_forms(x)["jacobian"]
    f = model()
    close(batchjac.jacobian(f, x, mode="forward", chunk_size=40), want)
    for variant in ("default", "no-ynnpack"):
        fixed = bound_of(f).kernel("forward", 7, False, variant=variant)
        _, jac = fixed(x[:7], ())
        close(jac, want[:7])


@cpu_only
def test_first_order_builds_whose_options_xla_refuses_compile_its_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that renamed the options of the "no-ynnpack" and "quick" builds: the first
    call's quick build, a race and a build fixed by a store each compile XLA's defaults."""
    monkeypatch.setitem(compat.BUILDS, "no-ynnpack", {"xla_cpu_renamed_ynn_option": ""})
    monkeypatch.setitem(compat.BUILDS, "quick", {"xla_renamed_optimization_level": "0"})
    x = inputs(40)
    want = closed_forms(x)["jacobian"]
    f = model()
    close(batchjac.jacobian(f, x, mode="forward", chunk_size=40), want)  # "quick" first
    kernel = bound_of(f).kernel("forward", 40, False)
    assert set(kernel._compiled) == {"default"}
    with monkeypatch.context() as patch:
        race_now(patch)
        close(batchjac.jacobian(f, x, mode="forward", chunk_size=40), want)
        close(batchjac.jacobian(f, x, mode="forward", chunk_size=40), want)
    assert "no-ynnpack" not in kernel.variants  # the race left the refused build out
    assert kernel.variant == "default"
    # a store that recorded "no-ynnpack" with a JAX that knew the option
    fixed = bound_of(f).kernel("forward", 7, False, variant="no-ynnpack")
    _, jac = fixed(x[:7], ())
    close(jac, want[:7])
    assert fixed.variant == "no-ynnpack"
    assert "no-ynnpack" in fixed._compiled


@cpu_only
def test_second_order_options_xla_refuses_give_its_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fusion-emitter and YNNPACK option names renamed: the second-order kernels compile
    with XLA's defaults, the same Laplacians and Hessians."""
    monkeypatch.setattr(compat, "YNN_FUSION_TYPE", "xla_cpu_renamed_ynn_option")
    monkeypatch.delitem(compat.SECOND_CPU_OPTIONS, compat.FUSION_EMITTERS)
    monkeypatch.setitem(compat.SECOND_CPU_OPTIONS, "xla_cpu_renamed_emitters", False)
    assert JaxSecondKernel.CPU_OPTIONS == {"xla_cpu_renamed_emitters": False}
    x = inputs(30, seed=1)
    want = closed_forms(x)
    f = model()
    lap, note = laplacian_note(f, x, mode="forward-over-forward")
    close(lap, want["laplacian"])
    assert "one pass" in note, note
    close(batchjac.hessian(f, x, backend="jax", mode="forward-over-forward"), want["hessian"])
    close(batchjac.hessian(f, x, backend="jax", mode="forward-over-reverse"), want["hessian"])


# ---- #24: the executables on disk ----------------------------------------------------------


def _written() -> list[Path]:
    return list(Path(os.environ["BATCHJAC_CACHE_DIR"]).rglob("*.bin"))


def _write_then_load(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, np.ndarray]:
    """A first model's kernels written to disk, then a new function of the same code bound:
    ``(its bound model, its Jacobians)``."""
    jax_executables.flush()  # (what earlier tests compiled is written into their directories)
    monkeypatch.setattr(jax_executables, "MIN_COMPILE_SECONDS", 0.0)
    monkeypatch.setattr(jax_executables, "_SEEN", set())
    x = inputs(20, seed=2)
    want = closed_forms(x)["jacobian"]
    close(batchjac.jacobian(model(), x, mode="reverse"), want)
    jax_executables.compiled_beside()  # (the steady build compiled beside the quick first one)
    jax_executables.flush()
    monkeypatch.setattr(jax_executables, "_SEEN", set())
    again = model()
    jac = batchjac.jacobian(again, x, mode="reverse")
    close(jac, want)
    jax_executables.compiled_beside()
    jax_executables.flush()
    return bound_of(again), jac


def test_a_module_text_without_debug_info_keeps_the_disk_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """JAX 0.4.30's ``Lowered.as_text`` takes no ``debug_info``: its text without the keyword
    keys the executables, which a later kernel of the same code loads."""
    real = jax.stages.Lowered.as_text

    def as_text(self: Any, dialect: str | None = None) -> str:
        return real(self, dialect)  # type: ignore[no-any-return]

    monkeypatch.setattr(jax.stages.Lowered, "as_text", as_text)
    bound, _ = _write_then_load(monkeypatch)
    assert _written()
    assert bound.compile_count == 0


def test_no_module_text_means_no_disk_cache_and_right_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "module_text", lambda lowered: None)
    bound, _ = _write_then_load(monkeypatch)
    assert not _written()
    assert all_compiled(bound)


def test_a_jax_without_the_serializer_compiles_every_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``jax.experimental.serialize_executable`` gone (its import fails): nothing is written,
    and an executable an earlier JAX wrote is not loaded (it was imported outside any guard:
    the call failed)."""
    jax_executables.flush()
    monkeypatch.setattr(jax_executables, "MIN_COMPILE_SECONDS", 0.0)
    monkeypatch.setattr(jax_executables, "_SEEN", set())
    x = inputs(20, seed=3)
    want = closed_forms(x)["jacobian"]
    close(batchjac.jacobian(model(), x, mode="reverse"), want)
    jax_executables.compiled_beside()  # (the steady build compiled beside the quick first one)
    jax_executables.flush()
    assert _written()  # by a JAX with the serializer
    import jax.experimental

    monkeypatch.delattr(jax.experimental, "serialize_executable", raising=False)
    monkeypatch.setitem(sys.modules, "jax.experimental.serialize_executable", None)
    assert compat.serializer() is None
    monkeypatch.setattr(jax_executables, "_SEEN", set())
    again = model()
    close(batchjac.jacobian(again, x, mode="reverse"), want)
    jax_executables.compiled_beside()
    assert all_compiled(bound_of(again))
    jax_executables.flush()


def test_pickles_of_unknown_classes_are_neither_written_nor_loaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A JAX whose executables pickle other classes than :data:`compat.EXECUTABLE_CLASSES`."""
    monkeypatch.setattr(compat, "EXECUTABLE_CLASSES", frozenset())
    bound, _ = _write_then_load(monkeypatch)
    assert not _written()
    assert all_compiled(bound)


def test_the_version_guards_of_the_disk_cache_read_old_and_broken_objects() -> None:
    class Old:  # JAX 0.4.30's Lowered
        def as_text(self, dialect: str | None = None) -> str:
            return "module @old"

    class Broken:
        def as_text(self, *args: Any, **kwargs: Any) -> str:
            raise RuntimeError("no text form")

    assert compat.module_text(Old()) == "module @old"
    assert compat.module_text(Broken()) is None
    assert compat.trees(Broken()) is None
    assert compat.deserialize(b"not an executable", Broken()) is None
    assert compat.serialize(object()) is None


# ---- #25-26: the memory analysis, jax.jit(f).trace -----------------------------------------


@cpu_only
def test_no_memory_analysis_means_no_blocks_and_right_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compat.temp_bytes(object()) is None  # a compiled executable without the analysis
    monkeypatch.setattr(compat, "temp_bytes", lambda compiled: None)
    race_now(monkeypatch)
    x = inputs(300, seed=4)
    want = closed_forms(x)["jacobian"]
    f = model()
    for _ in range(3):
        close(batchjac.jacobian(f, x, mode="forward", chunk_size=300), want)
    kernel = bound_of(f).kernel("forward", 300, False)
    assert kernel.variants
    assert not [v for v in kernel.variants if "/" in v]  # no blocks
    assert kernel.variant in kernel.variants


@cpu_only
def test_a_jit_without_trace_lowers_directly_with_no_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """``jax.jit(f).trace`` missing: lowered directly, no jaxpr to count, the default build
    first (not the quick one a small chunk takes)."""
    monkeypatch.setattr(compat, "_TRACE", "trace_renamed")
    x = inputs(40, seed=5)
    f = model()
    close(batchjac.jacobian(f, x, mode="forward", chunk_size=40), closed_forms(x)["jacobian"])
    kernel = bound_of(f).kernel("forward", 40, False)
    assert kernel._jaxpr is None
    assert kernel.work is None
    assert set(kernel._compiled) == {"default"}


# ---- #27, #31: x64 in a thread, jit inlined ------------------------------------------------


def test_enable_x64_in_either_home_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """``jax.enable_x64`` (JAX >= 0.7) or ``jax.experimental.enable_x64`` (older); with
    neither, no per-thread mode exists to carry over, and nothing is done."""
    with compat.enable_x64(True):
        assert jnp.zeros(1, jnp.float64).dtype == np.float64
    monkeypatch.setattr(compat, "_X64_HOMES", (("jax", "enable_x64_renamed"),
                                               ("jax.no_such_module", "enable_x64")))
    assert isinstance(compat.enable_x64(True), contextlib.nullcontext)
    x = inputs(25, seed=6)  # the probes' thread computes with the process's setting
    close(batchjac.jacobian(model(), x), closed_forms(x)["jacobian"])
    x64_home = next(home for home in (("jax", "enable_x64"), ("jax.experimental", "enable_x64"))
                    if _has(*home))
    monkeypatch.setattr(compat, "_X64_HOMES", (("jax", "enable_x64_renamed"), x64_home))
    with compat.enable_x64(True):
        assert jnp.zeros(1, jnp.float64).dtype == np.float64


def _has(module: str, name: str) -> bool:
    import importlib

    return hasattr(importlib.import_module(module), name)


def test_no_disable_jit_still_pushes_the_forward_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_DISABLE_JIT", "disable_jit_renamed")
    x = inputs(20, seed=7)
    want = closed_forms(x, square=True)
    f = model(square=True)
    lap, note = laplacian_note(f, x, mode="forward-over-forward")
    close(lap, want["laplacian"])
    assert "one pass" in note, note
    close(batchjac.hessian(f, x, backend="jax", mode="forward-over-forward"), want["hessian"])


# ---- #28-30: jaxpr primitive names and parameters ------------------------------------------

HOOKS = [("param", KeyError), ("maybe_param", KeyError), ("primitive", AttributeError),
         ("sub_jaxprs", KeyError), ("is_literal", AttributeError), ("bind", TypeError)]


@pytest.mark.parametrize(("hook", "error"), HOOKS)
def test_a_jaxpr_this_jax_writes_otherwise_is_read_as_cannot_tell(
        hook: str, error: type[Exception], monkeypatch: pytest.MonkeyPatch) -> None:
    """A renamed parameter (or a changed equation) in the jaxpr: the cost estimate is none (it
    raised inside the handler of model failures: every JAX first call on the CPU was a
    ModelError), the rows are "cannot tell" (the probes run with values), and the forward
    rules give way to ``jvp`` of ``jvp``; every number right."""
    monkeypatch.setattr(compat, hook, renamed(hook, error))
    x = inputs(30, seed=8)
    want = closed_forms(x, square=True)
    closed = jax.make_jaxpr(model(square=True))(x)
    apart = jax_rows.rows_apart(closed, [True])  # (never raises)
    counted, peak = jax_cost.work(closed), jax_cost.peak_row_bytes(closed, 30)
    if hook in ("param", "primitive"):
        assert not apart
        assert counted is None
    if hook in ("sub_jaxprs", "is_literal"):
        assert peak is None
    f = model(square=True)
    close(batchjac.jacobian(f, x, mode="forward"), want["jacobian"])
    close(batchjac.jacobian(f, x, mode="reverse"), want["jacobian"])
    lap, note = laplacian_note(f, x, mode="forward-over-forward")
    close(lap, want["laplacian"])
    if hook in ("param", "primitive", "is_literal", "bind"):
        assert "jvp of jvp" in note, note
        assert "no forward-Laplacian rule" in note, note
    for mode in ("forward-over-forward", "forward-over-reverse"):
        close(batchjac.hessian(f, x, backend="jax", mode=mode), want["hessian"])


def test_renamed_parameters_count_no_work_and_the_first_call_takes_the_default_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Census #29: ``jax_cost.work`` runs where a model's failure is reported; a KeyError
    there read as both modes failing. Now no estimate: the default build, the right numbers."""
    monkeypatch.setattr(compat, "param", renamed("param", KeyError))
    x = inputs(40, seed=9)
    f = model(square=True)
    close(batchjac.jacobian(f, x, mode="forward", chunk_size=40),
          closed_forms(x, square=True)["jacobian"])
    kernel = bound_of(f).kernel("forward", 40, False)
    assert kernel.work is None
    assert set(kernel._compiled) == {"default"}


def test_rows_that_interact_are_still_caught_when_the_jaxpr_cannot_be_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Census #28: "cannot tell" sends the model to the value probes, which see the batch
    statistic: the same error as with the jaxpr read."""
    monkeypatch.setattr(compat, "param", renamed("param", KeyError))
    x = inputs(20, seed=10)
    with pytest.raises(batchjac.ModelError, match="rows of a batch interact"):
        batchjac.jacobian(lambda v: jnp.tanh(v - v.mean(axis=0)), x)


# ---- JAX's refusal of forward mode through a custom_vjp ------------------------------------


def test_a_reworded_refusal_of_forward_mode_is_still_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where JAX words its refusal otherwise, it is recognised by what JAX raises for a tiny
    custom_vjp function now: forward over forward says why it cannot, and auto computes the
    true Hessian (forward over reverse)."""
    monkeypatch.setattr(compat, "NO_FORWARD_RULE", (("words of another release",),))

    @jax.custom_vjp
    def cube(x: Any) -> Any:
        return x ** 3

    cube.defvjp(lambda x: (x ** 3, x), lambda x, g: (3 * x ** 2 * g,))
    x = inputs(12, seed=11)[:, :2]
    want = np.zeros((12, 2, 2, 2))
    for o in range(2):
        want[:, o, o, o] = 6 * x[:, o].astype(np.float64)
    close(batchjac.hessian(lambda v: cube(v), x, backend="jax", mode="auto"), want)
    with pytest.raises(batchjac.ModelError, match=r"forward-over-forward.*custom_vjp"):
        batchjac.hessian(lambda v: cube(v), x, backend="jax", mode="forward-over-forward")


def test_the_refusal_is_found_behind_older_jaxs_traceback_filtering() -> None:
    """JAX before 0.5 chains its ``SimplifiedTraceback`` between the model's call failing and
    the refusal: the refusal is read behind it (there, auto failed with "Calling the model
    failed" instead of computing forward over reverse)."""
    class SimplifiedTraceback(Exception):
        pass

    refusal = TypeError("can't apply forward-mode autodiff (jvp) to a custom_vjp function.")
    wrapper = SimplifiedTraceback("the stack trace below excludes JAX-internal frames")
    wrapper.__cause__ = refusal
    assert compat.unwrapped(wrapper) is refusal
    assert compat.unwrapped(refusal) is refusal
    assert compat.unwrapped(None) is None
    assert compat.no_forward_rule(refusal)


# ---- #32: the walk of captured values ------------------------------------------------------


def test_a_walk_of_captured_values_that_fails_warns_and_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Census #32: the walk that finds the values a trace bakes in reads Python's code and
    closure objects. Where it cannot (here reading what a function reads fails), what it
    could not read is unwatched, as past its limits: one UnwatchedValuesWarning, right numbers."""
    monkeypatch.setattr(staleness, "reads", renamed("reads", AttributeError))  # (_closures.reads)
    x = inputs(20, seed=12)
    with pytest.warns(UnwatchedValuesWarning, match="could not read"):
        got = batchjac.jacobian(model(), x)
    close(got, closed_forms(x)["jacobian"])


def test_sites_that_cannot_be_read_again_are_walked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    x = inputs(20, seed=13)
    f = model()
    want = closed_forms(x)["jacobian"]
    close(batchjac.jacobian(f, x), want)
    monkeypatch.setattr(staleness._Sites, "_unchanged", renamed("_unchanged", RuntimeError))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(batchjac.jacobian(f, x), want)


# ---- numpy 1's arithmetic on a literal ---------------------------------------------------------


def test_a_float32_power_stays_float32_under_x64() -> None:
    """``x ** 2.5``'s rule computed with the literal's value: numpy 1 (JAX 0.4.30 to 0.7 allow
    it) turns ``float32 value - 1`` into float64, which under x64 made a float32 model's
    Laplacians, diagonals and Hessians float64."""
    x = inputs(10, seed=14)
    x = np.abs(x) + 0.5
    want_lap = (2.5 * 1.5 * x.astype(np.float64) ** 0.5).sum(-1, keepdims=True)
    f = jax.vmap(lambda z: jnp.sum(z ** 2.5, keepdims=True))
    with _x64():
        for kind in ("laplacian", "hessian"):
            got = np.asarray(getattr(batchjac, kind)(f, x, backend="jax",
                                                    mode="forward-over-forward"))
            assert got.dtype == np.float32, kind
            if kind == "laplacian":
                close(got, want_lap)


def _x64() -> contextlib.AbstractContextManager[Any]:
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pragma: no cover - older jax

    return enable_x64()  # pragma: no cover


def test_trace_values_are_told_without_jax_core_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``jax.core.Tracer`` gone: a trace's values are still told from concrete arrays (by
    their type's name), so a differentiable call inside ``jit`` reads no tracer's numbers."""
    seen: dict[str, bool] = {}

    def f(x: Any) -> Any:
        seen["inside"] = compat.is_tracer(x)
        return x * 2

    monkeypatch.delattr(jax.core, "Tracer")
    jax.jit(f)(jnp.ones(3))
    assert seen["inside"]
    assert not compat.is_tracer(jnp.ones(3))


def test_builds_beside_the_calls_are_traced_there_only_as_the_calling_thread_would(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The race of modes makes the other kernel, and a race of builds its contenders, on the
    thread beside the calls; they are traced there only where that thread traces as the
    calling one would (``compat.trace_settings``). Under the calling thread's own x64 context
    every trace is the calling thread's, and float64 stays float64; where this JAX cannot
    say, the same. Without such a context the thread beside traces them."""
    import threading

    from batchjac._backends._base import idle_core, made_beside
    from batchjac._backends.jax.builds import JaxKernel

    if not idle_core():
        pytest.skip("one core: nothing is made beside the calls")
    race_now(monkeypatch)
    traced_on: list[str] = []
    lowering = JaxKernel._lowering

    def recorded(self: Any, *a: Any, **k: Any) -> Any:
        traced_on.append(threading.current_thread().name)
        return lowering(self, *a, **k)

    monkeypatch.setattr(JaxKernel, "_lowering", recorded)
    x = inputs(40, seed=11).astype(np.float64)
    want = closed_forms(x)["jacobian"]
    for settings, x64 in ((compat.trace_settings, True), (lambda: None, True),
                          (compat.trace_settings, False)):
        monkeypatch.setattr(compat, "trace_settings", settings)
        f = model()
        traced_on.clear()
        with compat.enable_x64(True) if x64 else contextlib.nullcontext():
            for _ in range(10):
                got = batchjac.jacobian(f, x if x64 else x.astype(np.float32))
                made_beside(30)
                if x64:
                    assert got.dtype == np.float64
                    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
                else:
                    close(got, want)
        assert bound_of(f).tuned  # (the modes raced)
        beside = [name for name in traced_on if name.startswith("batchjac-tier-up")]
        assert bool(beside) == (not x64), traced_on
