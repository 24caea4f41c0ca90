"""Sensitivity summaries: closed forms on linear Jacobian sets, elasticities with the y ~ 0
guard, names, shapes, and bad input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchjac

from . import helpers

#: 3 outputs x 4 inputs with a clear ranking per output
W = np.array([[3.0, 0.1, 1.0, -0.5], [0.2, -2.0, 0.05, 1.2], [0.7, 0.3, 1.5, 0.01]])
N = 200


def linear_set(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Jacobians, inputs and outputs of y = x W^T + 1 (J is W for every instance)."""
    x = np.random.default_rng(seed).normal(size=(N, 4)) + 2.0
    return np.broadcast_to(W, (N, 3, 4)).copy(), x, x @ W.T + 1.0


def test_mean_abs_and_ranking_of_a_linear_model() -> None:
    jac, _, _ = linear_set()
    s = batchjac.sensitivity(jac, input_names=["a", "b", "c", "d"])
    np.testing.assert_allclose(s.mean_abs, np.abs(W))
    np.testing.assert_allclose(s.mean, W)
    assert s.elasticity is None
    assert s.scaled is None
    assert [n for n, _ in s.ranking(0)] == ["a", "c", "d", "b"]
    assert [n for n, _ in s.ranking("y1")] == ["b", "d", "a", "c"]
    np.testing.assert_array_equal(s.order(), np.argsort(-np.abs(W), axis=1))
    assert s.output_names == ("y0", "y1", "y2")
    assert "y0: a 3, c 1, d 0.5, b 0.1" in str(s)


def test_elasticities_closed_form_and_summary() -> None:
    jac, x, y = linear_set()
    e = batchjac.elasticities(jac, x, y)
    np.testing.assert_allclose(e, W[None] * x[:, None, :] / y[:, :, None])
    s = batchjac.sensitivity(jac, x, y, by="elasticity")
    assert s.elasticity is not None
    assert s.scaled is not None
    np.testing.assert_allclose(s.elasticity, np.median(e, axis=0))
    np.testing.assert_allclose(s.scaled, np.abs(W) * x.std(0)[None] / y.std(0)[:, None])
    np.testing.assert_array_equal(s.order(), np.argsort(-np.abs(np.median(e, axis=0)), axis=1))
    assert s.elasticity_undefined is not None
    assert not s.elasticity_undefined.any()


def test_elasticity_is_undefined_where_the_output_is_near_zero() -> None:
    jac = np.ones((4, 1, 2))
    x = np.ones((4, 2))
    y = np.array([[2.0], [1e-9], [4.0], [-2.0]])
    e = batchjac.elasticities(jac, x, y)
    assert np.isnan(e[1]).all()
    assert np.isfinite(e[[0, 2, 3]]).all()
    s = batchjac.sensitivity(jac, x, y)
    assert s.elasticity_undefined is not None
    assert s.elasticity_undefined.tolist() == [1]
    np.testing.assert_allclose(s.elasticity, np.median([0.5, 0.25, -0.5]))
    everywhere_zero = batchjac.sensitivity(jac, x, np.zeros((4, 1)))
    assert everywhere_zero.elasticity is not None
    assert np.isnan(everywhere_zero.elasticity).all()
    assert everywhere_zero.scaled is not None
    assert np.isnan(everywhere_zero.scaled).all()


def test_multi_axis_shapes_need_x_or_y() -> None:
    jac = np.random.default_rng(1).normal(size=(10, 2, 3, 4, 5))  # out (2, 3), unknown (4, 5)
    x = np.ones((10, 4, 5))
    s = batchjac.sensitivity(jac, x)
    assert s.mean_abs.shape == (6, 20)
    assert s.input_names[:2] == ("x[0, 0]", "x[0, 1]")
    assert s.output_names[-1] == "y[1, 2]"
    s_y = batchjac.sensitivity(jac, y=np.ones((10, 2, 3)))
    np.testing.assert_allclose(s_y.mean_abs, s.mean_abs)
    with pytest.raises(batchjac.InputError, match="pass the unknowns `x`"):
        batchjac.sensitivity(jac)


def test_memmapped_jacobians_are_read_in_chunks(tmp_path: Any) -> None:
    jac = np.random.default_rng(2).normal(size=(20_000, 2, 3))
    np.save(tmp_path / "j.npy", jac)
    s = batchjac.sensitivity(np.load(tmp_path / "j.npy", mmap_mode="r"))
    np.testing.assert_allclose(s.mean_abs, np.abs(jac).mean(0))
    assert s.n == 20_000


def test_median_uses_a_seeded_subset_beyond_the_limit() -> None:
    jac, x, y = linear_set()
    s = batchjac.sensitivity(jac, x, y, max_median_instances=50)
    assert s.elasticity is not None
    full = np.median(batchjac.elasticities(jac, x, y), 0)
    # outputs 0 and 2 stay far from 0, so 50 instances estimate their median well (y1 crosses
    # 0: its elasticities are heavy-tailed)
    assert np.all(np.abs(s.elasticity - full)[[0, 2]] < 0.05)
    again = batchjac.sensitivity(jac, x, y, max_median_instances=50)
    np.testing.assert_array_equal(again.elasticity, s.elasticity)  # seeded subset


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((np.ones((5, 3)),), {}, r"a Jacobian set is \(N, \*output_shape"),
        ((np.ones((5, 2, 3)), np.ones((5, 4))), {}, "x must be the unknowns"),
        ((np.ones((5, 2, 3)), None, np.ones((5, 3))), {}, "y must be the outputs"),
        ((np.ones((5, 2, 3)), np.ones((5, 3)), np.ones((4, 2))), {}, r"must be \(5, 2\)"),
        ((np.ones((5, 2, 3)),), {"input_names": ["a", "b"]}, "has 2 names but there are 3"),
        ((np.ones((5, 2, 3)),), {"by": "elasticity"}, "needs the inputs x and outputs y"),
        ((np.ones((5, 2, 3)),), {"by": "biggest"}, "`by` must be one of"),
        ((np.ones((0, 2, 3)),), {}, "no instances"),
        ((np.full((5, 2, 3), np.nan),), {}, "NaN or Inf entry in instance 0"),
    ],
)
def test_bad_input(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(batchjac.InputError, match=match):
        batchjac.sensitivity(*args, **kwargs)


def test_bad_queries() -> None:
    s = batchjac.sensitivity(np.ones((5, 2, 3)))
    with pytest.raises(batchjac.InputError, match="No output named 'q'"):
        s.ranking("q")
    with pytest.raises(batchjac.InputError, match="out of range"):
        s.ranking(5)
    with pytest.raises(batchjac.InputError, match="needs the inputs"):
        s.measure("scaled")
    with pytest.raises(batchjac.InputError, match="need both"):
        batchjac.elasticities(np.ones((5, 2, 3)), np.ones((5, 3)), None)


def test_from_batchjac_jacobians() -> None:
    tf = pytest.importorskip("tensorflow")
    x = np.random.default_rng(3).normal(size=(50, 4)).astype("f4")

    def model(v: Any) -> Any:
        return tf.matmul(v, tf.constant(W.T, v.dtype)) + 1.0

    y, jac = batchjac.jacobian(model, x, return_outputs=True)
    s = batchjac.sensitivity(jac, x, y, output_names=["yield", "cost", "purity"])
    np.testing.assert_allclose(s.mean_abs, np.abs(W), rtol=1e-6)
    assert s.ranking("cost")[0][0] == "x1"


@pytest.mark.parametrize("limit", [100_000, 37])
def test_a_models_summary_in_chunks_equals_the_summary_of_its_jacobians(limit: int) -> None:
    """The model's form (``batchjac report MODEL``) sums each chunk as it is computed: the same
    summary as :func:`batchjac.sensitivity` of the whole Jacobian set, over chunks of a small
    memory budget, with the median elasticity over all instances or a seeded subset."""
    pytest.importorskip("jax")
    from batchjac._examples import jax as jax_examples
    from batchjac._sensitivity import of_model

    x = np.random.default_rng().normal(size=(300, 4))
    with helpers.jax_x64():
        model = jax_examples.mlp((4, 8, 3), seed=int(np.random.default_rng().integers(1 << 20)),
                                 dtype="float64")
        y, jac = batchjac.jacobian(model, x, return_outputs=True)
        ours = of_model(model, (x,), max_memory=200_000, max_median_instances=limit)
    ref = batchjac.sensitivity(jac, x, y, max_median_instances=limit)
    for field in ("mean_abs", "mean", "elasticity", "elasticity_undefined", "scaled"):
        np.testing.assert_allclose(getattr(ours, field), getattr(ref, field), rtol=1e-10,
                                   atol=1e-12, err_msg=field)
    assert ours.n == ref.n == 300
