"""``success`` of ``solve`` means the targets are fitted (:mod:`batchjac._fit`): a converged
local minimum is ``Status.LOCAL_MINIMUM``, counted apart by the API, the store and the CLI.

Models in closed form (the numpy backend): ``y = z^3 - 3z`` has a local minimum of the
residual at ``z = -1`` (``y = 2``) for every target above 2, and the real root right of
``z = 1``; started at ``z = -1.5`` the iterations converge to the minimum. A linear model
``y = A z`` (m = 4, k = 2) with noise of known size tests the chi-square rule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats

import batchjac
from batchjac import ClosedForm
from batchjac._errors import InputError
from batchjac._fit import CHI2_LEVEL, chi2_quantile, fitted
from batchjac._solve import Status
from batchjac.cli import cli

CUBIC = ClosedForm(lambda z: z**3 - 3.0 * z, lambda z: (3.0 * z**2 - 3.0)[:, :, None])
N = 200


def cubic_problem(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    t = np.random.default_rng(seed).uniform(-4.0, 4.0, (N, 1))
    return t, np.full((N, 1), -1.5)


def test_chi2_quantile_against_scipy() -> None:
    for dof in (1, 2, 3, 5, 10, 40, 100, 1000):
        exact = stats.chi2.ppf(CHI2_LEVEL, dof)
        approx = chi2_quantile(dof)
        assert exact <= approx <= exact * 1.035, (dof, approx, exact)  # never below: no fit lost
    assert chi2_quantile(0) == chi2_quantile(1)  # m == k: one degree of freedom, not zero


def test_fitted_is_relative_to_the_targets_and_weights() -> None:
    rng = np.random.default_rng(3)
    t = rng.normal(size=(5, 4)) * np.array([[1e-3], [1.0], [10.0], [1e3], [0.0]])
    tnorm = np.maximum(np.linalg.norm(t, axis=1), 2.0)  # sqrt(m) = 2 for targets near zero
    r_in, r_out = 0.9e-4 * tnorm, 1.1e-4 * tnorm
    assert fitted(r_in, t, None, k=2, absolute=False, fit_tol=1e-4).all()
    assert not fitted(r_out, t, None, k=2, absolute=False, fit_tol=1e-4).any()
    sw = np.full((5, 4), 3.0)  # weights 9: the weighted norms scale by 3
    assert fitted(3 * r_in, t, sw, k=2, absolute=False, fit_tol=1e-4).all()
    assert not fitted(3 * r_out, t, sw, k=2, absolute=False, fit_tol=1e-4).any()
    q = stats.chi2.ppf(CHI2_LEVEL, 2)  # with sigma: chi2 with m - k = 2 degrees of freedom
    assert fitted(np.sqrt([0.5 * q, 0.99 * q]), t[:2], sw[:2], k=2, absolute=True,
                  fit_tol=1e-4).all()
    assert not fitted(np.sqrt([1.1 * q]), t[:1], sw[:1], k=2, absolute=True, fit_tol=1e-4).any()


def test_local_minima_are_not_successes() -> None:
    t, x0 = cubic_problem()
    res = batchjac.solve(CUBIC, t, x0=x0, bounds=(-3.0, 3.0))
    assert isinstance(res, batchjac.SolveResult)
    # independent: where the cubic ends up, and what it gives there
    y = res.x[:, 0] ** 3 - 3 * res.x[:, 0]
    np.testing.assert_allclose(res.residual, np.abs(y - t[:, 0]), atol=1e-12)
    above = t[:, 0] > 2.05  # out of reach from z = -1.5: the iterations stop at z = -1
    assert 30 < above.sum() < N - 30
    np.testing.assert_allclose(res.x[above, 0], -1.0, atol=1e-3)
    assert (res.status[above] == Status.LOCAL_MINIMUM).all()
    assert not res.success[above].any()
    assert res.converged[above].all()
    below = t[:, 0] < 1.95
    assert res.success[below].all()
    assert (res.residual[res.success] < 1e-8).all()  # every success fits the target
    np.testing.assert_array_equal(res.success, res.status > 0)
    summary = res.summary()
    assert summary["local_minimum"] == int((res.status == Status.LOCAL_MINIMUM).sum()) >= above.sum()
    assert "try n_starts > 1" in repr(res)
    assert "fit_test" in res.info
    assert res.info["fit_tol"] == 1e-6


def test_n_starts_fixes_the_local_minima() -> None:
    t, x0 = cubic_problem()
    one = batchjac.solve(CUBIC, t, x0=x0, bounds=(-3.0, 3.0))
    many = batchjac.solve(CUBIC, t, x0=x0, bounds=(-3.0, 3.0), n_starts=16, seed=1)
    assert isinstance(one, batchjac.SolveResult)
    assert isinstance(many, batchjac.SolveResult)
    stuck = one.status == Status.LOCAL_MINIMUM
    assert stuck.sum() > 30
    # the root right of z = 1, from another start: a start lands in the minimum's basin
    # (z < 1, 2/3 of the box) with probability 2/3, so a few instances may stay stuck
    fixed = many.success[stuck]
    assert fixed.mean() > 0.95, many.summary()
    assert (many.status[stuck][~fixed] == Status.LOCAL_MINIMUM).all()  # and say so
    y = many.x[:, 0] ** 3 - 3 * many.x[:, 0]
    np.testing.assert_allclose(y[many.success], t[many.success, 0], atol=1e-8)
    assert (many.start[stuck][fixed] > 0).all()
    assert "try n_starts" not in repr(many)  # n_starts was given: no advice to give it


def test_float32_fits_pass_and_minima_do_not() -> None:
    t, x0 = cubic_problem()
    res = batchjac.solve(CUBIC, t.astype(np.float32), x0=x0.astype(np.float32), bounds=(-3.0, 3.0))
    assert isinstance(res, batchjac.SolveResult)
    below, above = t[:, 0] < 1.95, t[:, 0] > 2.05
    assert res.success[below].all()
    assert (res.status[above] == Status.LOCAL_MINIMUM).all()


def test_with_sigma_the_test_is_chi_square_against_the_noise() -> None:
    rng = np.random.default_rng(7)
    a = rng.normal(size=(4, 2))
    linear = ClosedForm(lambda z: z @ a.T, lambda z: np.broadcast_to(a, (len(z), 4, 2)).copy())
    x_true = rng.normal(size=(N, 2))
    sigma = 0.05
    t = x_true @ a.T + sigma * rng.standard_normal((N, 4))
    with_sigma = batchjac.solve(linear, t, n_unknowns=2, sigma=sigma)
    assert isinstance(with_sigma, batchjac.SolveResult)
    # the least-squares solution in closed form, and its chi2 with m - k = 2 degrees of freedom
    x_ls = np.linalg.lstsq(a, t.T, rcond=None)[0].T
    np.testing.assert_allclose(with_sigma.x, x_ls, atol=1e-7)
    chi2 = (np.linalg.norm(x_ls @ a.T - t, axis=1) / sigma) ** 2
    np.testing.assert_array_equal(with_sigma.success, chi2 <= chi2_quantile(2))
    assert with_sigma.success.mean() > 0.98  # noise of the stated size fits
    # the same targets claimed to be 20x more precise: most residuals are far too large
    tight = batchjac.solve(linear, t, n_unknowns=2, sigma=sigma / 20)
    assert isinstance(tight, batchjac.SolveResult)
    assert (tight.status == Status.LOCAL_MINIMUM).mean() > 0.9
    # no sigma: the relative test, which noise of 5% fails unless fit_tol says so
    plain = batchjac.solve(linear, t, n_unknowns=2)
    loose = batchjac.solve(linear, t, n_unknowns=2, fit_tol=0.5)
    assert isinstance(plain, batchjac.SolveResult)
    assert isinstance(loose, batchjac.SolveResult)
    assert not plain.success.any()
    assert plain.converged.all()
    assert loose.success.all()


@pytest.mark.parametrize("bad", [0, -1e-3, float("nan"), float("inf"), "1e-3", True])
def test_bad_fit_tol_is_refused(bad: Any) -> None:
    t, x0 = cubic_problem()
    with pytest.raises(InputError, match=r"`fit_tol` must be a finite number > 0.*got"):
        batchjac.solve(CUBIC, t, x0=x0, fit_tol=bad)


def test_store_counts_local_minima_apart(tmp_path: Path) -> None:
    t, x0 = cubic_problem()
    res = batchjac.solve(CUBIC, t, x0=x0, bounds=(-3.0, 3.0), out=tmp_path / "out", block_size=64)
    ref = batchjac.solve(CUBIC, t, x0=x0, bounds=(-3.0, 3.0))
    assert isinstance(res, batchjac.SolveStoreResult)
    assert isinstance(ref, batchjac.SolveResult)
    minima = int((ref.status == Status.LOCAL_MINIMUM).sum())
    assert res.local_minima == minima > 30
    assert res.succeeded == int(ref.success.sum()) == N - minima
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "success.npy"), ref.success)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["local_minima"] == minima
    assert summary["status_codes"]["local_minimum"] == Status.LOCAL_MINIMUM
    # a different fit_tol is another job: the successes it records would differ
    with pytest.raises(batchjac.BatchJacError, match="different job"):
        batchjac.solve(CUBIC, t, x0=x0, bounds=(-3.0, 3.0), out=tmp_path / "out", block_size=64,
                       fit_tol=1e-2)


def test_cli_reports_both_counts_and_suggests_n_starts(tmp_path: Path) -> None:
    t, x0 = cubic_problem()
    np.save(tmp_path / "t.npy", t)
    np.save(tmp_path / "x0.npy", x0)
    (tmp_path / "cubic.py").write_text(
        "import numpy as np\nfrom batchjac import ClosedForm\n"
        "model = ClosedForm(lambda z: z**3 - 3.0 * z, lambda z: (3.0 * z**2 - 3.0)[:, :, None])\n")
    args = [str(tmp_path / "cubic.py") + ":model", "--targets", str(tmp_path / "t.npy"),
            "--x0", str(tmp_path / "x0.npy"), "--lower", "-3", "--upper", "3"]
    result = CliRunner().invoke(cli, ["solve", *args, "-o", str(tmp_path / "one"), "--json"])
    assert result.exit_code == 0, result.output
    ref = batchjac.solve(CUBIC, t, x0=x0, bounds=(-3.0, 3.0))
    assert isinstance(ref, batchjac.SolveResult)
    minima = int((ref.status == Status.LOCAL_MINIMUM).sum())
    summary = json.loads(result.stdout)
    assert (summary["succeeded"], summary["local_minima"]) == (N - minima, minima)
    assert f"{N - minima}/{N} instances fitted" in result.stderr
    assert f"{minima} converged without fitting the targets" in result.stderr
    assert "--n-starts 8" in result.stderr
    many = CliRunner().invoke(cli, ["solve", *args, "-o", str(tmp_path / "many"), "--n-starts",
                                    "16", "--seed", "1", "--json"])
    assert many.exit_code == 0, many.output
    assert json.loads(many.stdout)["local_minima"] < minima / 10
