"""Dask path on a real dask.distributed cluster of worker processes on this machine."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

distributed = pytest.importorskip("dask.distributed")
da = pytest.importorskip("dask.array")
pytest.importorskip("tensorflow")

import batchjac  # noqa: E402
from batchjac._dask import make_client  # noqa: E402
from batchjac.examples import (  # noqa: E402
    WORKLOADS,
    mlp_forward,
    mlp_jacobian,
    mlp_weights,
    seed_model,
    workload_inputs,
    workload_model,
)

from .helpers import assert_jac_close  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    # distributed's own shutdown chatter (ports, nanny kills) is not under test
    "ignore::ResourceWarning",
    "ignore::DeprecationWarning",
    "ignore:.*Port .* is already in use.*:UserWarning",
)


def closed_form(name: str, unknown: np.ndarray, known: np.ndarray | None = None) -> tuple[Any, Any]:
    """(outputs, Jacobians) of workload ``name`` from its weights in float64: the reference the
    cluster's results are held to, independent of batchjac's local path."""
    x = np.asarray(unknown if known is None else np.concatenate([unknown, known], 1), np.float64)
    layers = mlp_weights(WORKLOADS[name].sizes)
    if x.shape[1] <= 16:
        return mlp_forward(layers, x), mlp_jacobian(layers, x)[:, :, : unknown.shape[1]]
    # wide inputs (W2, 784 columns): the chain rule from the output side, W3^T D2 W2^T D1 W1^T
    # with (N, 10, width) products; mlp_jacobian's input-side product would hold (N, 256, 784)
    hidden, h = [], x
    for w, b in layers[:-1]:
        h = np.tanh(h @ w + b)
        hidden.append(h)
    jac = np.broadcast_to(layers[-1][0].T, (x.shape[0], *layers[-1][0].T.shape))
    for (w, _), a in zip(reversed(layers[:-1]), reversed(hidden)):
        scaled = jac * (1 - a**2)[:, None, :]
        jac = (scaled.reshape(-1, w.shape[1]) @ w.T).reshape(*scaled.shape[:2], w.shape[0])  # one GEMM
    return mlp_forward(layers, x), jac[:, :, : unknown.shape[1]]


def _submitted(client: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions submitted to ``client`` from now on (the tasks a store's
    chunk loop hands the workers), in order."""
    submit, tasks = client.submit, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        tasks.append(args[0].__name__)
        return submit(*args, **kwargs)

    monkeypatch.setattr(client, "submit", counted)
    return tasks


def assert_outputs_close(y: Any, ref: Any) -> None:
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())


@pytest.fixture(scope="module")
def client() -> Any:
    c = make_client("local:2")
    yield c
    c.close()
    c.cluster.close()


def test_numpy_inputs_with_client_equal_local(client: Any) -> None:
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 3000, seed=3)
    remote = batchjac.jacobian(model, unknown, known, client=client, rows_per_task=700)
    assert_jac_close(remote, closed_form("W1", unknown, known)[1], dtype=np.float32)


def test_dask_arrays_give_lazy_result(client: Any) -> None:
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 2500, seed=4)
    du, dk = da.from_array(unknown, chunks=600), da.from_array(known, chunks=600)
    y, jac = batchjac.jacobian(model, du, dk, client=client, return_outputs=True)
    assert isinstance(jac, da.Array)
    assert jac.chunks[0] == du.chunks[0]
    assert jac.shape == (2500, 4, 5)
    ly, lj = closed_form("W1", unknown, known)
    cy, cj = client.compute([y, jac], sync=True)
    assert_jac_close(cj, lj, dtype=np.float32)
    assert_outputs_close(cy, ly)


def test_framework_arrays_with_client_come_back_in_their_kind(client: Any) -> None:
    """The rule of batchjac._arrays on the cluster: torch tensors (and JAX arrays) in give
    that kind back, on the input's device; output= overrides; the numbers are the cluster's
    (checked against the closed form), not a local recomputation."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    model = seed_model("tensorflow")  # the workers have TensorFlow loaded already
    unknown, known = workload_inputs("W1", 900, seed=23)
    ly, lj = closed_form("W1", unknown, known)
    tu, tk = torch.from_numpy(unknown), torch.from_numpy(known)
    y, jac = batchjac.jacobian(model, tu, tk, client=client, rows_per_task=300,
                               return_outputs=True)
    assert isinstance(y, torch.Tensor)
    assert isinstance(jac, torch.Tensor)
    assert jac.device == tu.device
    assert tuple(jac.shape) == (900, 4, 5)
    assert_jac_close(jac.numpy(), lj, dtype=np.float32)
    assert_outputs_close(y.numpy(), ly)
    as_numpy = batchjac.jacobian(model, tu, tk, client=client, rows_per_task=300, output="numpy")
    assert type(as_numpy) is np.ndarray
    np.testing.assert_array_equal(as_numpy, jac.numpy())
    dev = jax.devices("cpu")[0]
    jj = batchjac.jacobian(model, jax.device_put(unknown, dev), jax.device_put(known, dev),
                           client=client, rows_per_task=300)
    assert isinstance(jj, jax.Array)
    assert jj.committed
    assert jj.devices() == {dev}
    np.testing.assert_array_equal(np.asarray(jj), jac.numpy())
    asked = batchjac.jacobian(model, unknown, known, client=client, rows_per_task=300,
                              output="torch")
    assert isinstance(asked, torch.Tensor)
    np.testing.assert_array_equal(asked.numpy(), jac.numpy())


def test_output_is_refused_where_the_dask_result_cannot_take_it(client: Any, tmp_path: Any
                                                                ) -> None:
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 200, seed=24)
    du, dk = da.from_array(unknown, chunks=100), da.from_array(known, chunks=100)
    with pytest.raises(batchjac.InputError, match=r"output='torch'.*lazy Dask array"):
        batchjac.jacobian(model, du, dk, client=client, output="torch")
    with pytest.raises(batchjac.InputError, match=r"output='jax'.*cannot be combined with `out=`"):
        batchjac.jacobian(model, unknown, known, client=client, output="jax",
                          out=str(tmp_path / "jac.zarr"))
    assert not (tmp_path / "jac.zarr").exists()
    with pytest.raises(batchjac.InputError, match=r"`output` must be one of"):
        batchjac.jacobian(model, unknown, known, client=client, output="cupy")


def test_model_is_compiled_once_per_worker(client: Any) -> None:
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 4000, seed=5)
    def clear() -> None:  # runs on each worker, against that worker's module
        import batchjac._dask

        batchjac._dask._WORKER_MODELS.clear()

    client.run(clear)
    batchjac.jacobian(model, unknown, known, client=client, rows_per_task=250, mode="reverse")

    def loaded_and_traced() -> tuple[int, int]:
        import batchjac._dask
        from batchjac import _backends

        models = list(batchjac._dask._WORKER_MODELS.values())
        return len(models), sum(b.trace_count for m in models for b in _backends._bound.get(m, {}).values())

    per_worker = client.run(loaded_and_traced)
    # 16 tasks over 2 workers: each worker unpickled the model once and compiled once (the
    # TensorFlow kernel traces twice, once with XLA and once as a plain graph, then keeps one)
    assert sum(n for n, _ in per_worker.values()) >= 1
    assert all(n <= 1 and traces <= 2 for n, traces in per_worker.values()), per_worker


def test_worker_killed_mid_run_loses_nothing(client: Any) -> None:
    model = workload_model("W2", "tensorflow")
    x, _ = workload_inputs("W2", 6000, seed=6)
    victim = next(iter(client.run(os.getpid).values()))

    def finished_blocks(dask_scheduler: Any) -> int:
        return sum(ts.state == "memory" and "_block" in str(ts.key) for ts in dask_scheduler.tasks.values())

    returned = threading.Event()
    at_kill: dict[str, Any] = {}

    def kill_mid_run() -> None:  # once a few blocks are done, SIGKILL one worker process
        deadline = time.time() + 60
        while (done := client.run_on_scheduler(finished_blocks)) < 3 and time.time() < deadline:
            time.sleep(0.05)
        at_kill.update(done=done, returned=returned.is_set())
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_mid_run)
    killer.start()
    remote = batchjac.jacobian(model, x, client=client, rows_per_task=200)
    returned.set()
    killer.join()
    # the kill landed mid-run: some of the 30 blocks were done, the call had not returned
    assert not at_kill["returned"], at_kill
    assert 3 <= at_kill["done"] < 30, at_kill
    assert_jac_close(remote, closed_form("W2", x)[1], dtype=np.float32)
    client.wait_for_workers(2, timeout=60)  # the nanny restarted it
    assert victim not in client.run(os.getpid).values()  # it really died


def test_workers_write_the_store(client: Any, tmp_path: Any) -> None:
    import zarr

    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 5000, seed=7)
    res = batchjac.jacobian(model, unknown, known, out=str(tmp_path / "d.zarr"), chunk_size=1000,
                            client=client, return_outputs=True)
    assert (res.computed_chunks, res.resumed_chunks) == (5, 0)
    stored = zarr.open_group(str(tmp_path / "d.zarr"), mode="r")
    y, jac = closed_form("W1", unknown, known)
    assert_jac_close(stored["jacobians"][:], jac, dtype=np.float32)
    assert_outputs_close(stored["outputs"][:], y)
    # the same job again: nothing to do
    again = batchjac.jacobian(model, unknown, known, out=str(tmp_path / "d.zarr"), chunk_size=1000,
                              client=client, return_outputs=True)
    assert again.computed_chunks == 0


def test_a_cancelled_chunk_task_is_submitted_again(client: Any, tmp_path: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler may drop a task ("cancelled ... already forgotten", seen once on a
    starved machine): the store run submits that chunk once more instead of failing."""
    import zarr

    submit, cancelled = client.submit, []

    def cancel_the_first(*args: Any, **kwargs: Any) -> Any:
        fut = submit(*args, **kwargs)
        if not cancelled:
            cancelled.append(fut.key)
            client.cancel(fut)
        return fut

    monkeypatch.setattr(client, "submit", cancel_the_first)
    unknown, known = workload_inputs("W1", 1000, seed=9)
    res = batchjac.jacobian(seed_model("tensorflow"), unknown, known, out=str(tmp_path / "c.zarr"),
                            chunk_size=250, client=client)
    assert len(cancelled) == 1
    assert (res.computed_chunks, res.resumed_chunks) == (4, 0)
    stored = zarr.open_group(str(tmp_path / "c.zarr"), mode="r")["jacobians"][:]
    assert_jac_close(stored, closed_form("W1", unknown, known)[1], dtype=np.float32)


def test_interrupted_cluster_run_resumes(client: Any, tmp_path: Any) -> None:
    import subprocess
    import sys
    import textwrap

    x, _ = workload_inputs("W2", 4000, seed=8)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "j.zarr"
    script = textwrap.dedent(f"""
        import numpy as np, batchjac
        from dask.distributed import Client
        from batchjac.examples import workload_model
        client = Client({client.scheduler.address!r})
        x = np.load({str(tmp_path / "x.npy")!r})
        batchjac.jacobian(workload_model("W2", "tensorflow"), x, out={str(out)!r}, chunk_size=100,
                          client=client, rows_per_task=100)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done_dir = tmp_path / "j.zarr.partial" / "done"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if done_dir.exists() and len(list(done_dir.glob("*.json"))) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the driving process ended by itself (exit {proc.returncode})"
    proc.kill()  # SIGKILL the process that drove the run, mid-run
    assert proc.wait() == -signal.SIGKILL
    assert not out.exists(), "the run finished before it could be interrupted"
    model = workload_model("W2", "tensorflow")
    res = batchjac.jacobian(model, x, out=str(out), chunk_size=100, client=client)
    # the kill landed mid-run: some chunks were kept, some were left to compute
    assert res.resumed_chunks >= 3
    assert res.computed_chunks > 0
    assert res.resumed_chunks + res.computed_chunks == 40
    import zarr

    stored = zarr.open_group(str(out), mode="r")["jacobians"][:]
    assert_jac_close(stored, closed_form("W2", x)[1], dtype=np.float32)


def test_cli_compute_on_a_scheduler(client: Any, tmp_path: Any) -> None:
    import zarr
    from click.testing import CliRunner

    from batchjac.cli import cli

    model = seed_model("tensorflow")
    model.save(tmp_path / "m.keras")
    unknown, known = workload_inputs("W1", 3000, seed=9)
    np.save(tmp_path / "u.npy", unknown)
    np.save(tmp_path / "h.npy", known)
    result = CliRunner().invoke(cli, [
        "compute", str(tmp_path / "m.keras"), "--inputs", str(tmp_path / "u.npy"), "--known",
        str(tmp_path / "h.npy"), "--out", str(tmp_path / "j.zarr"), "--chunk-size", "500", "--quiet",
        "--scheduler", client.scheduler.address])
    assert result.exit_code == 0, result.output
    stored = zarr.open_group(str(tmp_path / "j.zarr"), mode="r")["jacobians"][:]
    assert_jac_close(stored, closed_form("W1", unknown, known)[1], dtype=np.float32)


def test_asked_mode_is_refused_on_the_workers_too(client: Any, tmp_path: Any) -> None:
    """mode="forward" for a torch model without forward mode, into a store on the cluster: the
    workers computed reverse mode without a word (the caller's "mode asked" did not travel to
    them); now they refuse, as the local path does, and no unfinished store is left."""
    pytest.importorskip("torch")
    from .test_fallbacks import cube_sin_reference, data, torch_cube_model

    model = torch_cube_model()
    x = data((40, 3), seed=213)
    with pytest.raises(batchjac.ModelError, match=r"Forward mode failed.*mode='reverse'"):
        batchjac.jacobian(model, x, mode="forward", out=str(tmp_path / "j.zarr"), chunk_size=10,
                          client=client)
    assert not (tmp_path / "j.zarr").exists()
    assert not (tmp_path / "j.zarr.partial").exists()
    res = batchjac.jacobian(model, x, mode="reverse", out=str(tmp_path / "j.zarr"), chunk_size=10,
                            client=client)
    np.testing.assert_allclose(np.asarray(res.open()), cube_sin_reference(x), rtol=1e-5, atol=1e-6)



def test_scheduler_local_n_starts_and_closes_its_own_cluster(tmp_path: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``scheduler="local:N"`` and ``--scheduler local:N``: a cluster of N single-threaded worker
    processes for the call, closed after it."""
    import zarr
    from click.testing import CliRunner

    import batchjac._dask
    from batchjac.cli import cli

    made: list[Any] = []
    make = batchjac._dask.make_client

    def recording(scheduler: str) -> Any:
        c = make(scheduler)
        made.append((c, c.cluster, c.nthreads()))
        return c

    monkeypatch.setattr(batchjac._dask, "make_client", recording)
    unknown, known = workload_inputs("W1", 600, seed=12)
    jac = batchjac.jacobian(seed_model("tensorflow"), unknown, known, scheduler="local:1", rows_per_task=200)
    assert_jac_close(jac, closed_form("W1", unknown, known)[1], dtype=np.float32)
    (own, cluster, nthreads), = made
    assert list(nthreads.values()) == [1]  # local:1 = one worker process of one thread
    assert own.status == "closed"
    assert cluster.status.name == "closed"
    seed_model("tensorflow").save(tmp_path / "m.keras")
    np.save(tmp_path / "u.npy", unknown)
    np.save(tmp_path / "h.npy", known)
    result = CliRunner().invoke(cli, [
        "compute", str(tmp_path / "m.keras"), "-i", str(tmp_path / "u.npy"), "-k", str(tmp_path / "h.npy"),
        "-o", str(tmp_path / "j.zarr"), "--chunk-size", "200", "--quiet", "--scheduler", "local:1"])
    assert result.exit_code == 0, result.output
    stored = zarr.open_group(str(tmp_path / "j.zarr"), mode="r")["jacobians"][:]
    assert_jac_close(stored, closed_form("W1", unknown, known)[1], dtype=np.float32)
    assert len(made) == 2
    assert made[1][1].status.name == "closed"


@pytest.mark.parametrize("bad", ["local:0", "local:x", "local:-2"])
def test_scheduler_local_needs_a_worker_count(bad: str) -> None:
    unknown, known = workload_inputs("W1", 10, seed=13)
    with pytest.raises(batchjac.InputError, match=rf"'local:N' needs a worker count N >= 1; got '{bad}'"):
        batchjac.jacobian(seed_model("tensorflow"), unknown, known, scheduler=bad)


def test_workers_write_second_order_stores(client: Any, tmp_path: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """hessian/laplacian with out= on the cluster: the workers compute and write the chunks
    through the store's resume protocol; Hessians equal float64 central differences of the
    analytic Jacobian, the Laplacian of sum(sin x) its closed form; the same job again has
    nothing to do."""
    import zarr

    torch = pytest.importorskip("torch")
    from .helpers import central_differences

    tasks = _submitted(client, monkeypatch)
    unknown, known = (a.astype(np.float64) for a in workload_inputs("W1", 600, seed=11))
    path = str(tmp_path / "h.zarr")
    res = batchjac.hessian(seed_model("torch"), unknown, known, out=path, chunk_size=200,
                           client=client, return_outputs=True, return_jacobian=True)
    assert (res.computed_chunks, res.resumed_chunks) == (3, 0)
    assert tasks == ["_store_task"] * 3  # the workers computed and wrote the chunks
    stored = zarr.open_group(path, mode="r")
    layers = mlp_weights(WORKLOADS["W1"].sizes)
    want = central_differences(
        lambda u: mlp_jacobian(layers, np.concatenate([u, known], 1))[..., :5], unknown)
    scale = np.abs(want).max()
    assert np.abs(stored["hessians"][:] - want).max() / scale < 1e-5  # (float32 weights)
    y, jac = closed_form("W1", unknown, known)
    np.testing.assert_allclose(stored["jacobians"][:], jac, rtol=1e-4, atol=1e-5 * np.abs(jac).max())
    np.testing.assert_allclose(stored["outputs"][:], y, rtol=1e-4, atol=1e-5 * np.abs(y).max())
    again = batchjac.hessian(seed_model("torch"), unknown, known, out=path, chunk_size=200,
                             client=client, return_outputs=True, return_jacobian=True)
    assert again.computed_chunks == 0

    x = np.random.default_rng(12).normal(size=(300, 3)) * 2
    lap = batchjac.laplacian(lambda z: torch.sin(z).sum(-1), x, out=str(tmp_path / "l.zarr"),
                             chunk_size=100, client=client, backend="torch")
    assert lap.computed_chunks == 3
    np.testing.assert_allclose(lap.open(), -np.sin(x).sum(-1), rtol=1e-12, atol=1e-12)


def test_hvp_on_the_cluster_splits_the_inputs_and_v_alike(client: Any) -> None:
    """hvp on Dask: the rows of the inputs and of ``v`` go to the same blocks (numpy in: numpy
    out, gathered; Dask arrays in: a lazy result; torch in: torch out), against the closed form
    of ``y_m = sin(a_m . x)``: ``(H v)_m = -sin(a_m . x) a_m (a_m . v)``."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(71)
    a = rng.normal(size=(3, 4))
    lin = torch.nn.Linear(4, 3, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(a))
    model = torch.nn.Sequential(lin).eval()

    def f(x: Any) -> Any:
        return torch.sin(model(x))

    x, v = rng.normal(size=(500, 4)), rng.normal(size=(500, 4))
    want = -np.sin(x @ a.T)[:, :, None] * a[None] * (v @ a.T)[:, :, None]
    got = batchjac.hvp(f, x, v=v, client=client, rows_per_task=120)
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    lazy = batchjac.hvp(f, da.from_array(x, chunks=(200, 4)), v=da.from_array(v, chunks=(150, 4)),
                        client=client)
    assert isinstance(lazy, da.Array)
    np.testing.assert_allclose(client.compute(lazy, sync=True), want, rtol=1e-10, atol=1e-12)
    native = batchjac.hvp(f, torch.from_numpy(x), v=torch.from_numpy(v), client=client,
                          rows_per_task=250)
    assert isinstance(native, torch.Tensor)
    np.testing.assert_allclose(native.numpy(), want, rtol=1e-10, atol=1e-12)
    with pytest.raises(batchjac.InputError, match=r"On Dask, hvp\(\) computes in memory"):
        batchjac.hvp(f, x, v=v, client=client, out=np.empty_like(want))
    # hessian with its Jacobian, gathered in memory: a tuple of the same parts, in order
    jac, hess = batchjac.hessian(f, x, client=client, rows_per_task=200, return_jacobian=True)
    np.testing.assert_allclose(jac, np.cos(x @ a.T)[:, :, None] * a[None], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(hess, -np.sin(x @ a.T)[:, :, None, None] * a[None, :, :, None]
                               * a[None, :, None, :], rtol=1e-10, atol=1e-12)


def test_products_on_the_cluster_split_the_inputs_and_directions_alike(client: Any) -> None:
    """jvp, vjp and the exact divergence on Dask (issue 38): the rows of the inputs and of the
    directions in the same blocks, numpy in: numpy out; Dask arrays in: a lazy result; against
    the closed form of ``y = sin(x A^T)``: ``J = cos(x A^T) A``."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(72)
    a = rng.normal(size=(4, 4))
    at = torch.from_numpy(a)

    def f(x: Any) -> Any:
        return torch.sin(x @ at.T)

    x, v, c = (rng.normal(size=(300, 4)) for _ in range(3))
    jac = np.cos(x @ a.T)[:, :, None] * a[None]
    got = batchjac.jvp(f, x, tangents=v, client=client, rows_per_task=70)
    np.testing.assert_allclose(got, np.einsum("nmk,nk->nm", jac, v), rtol=1e-10, atol=1e-12)
    lazy = batchjac.vjp(f, da.from_array(x, chunks=(100, 4)),
                        cotangents=da.from_array(c, chunks=(120, 4)), client=client)
    assert isinstance(lazy, da.Array)
    np.testing.assert_allclose(client.compute(lazy, sync=True), np.einsum("nm,nmk->nk", c, jac),
                               rtol=1e-10, atol=1e-12)
    div = batchjac.divergence(f, x, client=client, rows_per_task=100)
    np.testing.assert_allclose(div, np.trace(jac, axis1=1, axis2=2), rtol=1e-10, atol=1e-12)
    # the estimates on Dask: each block draws its own instances' probes, so they equal the
    # local call's, whatever the blocks; numpy in, and Dask arrays in (lazy value and stderr)
    for estimator in ("hutchinson", "hutch++"):
        here = batchjac.divergence(f, x, estimator=estimator, samples=6, seed=3)
        there = batchjac.divergence(f, x, client=client, rows_per_task=70, estimator=estimator,
                                    samples=6, seed=3)
        assert isinstance(there, batchjac.TraceEstimate)
        np.testing.assert_allclose(there.value, here.value, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(there.stderr, here.stderr, rtol=1e-10, atol=1e-12)
    y, lazy_est = batchjac.divergence(f, da.from_array(x, chunks=(110, 4)), client=client,
                                      estimator="hutchinson", samples=6, seed=3,
                                      return_outputs=True)
    assert isinstance(lazy_est.value, da.Array)
    np.testing.assert_allclose(client.compute(lazy_est.value, sync=True),
                               batchjac.divergence(f, x, estimator="hutchinson", samples=6,
                                                   seed=3).value, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(client.compute(y, sync=True), np.sin(x @ a.T), rtol=1e-12)
    # the Laplacian's and the diagonal's estimates likewise
    for kw in ({"laplacian": True, "estimator": "hutch++"},
               {"diagonal": True, "estimator": "hutchinson"}):
        here = batchjac.hessian(f, x, samples=6, seed=5, **kw)
        there = batchjac.hessian(f, x, samples=6, seed=5, client=client, rows_per_task=80, **kw)
        assert np.asarray(there.value).shape == np.asarray(here.value).shape
        np.testing.assert_allclose(there.value, here.value, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(there.stderr, here.stderr, rtol=1e-9, atol=1e-12)


def test_workers_write_product_stores(client: Any, tmp_path: Any,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """jvp, vjp (directions pushed, and many cotangents through each chunk's Jacobians) and the
    divergence (exact and estimated) into stores on the cluster: the workers compute and
    write each chunk with the directions of its rows; the products equal the float64 closed
    form, the estimate the local store's, and a store begun locally is finished on the
    cluster with only its missing chunks computed there."""
    import zarr

    torch = pytest.importorskip("torch")
    tasks = _submitted(client, monkeypatch)
    rng = np.random.default_rng(91)
    a = rng.normal(size=(4, 4)) / 2
    lin = torch.nn.Linear(4, 4, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(a))

    def f(x: Any) -> Any:  # y = sin(x A^T): J = diag(cos(x A^T)) A
        return torch.sin(lin(x))

    x = rng.normal(size=(300, 4))
    jac = np.cos(x @ a.T)[:, :, None] * a[None]
    v = rng.normal(size=(300, 2, 4))
    c = rng.normal(size=(300, 16, 4))  # (16 >= FORM_J * 4: through each chunk's Jacobians)
    res = batchjac.jvp(f, x, tangents=v, out=str(tmp_path / "jv.zarr"), chunk_size=100,
                       client=client, return_outputs=True)
    assert (res.computed_chunks, tasks) == (3, ["_store_task"] * 3)
    stored = zarr.open_group(str(tmp_path / "jv.zarr"), mode="r")
    np.testing.assert_allclose(stored["jvps"][:], np.einsum("nmk,ndk->ndm", jac, v), rtol=1e-10,
                               atol=1e-12)
    np.testing.assert_allclose(stored["outputs"][:], np.sin(x @ a.T), rtol=1e-12)
    cj = batchjac.vjp(f, x, cotangents=c, out=str(tmp_path / "vj.zarr"), chunk_size=100,
                      client=client)
    assert cj.mode == "forward"  # (through each chunk's Jacobians, in forward mode: k = m)
    np.testing.assert_allclose(cj.open(), np.einsum("nmk,ndm->ndk", jac, c), rtol=1e-10,
                               atol=1e-12)
    div = batchjac.divergence(f, x, out=str(tmp_path / "d.zarr"), chunk_size=100, client=client)
    np.testing.assert_allclose(div.open(), np.trace(jac, axis1=1, axis2=2), rtol=1e-10,
                               atol=1e-12)
    # an estimate begun here (stopped after one chunk), finished on the cluster: the probes
    # are the instances', so the store equals the one made here whole
    kw = {"estimator": "hutchinson", "samples": 8, "seed": 3, "chunk_size": 100}
    local = batchjac.divergence(f, x, out=str(tmp_path / "e0.zarr"), **kw)

    def stop(rows: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        batchjac.divergence(f, x, out=str(tmp_path / "e.zarr"), progress=stop, **kw)
    del tasks[:]
    est = batchjac.divergence(f, x, out=str(tmp_path / "e.zarr"), client=client, **kw)
    assert (est.resumed_chunks, est.computed_chunks, tasks) == (1, 2, ["_store_task"] * 2)
    assert np.array_equal(np.asarray(est.open()), np.asarray(local.open()))


def test_workers_write_estimate_stores(client: Any, tmp_path: Any,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The Laplacian's and the Hessian diagonal's estimates into stores on the cluster: each
    chunk's probes are its instances', so the workers' store equals the one made here, and
    a store begun here is finished there with only its missing chunks computed."""
    torch = pytest.importorskip("torch")
    tasks = _submitted(client, monkeypatch)

    def f(x: Any) -> Any:  # Laplacian -sum sin x, Hessian diagonal -sin x
        return torch.sin(x).sum(-1)

    x = np.random.default_rng(92).normal(size=(300, 5))
    kw = {"estimator": "hutchinson", "samples": 6, "seed": 2, "chunk_size": 100,
          "backend": "torch"}
    for name, verb in (("lap", batchjac.laplacian),
                       ("diag", lambda *a, **o: batchjac.hessian(*a, diagonal=True, **o))):
        local = verb(f, x, out=str(tmp_path / f"{name}0.zarr"), **kw)

        def stop(rows: int) -> None:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            verb(f, x, out=str(tmp_path / f"{name}.zarr"), progress=stop, **kw)
        del tasks[:]
        remote = verb(f, x, out=str(tmp_path / f"{name}.zarr"), client=client, **kw)
        assert (remote.resumed_chunks, remote.computed_chunks) == (1, 2)
        assert tasks == ["_store_task"] * 2
        got, want = np.asarray(remote.open()), np.asarray(local.open())
        assert got.shape == want.shape == ((300, 2) if name == "lap" else (300, 5, 2))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # the diagonal estimator is exact for a diagonal Hessian (v * Hv = diag H for +-1 probes)
    np.testing.assert_allclose(got[..., 0], -np.sin(x), rtol=1e-12, atol=1e-12)
