"""A new function object that computes what one bound before computes reuses its bound model
(no probe, trace or compilation); one that reads anything else is bound anew, so a changed
captured value never gives a stale Jacobian (:mod:`batchjac._twins`)."""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac import _backends, _twins

RNG = np.random.default_rng(20261205)
A = RNG.normal(size=(4, 3))


def _bound_count() -> int:
    """Bound models alive (a twin's function objects share one)."""
    return len({id(b) for per in _backends._bound.values() for b in per.values()})


# -- the rule, on plain functions ------------------------------------------------------------


def _make(w: Any) -> Any:
    return lambda v: v @ w


def test_same_captured_object_is_a_twin_other_objects_are_not() -> None:
    w = RNG.normal(size=(3, 2))
    assert _twins.same(_make(w), _make(w))
    assert not _twins.same(_make(w), _make(w.copy()))  # numpy: mutable, identity required
    assert not _twins.same(_make(w), _make(w + 1.0))
    assert not _twins.same(_make(w), lambda v: v @ w)  # other code


def test_defaults_partials_and_nested_functions() -> None:
    w = RNG.normal(size=(3, 2))

    def scaled(v: Any, s: float, w: Any = w) -> Any:
        return s * (v @ w)

    assert _twins.same(functools.partial(scaled, s=2.0), functools.partial(scaled, s=2.0))
    assert not _twins.same(functools.partial(scaled, s=2.0), functools.partial(scaled, s=3.0))
    assert not _twins.same(functools.partial(scaled, s=2.0), scaled)

    def outer(inner: Any) -> Any:
        return lambda v: inner(v) + 1.0

    assert _twins.same(outer(_make(w)), outer(_make(w)))  # nested twins
    assert not _twins.same(outer(_make(w)), outer(_make(w.copy())))


def test_globals_are_compared_by_value() -> None:
    code = (lambda v: v * SCALE).__code__  # noqa: F821 - read from the globals given below
    f = types.FunctionType(code, {"SCALE": 2.0})
    g = types.FunctionType(code, {"SCALE": 2.0})
    h = types.FunctionType(code, {"SCALE": 3.0})
    two = f.__globals__["SCALE"]
    g.__globals__["SCALE"] = two  # the same float object
    assert _twins.same(f, g)
    assert not _twins.same(f, h)


def test_canonical_returns_the_live_twin_and_forgets_dead_ones() -> None:
    w = RNG.normal(size=(3, 2))
    first = _make(w)
    assert _twins.canonical(first) is first
    assert _twins.canonical(_make(w)) is first
    other = _make(w.copy())
    assert _twins.canonical(other) is other
    del first
    import gc

    gc.collect()
    again = _make(w)
    assert _twins.canonical(again) is again  # the first one is gone: nothing stale is kept


# -- through the verbs -------------------------------------------------------------------------


def test_jax_fresh_closures_trace_once_and_see_a_changed_array() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    w = jnp.asarray(RNG.normal(size=(3, 4)).astype(np.float32))
    z = RNG.normal(size=(64, 3)).astype(np.float32)

    def model(arr: Any) -> Any:  # a new closure per call, capturing ``arr``
        return lambda v: jnp.sin(v @ arr)

    def ref(wn: Any) -> np.ndarray:
        wn = np.asarray(wn, dtype=np.float64)
        d = np.cos(z.astype(np.float64) @ wn)
        return d[:, :, None] * wn.T[None]

    before = _bound_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error", batchjac.RebindWarning)
        got = [batchjac.jacobian(model(w), z) for _ in range(6)]
    for g in got:
        np.testing.assert_allclose(g, ref(w), rtol=2e-4, atol=2e-5)
    assert _bound_count() == before + 1  # one model bound for six function objects
    # an equal array of another identity (JAX arrays cannot change): still the same model
    np.testing.assert_allclose(batchjac.jacobian(model(jnp.asarray(np.asarray(w))), z), ref(w),
                               rtol=2e-4, atol=2e-5)
    assert _bound_count() == before + 1
    # another array: another model, traced anew, and its own Jacobians
    w_new = w * 2.0
    np.testing.assert_allclose(batchjac.jacobian(model(w_new), z), ref(w_new), rtol=2e-4,
                               atol=2e-5)
    assert _bound_count() == before + 2


def test_jax_fresh_closures_do_not_retrace() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    w = jnp.asarray(RNG.normal(size=(3, 4)).astype(np.float32))
    z = RNG.normal(size=(32, 3)).astype(np.float32)
    fns = [(lambda v: jnp.tanh(v @ w)) for _ in range(5)]  # one code, five objects
    batchjac.jacobian(fns[0], z)
    from batchjac._backends.jax import executables as jax_executables

    jax_executables.compiled_beside()  # (the steady build, beside the first one's quick build)
    (bound,) = _backends._bound[fns[0]].values()
    traces, compiles = bound.trace_count, bound.compile_count
    for fn in fns[1:]:
        batchjac.jacobian(fn, z)
    assert bound.trace_count == traces
    assert bound.compile_count == compiles
    assert _backends._bound[fns[1]] is _backends._bound[fns[0]]  # the first one's bound models


def test_numpy_capture_changed_in_place_is_seen_through_a_twin() -> None:
    """A twin shares the captured numpy array itself: a change in place after the first call
    is seen as for one function object called twice (never the first weights' Jacobians)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    w = RNG.normal(size=(3, 4)).astype(np.float32)
    z = RNG.normal(size=(16, 3)).astype(np.float32)
    fns = [(lambda v: jnp.sin(v @ w)) for _ in range(2)]
    batchjac.jacobian(fns[0], z)
    w *= 3.0  # in place
    got = batchjac.jacobian(fns[1], z)
    assert _backends._bound[fns[1]] is _backends._bound[fns[0]]  # (the first one's bound model)
    d = np.cos(z.astype(np.float64) @ w.astype(np.float64))
    np.testing.assert_allclose(got, d[:, :, None] * w.astype(np.float64).T[None], rtol=2e-4,
                               atol=2e-5)


def test_torch_fresh_closures_share_the_bound_model_and_see_new_weights() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    z = RNG.normal(size=(20, 3)).astype(np.float32)

    def native() -> np.ndarray:
        f = torch.func.vmap(torch.func.jacrev(net))
        return f(torch.from_numpy(z)).detach().numpy()

    fns = [(lambda v: net(v)) for _ in range(4)]
    before = _bound_count()
    for fn in fns[:3]:
        np.testing.assert_allclose(batchjac.jacobian(fn, z), native(), rtol=1e-5, atol=1e-6)
    assert _bound_count() == before + 1
    with torch.no_grad():
        net[0].weight.mul_(-2.0)  # the module changed in place: the twin computes it anew
    np.testing.assert_allclose(batchjac.jacobian(fns[3], z), native(), rtol=1e-5, atol=1e-6)


def test_a_twin_whose_own_cell_changes_later_is_computed_anew() -> None:
    """A closure taken for a twin, whose own captured variable its scope rebinds afterwards
    (the twin's stays): the next call computes the new value, not the twin's Jacobians."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    w = jnp.asarray(RNG.normal(size=(3, 4)).astype(np.float32))
    z = RNG.normal(size=(16, 3)).astype(np.float32)

    def factory(arr: Any) -> tuple[Any, Any]:
        def f(v: Any) -> Any:
            return jnp.sin(v @ arr)

        def rebind(new: Any) -> None:
            nonlocal arr
            arr = new

        return f, rebind

    def ref(wn: Any) -> np.ndarray:
        wn = np.asarray(wn, dtype=np.float64)
        return np.cos(z.astype(np.float64) @ wn)[:, :, None] * wn.T[None]

    first, _ = factory(w)
    second, rebind = factory(w)
    batchjac.jacobian(first, z)
    np.testing.assert_allclose(batchjac.jacobian(second, z), ref(w), rtol=2e-4, atol=2e-5)
    w_new = w * -1.5
    rebind(w_new)  # only the second closure's cell
    np.testing.assert_allclose(batchjac.jacobian(second, z), ref(w_new), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(batchjac.jacobian(first, z), ref(w), rtol=2e-4, atol=2e-5)
