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
from batchjac.examples import seed_model, workload_inputs, workload_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    # distributed's own shutdown chatter (ports, nanny kills) is not under test
    "ignore::ResourceWarning",
    "ignore::DeprecationWarning",
    "ignore:.*Port .* is already in use.*:UserWarning",
)


@pytest.fixture(scope="module")
def client() -> Any:
    c = make_client("local:2")
    yield c
    c.close()
    c.cluster.close()


def test_numpy_inputs_with_client_equal_local(client: Any) -> None:
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 3000, seed=3)
    local = batchjac.jacobian(model, unknown, known)
    remote = batchjac.jacobian(model, unknown, known, client=client, rows_per_task=700)
    np.testing.assert_allclose(remote, local, rtol=1e-5, atol=1e-6)


def test_dask_arrays_give_lazy_result(client: Any) -> None:
    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 2500, seed=4)
    du, dk = da.from_array(unknown, chunks=600), da.from_array(known, chunks=600)
    y, jac = batchjac.jacobian(model, du, dk, client=client, return_outputs=True)
    assert isinstance(jac, da.Array)
    assert jac.chunks[0] == du.chunks[0]
    assert jac.shape == (2500, 4, 5)
    ly, lj = batchjac.jacobian(model, unknown, known, return_outputs=True)
    cy, cj = client.compute([y, jac], sync=True)
    np.testing.assert_allclose(cj, lj, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cy, ly, rtol=1e-5, atol=1e-6)


def test_model_is_compiled_once_per_worker(client: Any) -> None:
    from batchjac import _dask

    model = seed_model("tensorflow")
    unknown, known = workload_inputs("W1", 4000, seed=5)
    client.run(_dask._WORKER_MODELS.clear)
    batchjac.jacobian(model, unknown, known, client=client, rows_per_task=250, mode="reverse")

    def loaded_and_traced() -> tuple[int, int]:
        from batchjac import _backends

        models = list(_dask._WORKER_MODELS.values())
        return len(models), sum(b.trace_count for m in models for b in _backends._bound.get(m, {}).values())

    per_worker = client.run(loaded_and_traced)
    # 16 tasks over 2 workers: each worker unpickled the model once and compiled once
    assert sum(n for n, _ in per_worker.values()) >= 1
    assert all(n <= 1 and traces <= 1 for n, traces in per_worker.values()), per_worker


def test_worker_killed_mid_run_loses_nothing(client: Any) -> None:
    model = workload_model("W2", "tensorflow")
    x, _ = workload_inputs("W2", 6000, seed=6)
    local = batchjac.jacobian(model, x)
    pids = client.run(os.getpid)
    victim = next(iter(pids.values()))

    def kill_later() -> None:
        time.sleep(4.0)
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_later)
    killer.start()
    remote = batchjac.jacobian(model, x, client=client, rows_per_task=200)
    killer.join()
    assert victim not in client.run(os.getpid).values()  # the worker really died (and was replaced)
    np.testing.assert_allclose(remote, local, rtol=1e-5, atol=1e-6)
