"""Scale out on Dask: the same ``jacobian`` call, one task per block of rows.

- Dask arrays in → a lazy Dask array of Jacobians out, with the inputs' row chunks.
- numpy arrays with ``client=`` → computed on the cluster, numpy out.
- The model reaches each worker once: it is scattered (broadcast) once and every task takes
  the same future, so each worker deserialises one model object; batchjac's per-model cache then
  compiles once per worker and chunk shape (every block runs with the same chunk size).

This module sees numpy and Dask only; the model stays an opaque object.
"""

from __future__ import annotations

import math
import os
import pickle
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._errors import InputError

#: environment for worker processes: one thread each, so N workers use N cores
SINGLE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


def is_dask_array(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "dask" and hasattr(x, "chunks")


def uses_dask(inputs: Sequence[Any]) -> bool:
    for x in inputs:
        items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else [x]
        if any(is_dask_array(a) for a in items):
            return True
    return False


def make_client(scheduler: str) -> Any:
    """``local:N`` starts a local cluster of N single-threaded worker processes; anything else
    is the address of a running scheduler."""
    from dask.distributed import Client, LocalCluster

    if scheduler.startswith("local:"):
        try:
            n = int(scheduler.split(":", 1)[1])
        except ValueError:
            n = 0
        if n < 1:
            raise InputError(f"`scheduler` 'local:N' needs a worker count N >= 1; got {scheduler!r}.")
        os.environ.update({k: v for k, v in SINGLE_THREAD_ENV.items() if k not in os.environ})
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                               dashboard_address=None, env=SINGLE_THREAD_ENV)
        return Client(cluster)
    return Client(scheduler)


def _flatten(inputs: tuple[Any, ...]) -> tuple[str, list[Any], tuple[str, ...] | None]:
    if len(inputs) == 2:
        return "pair", list(inputs), None
    if len(inputs) != 1:
        raise InputError(f"jacobian() got {len(inputs)} input arrays; see the call forms in its docstring.")
    x = inputs[0]
    if isinstance(x, dict):
        return "dict", list(x.values()), tuple(x.keys())
    if isinstance(x, (tuple, list)) and all(hasattr(a, "shape") for a in x):
        return "tuple", list(x), None
    return "single", [x], None


def _pack(form: str, keys: tuple[str, ...] | None, blocks: Sequence[Any]) -> tuple[Any, ...]:
    if form == "pair":
        return tuple(blocks)
    if form == "dict":
        assert keys is not None
        return (dict(zip(keys, blocks)),)
    if form == "tuple":
        return (tuple(blocks),)
    return (blocks[0],)


class ModelRef:
    """The model, pickled once on the client (cloudpickle: closures and lambdas too).

    Scattered to every worker once; each worker unpickles it once and keeps the object in
    ``_WORKER_MODELS``, so batchjac's per-model caches (probes, compiled kernels) persist
    across that worker's tasks. (Also sidesteps distributed's legacy Keras serializer, which
    fails on Keras 3 models.)
    """

    def __init__(self, model: Any) -> None:
        import cloudpickle

        self.token = uuid.uuid4().hex
        self.payload = cloudpickle.dumps(model)

    def load(self) -> Any:
        with _LOCK:
            if self.token not in _WORKER_MODELS:
                _WORKER_MODELS[self.token] = pickle.loads(self.payload)
            return _WORKER_MODELS[self.token]


_WORKER_MODELS: dict[str, Any] = {}
_LOCK = threading.Lock()


def _block(model: Any, form: str, keys: tuple[str, ...] | None, kw: dict[str, Any], *blocks: Any) -> Any:
    from ._jacobian import jacobian

    if isinstance(model, ModelRef):
        model = model.load()
    return jacobian(model, *_pack(form, keys, [np.asarray(b) for b in blocks]), **kw)


def dask_jacobian(model: Any, inputs: tuple[Any, ...], *, client: Any, rows_per_task: int | None,
                  return_outputs: bool, kw: dict[str, Any]) -> Any:
    """The Dask path of :func:`batchjac.jacobian` (``kw`` holds its other options)."""
    import dask
    import dask.array as da

    from ._jacobian import jacobian

    form, arrays, keys = _flatten(inputs)
    lazy = any(is_dask_array(a) for a in arrays)
    n = int(arrays[0].shape[0])
    for a in arrays[1:]:
        if int(a.shape[0]) != n:
            raise InputError(f"The inputs have different row counts ({n} and {a.shape[0]}); "
                             f"they must have one row per instance.")
    if lazy:
        first = next(a for a in arrays if is_dask_array(a))
        row_chunks = tuple(int(c) for c in first.chunks[0])
    else:
        if client is None:
            raise InputError("Without Dask arrays, the Dask path needs `client=` or `scheduler=`.")
        workers = max(1, len(client.scheduler_info().get("workers", {})))
        size = rows_per_task or max(1, math.ceil(n / (4 * workers)))
        row_chunks = tuple(min(size, n - lo) for lo in range(0, n, size)) or (0,)
    darrs = [
        (a.rechunk({0: row_chunks, **{i: -1 for i in range(1, a.ndim)}}) if is_dask_array(a)
         else da.from_array(np.asarray(a), chunks=(row_chunks,) + tuple(-1 for _ in a.shape[1:])))
        for a in arrays
    ]

    # Validate and learn the output shape on the client, from two rows (also runs the probes).
    head = [np.asarray(d[: min(n, 2)].compute()) for d in darrs]
    y_head, j_head = jacobian(model, *_pack(form, keys, head), return_outputs=True, **kw)
    y_tail, j_tail = y_head.shape[1:], j_head.shape[1:]

    if client is not None:
        model_ref: Any = client.scatter(ModelRef(model), broadcast=True, hash=False)
    else:
        model_ref = model
    block_kw = {**kw, "return_outputs": return_outputs, "chunk_size": kw.get("chunk_size") or max(row_chunks)}
    ys, js = [], []
    for i, rows in enumerate(row_chunks):
        task = dask.delayed(_block, pure=True)(model_ref, form, keys, block_kw, *[d.blocks[i] for d in darrs])
        if return_outputs:
            ys.append(da.from_delayed(task[0], shape=(rows, *y_tail), dtype=y_head.dtype))
            js.append(da.from_delayed(task[1], shape=(rows, *j_tail), dtype=j_head.dtype))
        else:
            js.append(da.from_delayed(task, shape=(rows, *j_tail), dtype=j_head.dtype))
    jac = da.concatenate(js, axis=0)
    result: Any = (da.concatenate(ys, axis=0), jac) if return_outputs else jac
    if lazy:
        return result
    computed = client.compute(result).result()
    return tuple(np.asarray(r) for r in computed) if return_outputs else np.asarray(computed)
