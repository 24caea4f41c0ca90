"""batchjac.solve: recovery on synthetic problem sets, per-instance flags, bounds, bad input.

References are independent of the solver: targets come from the numpy closed-form forward
pass of the example MLPs (``mlp_forward``) or from linear models whose weighted least-squares
solution and covariance have closed forms.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import batchjac  # noqa: E402
from batchjac._api.solve import solve  # noqa: E402
from batchjac._examples import keras as keras_examples  # noqa: E402
from batchjac._solve import IterationInfo, SolveResult, Status  # noqa: E402
from batchjac.examples import mlp_forward, mlp_weights, workload_inputs, workload_model  # noqa: E402

N = 64  # one batch size throughout, so the compiled kernels are shared between tests
SIZES = (5, 16, 16, 8)  # 3 unknowns + 2 known -> 8 outputs: identifiable (k < m)
SEED = 3
LAYERS = mlp_weights(SIZES, SEED)

A_LIN = np.array([[1.0, 0.5, -0.3], [0.2, -1.0, 0.4], [0.7, 0.1, 0.9], [-0.4, 0.8, 0.3],
                  [0.3, 0.3, -0.6]]).T  # (k=3, m=5)
A_TF = tf.constant(A_LIN)


def linear(z: Any) -> Any:
    """y = z @ A: closed-form least squares."""
    return tf.matmul(z, tf.cast(A_TF, z.dtype))


def cubic(z: Any) -> Any:
    """y = z^3 - 3z (k = m = 1): a local minimum of the residual at z = -1 for targets > 2."""
    return tf.pow(z, 3) - 3.0 * z


def sqrt_log(z: Any) -> Any:
    """NaN for z0 < 0: overshooting trial steps give non-finite outputs."""
    x0, x1 = z[:, 0], z[:, 1]
    return tf.stack([tf.sqrt(x0) + x1, tf.math.log(x0) - x1, x1 * x1], axis=1)


def nan_off_start(z: Any) -> Any:
    """Finite only at z == (0.5, 0.5)."""
    at_start = tf.reduce_all(tf.equal(z, tf.constant(0.5, z.dtype)), axis=1, keepdims=True)
    return tf.where(at_start, tf.constant(0.0, z.dtype), tf.constant(np.nan, z.dtype)) + z


@pytest.fixture(scope="module")
def mlp64() -> Any:
    return keras_examples.mlp(SIZES, seed=SEED, dtype="float64")


def problem(n: int = N, seed: int = 0, lo: float = -1.0, hi: float = 1.0
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x_true = rng.uniform(lo, hi, (n, 3))
    known = rng.normal(size=(n, 2))
    return x_true, known, mlp_forward(LAYERS, np.concatenate([x_true, known], axis=1))


def assert_consistent(res: SolveResult) -> None:
    """Invariants of every result: success is exactly the converged statuses, per instance."""
    assert res.success.dtype == bool
    np.testing.assert_array_equal(res.success, res.status > 0)
    np.testing.assert_allclose(res.cost, 0.5 * res.residual**2)
    assert set(np.unique(res.status)) <= {int(s) for s in Status}


# -- recovery -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lm", "gn"])
def test_recovers_identifiable_set(mlp64: Any, method: str) -> None:
    x_true, known, targets = problem()
    res = solve(mlp64, targets, known, x0=np.zeros((N, 3)), method=method, mode="forward")
    assert_consistent(res)
    assert res.success.all(), res
    assert np.abs(res.x - x_true).max() < 1e-6
    assert res.residual.max() < 1e-8
    assert not res.rank_deficient.any()
    assert (res.rank == 3).all()
    assert res.x.shape == (N, 3)
    assert res.x.dtype == np.float64


def test_float32_recovers_with_float32_tolerances() -> None:
    model = keras_examples.mlp(SIZES, seed=SEED, dtype="float32")
    x_true, known, targets = problem()
    res = solve(model, targets.astype("f4"), known.astype("f4"), x0=np.zeros((N, 3), "f4"),
                mode="forward")
    assert res.x.dtype == np.float32
    assert res.info["xtol"] == 1e-6
    assert res.success.all(), res
    assert np.abs(res.x - x_true).max() < 1e-4


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_other_backends_recover(backend: str) -> None:
    if importlib.util.find_spec(backend) is None or \
            importlib.util.find_spec(f"batchjac._backends.{backend}") is None:
        pytest.skip(f"{backend} or its backend is not installed")
    x_true, known, targets = problem()
    if backend == "torch":
        from batchjac._examples import torch as impl

        # a float32 module run as a float64 copy of its weights
        model, dtype, tol, mode = impl.mlp(SIZES, seed=SEED), "float64", 1e-6, "forward"
    else:
        from batchjac._examples import jax as impl  # type: ignore[no-redef]

        model, dtype, tol, mode = impl.mlp(SIZES, seed=SEED), "float32", 1e-4, "forward"
    res = solve(model, targets, known, x0=np.zeros((N, 3)), dtype=dtype, mode=mode)
    assert res.info["backend"] == backend
    assert res.success.all(), res
    assert np.abs(res.x - x_true).max() < tol


def test_public_export() -> None:
    assert batchjac.solve is solve
    assert "solve" in batchjac.__all__


# -- per-instance convergence -----------------------------------------------------------------------
def test_max_iter_flags_each_instance(mlp64: Any) -> None:
    """Instances started at their solution converge at iteration 0; the others, given one
    step, are reported as not converged, each on its own (no batch-wide test)."""
    x_true, known, _ = problem()
    targets = batchjac.jacobian(mlp64, x_true, known, return_outputs=True)[0]  # exact zeros
    x0 = np.zeros((N, 3))
    at_solution = np.arange(N) % 4 == 0
    x0[at_solution] = x_true[at_solution]
    res = solve(mlp64, targets, known, x0=x0, max_iter=1, mode="forward")
    assert_consistent(res)
    assert (res.status[at_solution] == Status.GTOL).all()
    assert (res.iterations[at_solution] == 0).all()
    assert (res.status[~at_solution] == Status.MAX_ITER).all()
    assert not res.success[~at_solution].any()
    assert (res.iterations[~at_solution] == 1).all()


def test_max_iter_zero_reports_every_moving_instance_unconverged(mlp64: Any) -> None:
    _, known, targets = problem()
    res = solve(mlp64, targets, known, x0=np.zeros((N, 3)), max_iter=0, mode="forward")
    assert (res.status == Status.MAX_ITER).all()
    assert not res.success.any()
    assert (res.iterations == 0).all()


def test_converged_instances_stop_costing_compute(mlp64: Any) -> None:
    x_true, known, targets = problem()
    x0 = np.zeros((N, 3))
    x0[: N // 2] = x_true[: N // 2] + 1e-3  # a near start converges in fewer steps
    seen: list[IterationInfo] = []
    res = solve(mlp64, targets, known, x0=x0, callback=seen.append, mode="forward")
    assert res.success.all()
    assert [s.iteration for s in seen] == list(range(len(seen)))
    counts = [len(s.instance) for s in seen]
    assert counts[0] == N
    assert counts[-1] < N
    assert counts == sorted(counts, reverse=True)
    evaluated = np.zeros(N, int)
    for s in seen[1:]:
        np.add.at(evaluated, s.instance, 1)
    np.testing.assert_array_equal(evaluated, res.iterations)  # one evaluation per trial step
    assert res.iterations[: N // 2].mean() < res.iterations[N // 2:].mean()


def test_slow_instances_flagged_while_others_converge() -> None:
    """y = z^3 - 3z from the far side of its local extremum: slow, so max_iter=3 stops them;
    instances whose targets are reachable close by converge."""
    targets = np.where(np.arange(N) % 2 == 0, 0.1, 2.0)[:, None]  # 2.0: a double root at -1
    x0 = np.where(np.arange(N) % 2 == 0, 0.0, -1.0 + 1e-3)[:, None]
    res = solve(cubic, targets, x0=x0, max_iter=6)
    assert_consistent(res)
    assert res.success[::2].all()
    assert not res.success[1::2].any()
    assert (res.status[1::2] == Status.MAX_ITER).all()


def test_unreachable_target_has_large_residual_and_honest_status() -> None:
    """A target above the model's range: the best fit is a stationary point with a large
    residual, converged but not fitted (LOCAL_MINIMUM, not a success); a saturated tanh with
    zero Jacobian is *not* converged."""
    res = solve(cubic, np.full((N, 1), 2.5), x0=np.full((N, 1), -1.5), bounds=(-1.8, 0.0))
    assert_consistent(res)
    assert (res.status == Status.LOCAL_MINIMUM).all()  # z = -1 is a stationary point, no fit
    assert not res.success.any()
    assert res.converged.all()
    np.testing.assert_allclose(res.x[:, 0], -1.0, atol=1e-4)
    np.testing.assert_allclose(res.residual, 0.5, atol=1e-6)

    def saturated(z: Any) -> Any:
        return tf.tanh(z)

    res = solve(saturated, np.full((N, 1), 2.0), x0=np.full((N, 1), 30.0))
    assert (res.status == Status.STALLED).all()
    assert not res.success.any()


# -- over- and under-determined ---------------------------------------------------------------------
def test_underdetermined_w1_reports_rank_deficiency() -> None:
    """W1: 5 unknowns, 4 outputs. Residuals reach zero; every instance is rank deficient."""
    model = workload_model("W1", "tensorflow", dtype="float64")
    u, kn = workload_inputs("W1", N, dtype=np.float64)
    y = mlp_forward(mlp_weights((8, 64, 64, 4), 0), np.concatenate([u, kn], axis=1))
    res = solve(model, y, kn, x0=np.zeros((N, 5)), mode="reverse")
    assert_consistent(res)
    assert res.rank_deficient.all()
    assert (res.rank == 4).all()
    assert np.median(res.residual) < 1e-8
    assert res.success.mean() > 0.9
    assert (res.residual[~res.success] > 1e-8).all()  # the unconverged did not reach zero


def test_underdetermined_linear_is_minimum_norm() -> None:
    """k=3 > m=2 linear: from x0=0 the Gauss-Newton step is the pseudo-inverse solution."""
    a = A_LIN[:, :2]  # y = z @ a, z (3,), y (2,)

    def wide(z: Any) -> Any:
        return tf.matmul(z, tf.constant(a, z.dtype))

    rng = np.random.default_rng(1)
    t = rng.normal(size=(N, 2))
    res = solve(wide, t, x0=np.zeros((N, 3)), method="gn")
    assert res.success.all()
    assert (res.rank == 2).all()
    assert res.rank_deficient.all()
    expected = t @ np.linalg.pinv(a)
    np.testing.assert_allclose(res.x, expected, atol=1e-10)
    # LM: nearest to x0 in Moré's scaled norm, D = diag(JᵀJ) = diag(a aᵀ)
    lm = solve(wide, t, x0=np.zeros((N, 3)))
    d = np.sqrt(np.diag(a @ a.T))
    np.testing.assert_allclose(lm.x, (t @ np.linalg.pinv(a / d[:, None])) / d, atol=1e-9)


def test_overdetermined_linear_weights_sigma_and_covariance() -> None:
    rng = np.random.default_rng(2)
    x_true = rng.normal(size=(N, 3))
    sigma = np.array([0.1, 0.2, 0.05, 0.3, 0.1])
    t = x_true @ A_LIN + sigma * rng.normal(size=(N, 5))
    w = 1 / sigma**2
    ata = A_LIN @ np.diag(w) @ A_LIN.T  # (k, k)
    expected = np.linalg.solve(ata, ((t * w) @ A_LIN.T).T).T  # (N, 3) weighted LS
    tight = {"xtol": 1e-14, "ftol": 1e-15, "gtol": 1e-15}  # closed forms to ~1e-12
    res = solve(linear, t, x0=np.zeros((N, 3)), sigma=sigma, return_covariance=True,
                return_jacobian=True, **tight)
    assert res.success.all()
    np.testing.assert_allclose(res.x, expected, atol=1e-9)
    np.testing.assert_allclose(res.covariance, np.broadcast_to(np.linalg.inv(ata), (N, 3, 3)),
                               rtol=1e-8)
    np.testing.assert_allclose(res.jacobian, np.broadcast_to(A_LIN.T, (N, 5, 3)), atol=1e-12)
    # the same weights as `weights=`: same x; covariance scaled by the residual variance
    res_w = solve(linear, t, x0=np.zeros((N, 3)), weights=w, return_covariance=True, **tight)
    np.testing.assert_allclose(res_w.x, res.x, atol=1e-10)
    s2 = 2 * res_w.cost / (5 - 3)
    np.testing.assert_allclose(res_w.covariance, s2[:, None, None] * np.linalg.inv(ata), rtol=1e-8)
    # a zero weight drops an output: fit through the other four only
    w0 = w.copy()
    w0[0] = 0.0
    res0 = solve(linear, t, x0=np.zeros((N, 3)), weights=w0, **tight)
    ata0 = A_LIN @ np.diag(w0) @ A_LIN.T
    np.testing.assert_allclose(res0.x, np.linalg.solve(ata0, ((t * w0) @ A_LIN.T).T).T, atol=1e-9)


def test_per_instance_weights() -> None:
    rng = np.random.default_rng(3)
    t = rng.normal(size=(N, 5))
    w = rng.uniform(0.5, 2.0, (N, 5))
    res = solve(linear, t, x0=np.zeros((N, 3)), weights=w, xtol=1e-14, ftol=1e-15, gtol=1e-15)
    for i in (0, N - 1):
        ata = A_LIN @ np.diag(w[i]) @ A_LIN.T
        np.testing.assert_allclose(res.x[i], np.linalg.solve(ata, A_LIN @ (w[i] * t[i])), atol=1e-9)


# -- bounds -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lm", "gn"])
def test_bounds_hold_at_every_evaluation(mlp64: Any, method: str) -> None:
    rng = np.random.default_rng(4)
    lower = np.tile([-0.5, -1.0, -0.2], (N, 1)) - rng.uniform(0, 0.3, (N, 3))  # per instance
    upper = np.array([0.5, 0.2, 1.0])  # per feature
    x_true = rng.uniform(lower, upper)
    on_bound = rng.random((N, 3)) < 0.3
    x_true[on_bound] = np.where(rng.random(on_bound.sum()) < 0.5, lower[on_bound],
                                np.broadcast_to(upper, (N, 3))[on_bound])
    known = rng.normal(size=(N, 2))
    targets = mlp_forward(LAYERS, np.concatenate([x_true, known], axis=1))
    seen: list[np.ndarray] = []
    lows: list[np.ndarray] = []

    def record(info: IterationInfo) -> None:
        seen.append(info.x.astype(np.float64))
        lows.append(lower[info.instance])

    res = solve(mlp64, targets, known, bounds=(lower, upper), x0=np.clip(0.0, lower, upper),
                method=method, callback=record, mode="forward")
    for x, lo in zip(seen, lows):
        assert (x >= lo).all()
        assert (x <= upper).all()
    assert (res.x >= lower).all()
    assert (res.x <= upper).all()
    assert res.success.mean() > 0.95, res
    ok = res.success
    assert np.abs(res.x - x_true)[ok].max() < 1e-6


def test_bounds_rounded_inwards_in_float32() -> None:
    """float32(0.3) > 0.3: evaluated points must still lie inside the float64 box."""
    t = np.tile([5.0, -5.0, 5.0, 5.0, -5.0], (N, 1))  # pushes against the box
    seen: list[np.ndarray] = []
    res = solve(linear, t, x0=np.full((N, 3), 0.2), bounds=(0.1, 0.3), dtype="float32",
                callback=lambda info: seen.append(info.x.astype(np.float64)))
    assert res.x.dtype == np.float32
    for x in seen:
        assert (x >= 0.1).all()
        assert (x <= 0.3).all()
    # the box keeps the targets out of reach: a converged bound minimum, not a fit
    assert res.converged.all()
    assert not res.success.any()
    assert (res.status == Status.LOCAL_MINIMUM).all()
    inside = [np.float32(0.1), np.nextafter(np.float32(0.3), np.float32(0))]
    assert float(inside[0]) >= 0.1
    assert float(inside[1]) < 0.3 < float(np.float32(0.3))
    assert np.isin(res.x, inside).any()  # pushed onto the box: exactly its inner float32 edge


def test_x0_outside_bounds_names_the_instance(mlp64: Any) -> None:
    _, known, targets = problem()
    x0 = np.zeros((N, 3))
    x0[5, 2] = 2.0
    with pytest.raises(batchjac.InputError, match=r"outside the bounds for instance 5, unknown 2"):
        solve(mlp64, targets, known, x0=x0, bounds=(-1, 1))


def test_lower_not_below_upper_is_an_error(mlp64: Any) -> None:
    _, known, targets = problem()
    lower = np.full((N, 3), -1.0)
    lower[7, 1] = 1.0
    with pytest.raises(batchjac.InputError, match=r"lower >= upper for instance 7, unknown 1"):
        solve(mlp64, targets, known, x0=np.zeros((N, 3)), bounds=(lower, 1.0))
    with pytest.raises(batchjac.InputError, match=r"lower bound has shape \(2,\)"):
        solve(mlp64, targets, known, x0=np.zeros((N, 3)), bounds=([0, 1], 2.0))


def test_default_start_is_inside_the_box() -> None:
    seen: list[np.ndarray] = []
    solve(linear, np.ones((N, 5)), bounds=([1.0, -np.inf, -2.0], [3.0, -1.0, np.inf]), max_iter=0,
          callback=lambda info: seen.append(info.x))
    np.testing.assert_array_equal(seen[0][0], [2.0, -1.0, 0.0])  # midpoint, clipped 0, 0


# -- evaluation in fixed chunk sizes --------------------------------------------------------------
class _FakeKernel:
    def __init__(self, size: int, log: list[int]) -> None:
        self.chunk_size, self.log = size, log

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        assert u.shape[0] == self.chunk_size  # always padded to the compiled size
        self.log.append(self.chunk_size)
        return u @ A_LIN, np.broadcast_to(A_LIN.T, (u.shape[0], 5, 3)).copy()

    def provisional(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        return self(u, ctx)


class _FakeBound:
    compiles_kernels = True

    def __init__(self) -> None:
        self._kernels: dict[tuple[str, int, bool], _FakeKernel] = {}
        self.tuned: dict[tuple[int, bool], tuple[str, str]] = {}
        self.log: list[int] = []

    def kernel(self, mode: str, size: int, with_outputs: bool,
               variant: str | None = None, **_: object) -> _FakeKernel:  # (one implementation)
        return self._kernels.setdefault((mode, size, with_outputs), _FakeKernel(size, self.log))

    def has_kernel(self, mode: str, size: int, with_outputs: bool) -> bool:
        return (mode, size, with_outputs) in self._kernels


def test_evaluator_shrinks_the_chunk_once_padding_costs_more_than_compiling() -> None:
    from batchjac._solve.evaluator import _compile_seconds, _Evaluator

    bound = _FakeBound()
    ev = _Evaluator(bound, "forward", 512)
    assert ev.sizes == [512, 64, 8]
    u = np.random.default_rng(7).normal(size=(700, 3))
    y, jac = ev(u, ())
    assert bound.log == [512, 512]  # 700 rows: two full chunks
    np.testing.assert_allclose(y, u @ A_LIN)
    assert jac.shape == (700, 5, 3)
    _compile_seconds[bound] = 1e9  # compiling looks expensive: keep padding
    ev(u[:5], ())
    assert bound.log[-1] == 512
    _compile_seconds[bound] = 0.0  # now cheap: the next small call gets its own size
    ev(u[:5], ())
    y, _ = ev(u[:5], ())
    assert bound.log[-1] == 8
    np.testing.assert_allclose(y, u[:5] @ A_LIN)
    _compile_seconds[bound] = 0.0  # (compiling size 8 just measured its own cost)
    ev(u[:40], ())
    ev(u[:40], ())
    assert bound.log[-1] == 64
    assert ev.compiled == {512, 64, 8}


class _ModeKernel(_FakeKernel):
    """A kernel whose forward mode costs 3 ms a call below 512 rows (as PyTorch's does in
    Python whatever the rows), its reverse mode nothing."""

    def __init__(self, mode: str, size: int, log: list[int]) -> None:
        super().__init__(size, log)
        self.mode = mode

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        if self.mode == "forward" and self.chunk_size < 512:
            time.sleep(0.003)
        return super().__call__(u, ctx)


class _EagerBound(_FakeBound):
    compiles_kernels = False  # as PyTorch: a kernel of a new size costs nothing to make

    def kernel(self, mode: str, size: int, with_outputs: bool,
               variant: str | None = None, **_: object) -> _FakeKernel:  # (one implementation)
        return self._kernels.setdefault((mode, size, with_outputs),
                                        _ModeKernel(mode, size, self.log))


def test_evaluator_times_the_modes_again_for_each_smaller_size() -> None:
    from batchjac._solve.evaluator import _Evaluator

    bound = _EagerBound()
    ev = _Evaluator(bound, "forward", 512, tune_modes=True)
    u = np.random.default_rng(9).normal(size=(512, 3))
    ev(u, ())
    assert ev.modes == {512: "forward"}  # the full size keeps the plan's mode
    y, jac = ev(u[:5], ())  # no compilation to amortise: the ideal size at once, timed
    np.testing.assert_allclose(y, u[:5] @ A_LIN)
    assert jac.shape == (5, 5, 3)
    assert ev.modes[8] == "reverse"
    assert bound.tuned[(8, True)][0] == "reverse"
    assert "forward" in bound.tuned[(8, True)][1]  # the timings are kept with the choice
    ev(u[:40], ())
    assert ev.modes[64] == "reverse"
    assert bound.log[-1] == 64
    assert ev.compiled == {512, 64, 8}
    # without tuning (mode given, or reproducible solves) every size keeps the plan's mode
    fixed = _Evaluator(_EagerBound(), "forward", 512)
    fixed(u[:5], ())
    assert fixed.modes == {512: "forward", 8: "forward"}


def test_solve_with_torch_uses_small_chunks_from_the_first_call() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    net = net.double()
    rng = np.random.default_rng(10)
    x_true = rng.uniform(-2, 2, size=(1000, 3))
    with torch.no_grad():
        targets = net(torch.from_numpy(x_true)).numpy()
    rows: list[int] = []
    res = solve(net, targets, x0=np.zeros((1000, 3)), dtype="float64",
                callback=lambda info: rows.append(len(info.x)))
    ok = res.success
    assert ok.mean() > 0.95
    np.testing.assert_allclose(net(torch.from_numpy(res.x[ok])).detach().numpy(), targets[ok],
                               atol=1e-8)
    # the few slow instances at the end ran through small chunks, not padded to 1000 rows
    assert rows[-1] < 125
    assert min(res.info["compiled_chunk_sizes"]) < 125


def test_small_chunks_and_blocks_give_the_same_answer() -> None:
    rng = np.random.default_rng(8)
    t = rng.normal(size=(N, 5))
    whole = solve(linear, t, x0=np.zeros((N, 3)))
    chunked = solve(linear, t, x0=np.zeros((N, 3)), chunk_size=16)
    assert chunked.info["chunk_size"] == 16
    np.testing.assert_allclose(chunked.x, whole.x, atol=1e-12)
    np.testing.assert_array_equal(chunked.status, whole.status)


# -- multi-start ----------------------------------------------------------------------------------
def test_n_starts_escapes_a_local_minimum() -> None:
    t = np.full((N, 1), 2.5)  # one real root near z = 2.02; a local minimum at z = -1
    one = solve(cubic, t, x0=np.full((N, 1), -1.5), bounds=(-3.0, 3.0))
    assert np.allclose(one.residual, 0.5, atol=1e-6)
    many = solve(cubic, t, x0=np.full((N, 1), -1.5), bounds=(-3.0, 3.0), n_starts=12, seed=0)
    assert (many.cost <= one.cost + 1e-12).all()  # start 0 is x0: never worse
    assert (many.residual < 1e-8).mean() > 0.95
    assert (many.start[many.residual < 1e-8] > 0).all()
    again = solve(cubic, t, x0=np.full((N, 1), -1.5), bounds=(-3.0, 3.0), n_starts=12, seed=0)
    np.testing.assert_array_equal(again.x, many.x)  # seeded
    # 8 instances per block: the same starts, the same answers. Several starts reach the root
    # with costs equal but for the last bits, which kernels timed per chunk size (TensorFlow:
    # XLA or graph) may order differently: both runs fix the kernels (reproducible=True)
    fixed = solve(cubic, t, x0=np.full((N, 1), -1.5), bounds=(-3.0, 3.0), n_starts=12, seed=0,
                  reproducible=True)
    chunked = solve(cubic, t, x0=np.full((N, 1), -1.5), bounds=(-3.0, 3.0), n_starts=12, seed=0,
                    chunk_size=96, reproducible=True)
    np.testing.assert_array_equal(chunked.start, fixed.start)
    np.testing.assert_allclose(chunked.x, fixed.x, atol=1e-12)
    both = (fixed.residual < 1e-8) & (many.residual < 1e-8)
    assert both.mean() > 0.95
    np.testing.assert_allclose(fixed.x[both], many.x[both], atol=1e-8)  # the same root


def test_random_starts_lie_inside_bounds() -> None:
    starts: list[np.ndarray] = []

    def record(info: IterationInfo) -> None:
        if info.iteration == 0:
            starts.append(info.x[info.start > 0])

    solve(linear, np.ones((N, 5)), bounds=([0.0, -1.0, 2.0], [1.0, np.inf, 2.5]), n_starts=4,
          seed=1, max_iter=0, callback=record)
    x = np.concatenate(starts)
    assert x.shape == (N * 3, 3)
    assert (x >= [0.0, -1.0, 2.0]).all()
    assert (x <= [1.0, np.inf, 2.5]).all()
    assert x[:, 0].std() > 0.2  # uniform in the finite box, not x0 again


# -- bad input ------------------------------------------------------------------------------------
def test_nan_targets_or_known_invalidate_only_that_instance(mlp64: Any) -> None:
    x_true, known, targets = problem()
    targets[3, 1] = np.nan
    known[9, 0] = np.inf
    res = solve(mlp64, targets, known, x0=np.zeros((N, 3)), mode="forward")
    assert_consistent(res)
    bad = np.zeros(N, bool)
    bad[[3, 9]] = True
    assert (res.status[bad] == Status.INVALID_INPUT).all()
    assert np.isnan(res.x[bad]).all()
    assert (res.iterations[bad] == 0).all()
    assert res.success[~bad].all()
    assert np.abs(res.x[~bad] - x_true[~bad]).max() < 1e-6
    assert list(res.status_names[[3, 9]]) == ["invalid_input", "invalid_input"]
    assert set(res.status_names[~bad]) <= {"gtol", "ftol", "xtol"}


def test_non_finite_model_outputs_reject_steps() -> None:
    rng = np.random.default_rng(5)
    x_true = np.stack([rng.uniform(0.001, 0.05, N), rng.uniform(-1, 1, N)], axis=1)
    t = np.stack([np.sqrt(x_true[:, 0]) + x_true[:, 1], np.log(x_true[:, 0]) - x_true[:, 1],
                  x_true[:, 1] ** 2], axis=1)
    costs: list[np.ndarray] = []
    res = solve(sqrt_log, t, x0=np.tile([2.0, 0.5], (N, 1)), callback=lambda i: costs.append(i.cost))
    assert (~np.isfinite(np.concatenate(costs))).sum() > 0  # NaN trial points happened
    assert res.success.all()
    assert np.abs(res.x - x_true).max() < 1e-8
    assert np.isfinite(res.residual).all()


def test_model_non_finite_everywhere_but_the_start() -> None:
    res = solve(nan_off_start, np.ones((N, 2)), x0=np.full((N, 2), 0.5))
    assert (res.status == Status.NON_FINITE).all()
    assert not res.success.any()
    np.testing.assert_array_equal(res.x, 0.5)  # never moved to a NaN point
    assert np.isfinite(res.cost).all()


def test_model_non_finite_at_the_start() -> None:
    res = solve(nan_off_start, np.ones((N, 2)), x0=np.full((N, 2), 0.25), max_iter=5)
    assert (res.status == Status.NON_FINITE).all()
    assert (res.iterations == 0).all()


def test_targets_shape_must_match_output(mlp64: Any) -> None:
    _, known, targets = problem()
    with pytest.raises(batchjac.InputError, match=r"`targets` has shape \(64, 7\).*\(8,\)"):
        solve(mlp64, targets[:, :7], known, x0=np.zeros((N, 3)))
    with pytest.raises(batchjac.InputError, match=r"`known` has 63 rows but `targets` has 64"):
        solve(mlp64, targets, known[:-1], x0=np.zeros((N, 3)))


X0 = np.zeros((N, 3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x0": X0, "method": "newton"}, r"`method` must be 'lm'"),
        ({"x0": X0, "n_starts": 0}, r"`n_starts` must be an integer >= 1"),
        ({"x0": X0, "max_iter": -1}, r"`max_iter` must be an integer >= 0"),
        ({"x0": X0, "xtol": -1.0}, r"`xtol` must be a finite number >= 0"),
        ({"x0": X0, "weights": 1.0, "sigma": 1.0}, r"not both"),
        ({"x0": X0, "weights": -np.ones(5)}, r"`weights` must be >= 0"),
        ({"x0": X0, "sigma": np.zeros(5)}, r"`sigma` .* must be > 0"),
        ({"x0": X0, "weights": np.ones(4)}, r"`weights` has shape \(4,\)"),
        ({"x0": X0, "n_unknowns": 4}, r"`n_unknowns=4` but `x0` has 3"),
        ({"x0": np.full((N, 3), np.nan)}, r"`x0` has a non-finite value in row 0"),
        ({"x0": np.zeros((N, 3, 1))}, r"`x0` must be \(N, k\)"),
        ({"bounds": (0.0, 1.0)}, r"cannot tell how many unknowns"),
        ({"bounds": 1.0, "n_unknowns": 3}, r"`bounds` must be a pair"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(batchjac.InputError, match=match):
        solve(linear, np.ones((N, 5)), **kwargs)


def test_result_summary_and_messages() -> None:
    res = solve(linear, np.ones((N, 5)), x0=np.zeros((N, 3)))
    assert sum(res.summary().values()) == N
    assert "converged" in res.message(0)
    assert f"n={N}" in repr(res)


def test_empty_batch() -> None:
    res = solve(linear, np.ones((0, 5)), x0=np.zeros((0, 3)))
    assert res.x.shape == (0, 3)
    assert res.status.shape == (0,)
