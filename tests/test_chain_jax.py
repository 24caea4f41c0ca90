"""Mixed-mode accumulation in JAX (batchjac._backends.jax.chain): the chain read from a model's
jaxpr, the Jacobians accumulated through its bottleneck against jax's own pure modes and float64
finite differences, and the pure modes kept where no cut pays."""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import batchjac  # noqa: E402
from batchjac._chain import MIN_BASIS  # noqa: E402

from .helpers import assert_jac_close, central_differences, jax_x64  # noqa: E402
from .test_backend_jax import bound_of  # noqa: E402


def weights(sizes: tuple[int, ...], seed: int, dtype: Any = np.float32) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(0, 1 / np.sqrt(a), (a, b)).astype(dtype), rng.normal(0, 0.1, b).astype(dtype))
            for a, b in itertools.pairwise(sizes)]


def mlp(params: list[Any], xp: Any) -> Any:
    def f(x: Any) -> Any:
        for i, (w, b) in enumerate(params):
            x = x @ xp.asarray(w) + xp.asarray(b)
            if i < len(params) - 1:
                x = xp.tanh(x)
        return x
    return f


#: counted 2.7x fewer operations than the better pure mode: offered, raced later
BOTTLENECK = (128, 96, 2, 96, 128)
#: counted 3.3x: the pure modes not raced
SURE = (128, 128, 2, 128, 128)


def jax_reference(f: Any, x: np.ndarray) -> np.ndarray:
    """JAX's own reverse mode, row by row, of a batch function."""
    return np.asarray(jax.vmap(jax.jacrev(lambda v: f(v[None])[0]))(jnp.asarray(x)))


def test_a_bottlenecked_mlp_is_accumulated_through_its_narrow_layer(capsys: Any) -> None:
    params = weights(BOTTLENECK, seed=1)
    f = mlp(params, jnp)
    x = np.random.default_rng(2).normal(0, 1, (37, 128)).astype(np.float32)
    jac = batchjac.jacobian(f, x, explain=True)
    err = capsys.readouterr().err
    assert "mixed mode: reverse from the unknowns to the 2 values after tanh (2 backward " \
           "passes), then forward from the 2 values after tanh to the outputs (2 tangents)" in err
    assert "operations a row against forward" in err
    assert "the pure builds race it once the work repays it" in err
    assert re.search(r"computed 37 rows in [0-9.e-]+ s", err)
    kernel = next(iter(bound_of(f)._kernels.values()))
    assert kernel.variant == "mixed"
    assert_jac_close(jac, jax_reference(f, x))
    with jax_x64():  # float64 central differences of a float64 copy
        ref = central_differences(mlp(weights(BOTTLENECK, seed=1, dtype=np.float64), np),
                                  x.astype(np.float64))
    assert_jac_close(jac, ref)


def test_the_outputs_come_with_the_accumulated_jacobians() -> None:
    f = mlp(weights(BOTTLENECK, seed=3), jnp)
    x = np.random.default_rng(4).normal(0, 1, (9, 128)).astype(np.float32)
    y, jac = batchjac.jacobian(f, x, return_outputs=True)
    np.testing.assert_allclose(y, np.asarray(f(jnp.asarray(x))), rtol=1e-6, atol=1e-6)
    assert_jac_close(jac, jax_reference(f, x))


def test_known_inputs_branches_and_integer_values_around_the_cut() -> None:
    """The known inputs enter both pieces as constants; two branches leave the 4-wide code and
    meet again; an argmax (an integer, no derivative) picks which outputs are scaled."""
    rng = np.random.default_rng(5)
    w0 = jnp.asarray(rng.normal(0, 0.1, (128, 128)), jnp.float32)
    w1 = jnp.asarray(rng.normal(0, 0.3, (128, 2)), jnp.float32)
    wa = jnp.asarray(rng.normal(0, 0.5, (2, 128)), jnp.float32)
    wb = jnp.asarray(rng.normal(0, 0.5, (2, 128)), jnp.float32)
    wh = jnp.asarray(rng.normal(0, 0.5, (6, 128)), jnp.float32)

    def f(x: Any, h: Any) -> Any:
        code = jnp.tanh(jnp.tanh(x @ w0) @ w1)
        y = jnp.sin(code @ wa) * jnp.tanh(code @ wb) + h @ wh
        pick = jnp.argmax(code, axis=-1)
        return y * (1.0 + (pick[..., None] == jnp.arange(128) % 2))

    x = rng.normal(0, 1, (11, 128)).astype(np.float32)
    h = rng.normal(0, 1, (11, 6)).astype(np.float32)
    jac = batchjac.jacobian(f, (x, h), wrt=0)
    assert next(iter(bound_of(f)._kernels.values())).variant == "mixed"
    ref = np.asarray(jax.vmap(jax.jacrev(f))(jnp.asarray(x), jnp.asarray(h)))
    assert_jac_close(jac, ref)


def test_shaped_unknowns_and_outputs_through_a_jitted_layer() -> None:
    """An image of unknowns, outputs of two axes, the bottleneck inside a ``jax.jit``-ed
    function (as Flax and Equinox wrap their layers): the call is read through."""
    rng = np.random.default_rng(6)
    w0 = jnp.asarray(rng.normal(0, 0.1, (144, 144)), jnp.float32)
    w1 = jnp.asarray(rng.normal(0, 0.2, (144, 2)), jnp.float32)
    w2 = jnp.asarray(rng.normal(0, 0.5, (2, 128)), jnp.float32)

    @jax.jit
    def encode(x: Any) -> Any:
        return jnp.tanh(jnp.tanh(x.reshape(x.shape[0], 144) @ w0) @ w1)

    def f(x: Any) -> Any:
        return jnp.cos(encode(x) @ w2).reshape(x.shape[0], 2, 64)

    x = rng.normal(0, 1, (5, 12, 12)).astype(np.float32)
    jac = batchjac.jacobian(f, x)
    assert jac.shape == (5, 2, 64, 12, 12)
    assert next(iter(bound_of(f)._kernels.values())).variant == "mixed"
    assert_jac_close(jac, jax_reference(f, x))


def test_a_flax_module_is_read_through_its_layers() -> None:
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):  # type: ignore[misc]
        def __init__(self, rngs: Any) -> None:
            self.a = nnx.Linear(128, 128, rngs=rngs)
            self.b = nnx.Linear(128, 2, rngs=rngs)
            self.c = nnx.Linear(2, 128, rngs=rngs)
            self.d = nnx.Linear(128, 128, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.d(jnp.tanh(self.c(jnp.tanh(self.b(jnp.tanh(self.a(x)))))))

    net = Net(nnx.Rngs(0))
    x = np.random.default_rng(7).normal(0, 1, (6, 128)).astype(np.float32)
    jac = batchjac.jacobian(net, x, explain=False)
    bound = next(iter(next(iter([batchjac._backends._bound[net]])).values()))
    assert next(iter(bound._kernels.values())).variant == "mixed"
    assert_jac_close(jac, np.asarray(jax.vmap(jax.jacrev(lambda v: net(v[None])[0]))(jnp.asarray(x))))


@pytest.mark.parametrize(("sizes", "raced"), [(BOTTLENECK, True), (SURE, False)])
def test_the_pure_builds_race_the_mixed_one_where_the_count_is_unsure(sizes: Any, raced: bool
                                                                      ) -> None:
    f = mlp(weights(sizes, seed=18), jnp)
    x = np.random.default_rng(19).normal(0, 1, (6, 128)).astype(np.float32)
    batchjac.jacobian(f, x)
    kernel = next(iter(bound_of(f)._kernels.values()))
    assert kernel.variant == "mixed"
    assert kernel.variants[0] == "mixed"
    assert ("default" in kernel.variants) is raced
    assert kernel.build("mixed").stage == 0  # the one the pure builds must beat
    if raced:
        assert kernel.build("default").stage == 1
        kernel.use("default")  # a pure build, as a race would take it: the same Jacobians
        assert_jac_close(kernel(x, ())[1], jax_reference(f, x))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_mode_asked_for_is_computed_in_that_mode(mode: str) -> None:
    f = mlp(weights(BOTTLENECK, seed=8), jnp)
    x = np.random.default_rng(9).normal(0, 1, (5, 128)).astype(np.float32)
    jac = batchjac.jacobian(f, x, mode=mode)
    kernel = next(iter(bound_of(f)._kernels.values()))
    assert kernel.variant != "mixed"
    assert kernel.computes == mode
    assert_jac_close(jac, jax_reference(f, x))


def test_no_bottleneck_keeps_the_pure_mode() -> None:
    f = mlp(weights((40, 64, 64, 40), seed=10), jnp)
    x = np.random.default_rng(11).normal(0, 1, (5, 40)).astype(np.float32)
    jac = batchjac.jacobian(f, x)
    bound = bound_of(f)
    assert bound.accumulation() is None
    assert all(k.variant != "mixed" for k in bound._kernels.values())
    assert_jac_close(jac, jax_reference(f, x))


def test_a_narrow_basis_reads_no_chain() -> None:
    """Below MIN_BASIS unknowns no cut can pay for reading the chain: nothing is traced."""
    f = mlp(weights((MIN_BASIS - 1, 64, 2, 64, 40), seed=12), jnp)
    x = np.random.default_rng(13).normal(0, 1, (4, MIN_BASIS - 1)).astype(np.float32)
    batchjac.jacobian(f, x)
    assert bound_of(f).accumulation() is None


def test_chunks_into_an_array_and_a_memory_budget_give_the_same_jacobians() -> None:
    """Rows in several chunks (a small memory budget): chunks cut to the cache, each
    accumulated, into ``out=``."""
    f = mlp(weights(BOTTLENECK, seed=14), jnp)
    x = np.random.default_rng(15).normal(0, 1, (300, 128)).astype(np.float32)
    out = np.empty((300, 128, 128), np.float32)
    batchjac.jacobian(f, x, out=out, max_memory="2MB")
    kernel = next(iter(bound_of(f)._kernels.values()))
    assert kernel.variant == "mixed"
    assert kernel.chunk_size < 300
    assert_jac_close(out, jax_reference(f, x))


def test_a_store_records_the_mixed_build_and_resumes_in_it(tmp_path: Any) -> None:
    import json

    f = mlp(weights(BOTTLENECK, seed=16), jnp)
    x = np.random.default_rng(17).normal(0, 1, (40, 128)).astype(np.float32)
    path = tmp_path / "j.npy"
    first = batchjac.jacobian(f, x, out=str(path), chunk_size=16)
    manifest = json.loads((tmp_path / "j.manifest.json").read_text())
    again = batchjac.jacobian(f, x, out=str(path), chunk_size=16)
    assert first.computed_chunks == 3
    assert again.resumed_chunks == 3
    assert manifest["plan"]["variant"] == "mixed"
    assert_jac_close(np.asarray(again.open()[:]), jax_reference(f, x))


@pytest.mark.parametrize("workload", ["W1", "W2", "W3", "W4"])
def test_the_other_benchmark_workloads_read_no_chain(workload: str) -> None:
    """W1-W4 keep their pure modes: no cut narrower than min(k, m), or too narrow a basis."""
    from batchjac.examples import workload_inputs, workload_model

    model = workload_model(workload, "jax")
    unknown, known = workload_inputs(workload, 4)
    batchjac.jacobian(model, unknown, *(() if known is None else (known,)))
    bound = bound_of(model)
    assert bound.accumulation() is None
    assert all(k.variant != "mixed" for k in bound._kernels.values())
