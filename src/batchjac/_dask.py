"""Scale out on Dask: the same ``jacobian`` call, one task per block of rows.

- Dask arrays in → a lazy Dask array of Jacobians out, with the inputs' row chunks.
- numpy arrays with ``client=`` → computed on the cluster, numpy out; a framework's arrays
  (torch tensors, JAX arrays, TensorFlow tensors) → read to the host once, computed there,
  and the result in their kind, on their device (``output=`` overrides, see :func:`run`).
- The model reaches each worker once: it is scattered (broadcast) once and every task takes
  the same future, so each worker deserialises one model object; batchjac's per-model cache then
  compiles once per worker and chunk shape (every block runs with the same chunk size).

This module sees numpy and Dask only (a framework's arrays go through
:mod:`batchjac._arrays`); the model stays an opaque object.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError
from typing import Any

import numpy as np

from ._arrays import deliver, kind_of, on_host, ops_of
from ._errors import BatchJacError, InputError

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


def row_count(inputs: tuple[Any, ...]) -> int:
    """The instances of the inputs (their first array's rows)."""
    return int(_flatten(inputs)[1][0].shape[0])


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


def _block(compute: Callable[..., Any], model: Any, form: str, keys: tuple[str, ...] | None,
           kw: dict[str, Any], names: tuple[str, ...], *blocks: Any) -> Any:
    """One task: ``compute`` (``batchjac.jacobian``, pickled by reference) on one block of rows;
    the last ``len(names)`` blocks are per-row keyword arrays of the verb (``hvp``'s ``v``)."""
    if isinstance(model, ModelRef):
        model = model.load()
    arrays = [np.asarray(b) for b in blocks]
    cut = len(arrays) - len(names)
    return compute(model, *_pack(form, keys, arrays[:cut]), **kw, **dict(zip(names, arrays[cut:])))


def dask_jacobian(compute: Callable[..., Any], model: Any, inputs: tuple[Any, ...], *, client: Any,
                  rows_per_task: int | None, return_outputs: bool, kw: dict[str, Any],
                  rows_kw: dict[str, Any] | None = None) -> Any:
    """The Dask path of :func:`batchjac.jacobian` (``kw`` holds its other options); ``compute``
    is the in-memory verb each task runs on its block (handed in: this module sits below it).
    ``rows_kw``: keyword arrays of the verb with one row per instance (``hvp``'s ``v``), split
    into the blocks as the inputs are."""
    import dask
    import dask.array as da

    jacobian = compute
    form, arrays, keys = _flatten(inputs)
    names = tuple(rows_kw or ())
    arrays = [*arrays, *(rows_kw or {}).values()]
    cut = len(arrays) - len(names)
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
    # Validate and learn the results' shapes on the client, from two rows (also runs the
    # probes): an array, or a tuple of them (outputs, Jacobians, Hessians...), one row each
    head = [np.asarray(a[: min(n, 2)]) if not is_dask_array(a) else np.asarray(a[: min(n, 2)].compute())
            for a in arrays]
    sample = jacobian(model, *_pack(form, keys, head[:cut]), return_outputs=return_outputs, **kw,
                      **dict(zip(names, head[cut:])))
    several = isinstance(sample, tuple)
    heads = sample if several else (sample,)
    tails = [(h.shape[1:], h.dtype) for h in heads]
    block_kw = {**kw, "return_outputs": return_outputs, "chunk_size": kw.get("chunk_size") or max(row_chunks)}
    bounds = list(zip(np.cumsum((0, *row_chunks[:-1])).tolist(), np.cumsum(row_chunks).tolist()))

    def joined(parts: list[Any], concat: Callable[[list[Any]], Any]) -> Any:
        if not several:
            return concat(parts)
        return tuple(concat([p[i] for p in parts]) for i in range(len(tails)))

    if not lazy:  # numpy in: one task per block, numpy out
        ref = client.scatter(ModelRef(model), broadcast=True, hash=False)
        futures = []
        for lo, hi in bounds:
            # the block travels inside its task (not scattered): if the worker holding it dies,
            # the scheduler still has it and reruns the task elsewhere
            blocks = [np.ascontiguousarray(a[lo:hi]) for a in arrays]
            futures.append(client.submit(_block, compute, ref, form, keys, block_kw, names, *blocks,
                                         pure=False, retries=2))
        return joined(client.gather(futures), np.concatenate)

    model_ref: Any = model if client is None else client.scatter(ModelRef(model), broadcast=True, hash=False)
    darrs = [a.rechunk({0: row_chunks, **dict.fromkeys(range(1, a.ndim), -1)}) if is_dask_array(a)
             else da.from_array(np.asarray(a), chunks=(row_chunks, *(-1 for _ in a.shape[1:])))
             for a in arrays]
    lazies = []
    for i, rows in enumerate(row_chunks):
        task = dask.delayed(_block, pure=True)(compute, model_ref, form, keys, block_kw, names,
                                               *[d.blocks[i] for d in darrs])
        parts = [task[j] for j in range(len(tails))] if several else [task]
        one = [da.from_delayed(t, shape=(rows, *tail), dtype=dtype)
               for t, (tail, dtype) in zip(parts, tails)]
        lazies.append(tuple(one) if several else one[0])
    return joined(lazies, lambda xs: da.concatenate(xs, axis=0))


def _store_task(ref: ModelRef, backend: str, options: dict[str, Any], layout: Any, dtype: Any,
                unknown_shape: tuple[int, ...], names: tuple[str, ...], rows: list[np.ndarray],
                tangents: np.ndarray | None, index: int, lo: int, hi: int,
                kernel_of: Callable[[Any, dict[str, Any]], Any], plan: dict[str, Any], fmt: Any,
                out: str, arrays: list[Any]) -> dict[str, Any]:
    """On a worker: compute one chunk with the kernel ``kernel_of(bound, plan)`` makes (the
    same recipe the local loop runs: :func:`jacobian_kernel`, :func:`second_kernel`, a
    product's), then save it into the store's data (write, fsync, record) with the one
    function that saves a unit (``_stores.save_chunk``): the same steps, hashes and records as
    the local path. ``tangents``: the chunk's directions, where the store's batch carries them
    after its arrays (:class:`batchjac._spec.TangentSpec`: a Hessian-vector product's, a
    product's, an estimate's probes)."""
    from ._bind import prepare
    from ._runner import Chunk, call, pad_args
    from ._spec import BatchSpec, TangentSpec
    from ._stores import Unit, hash_arrays, save_chunk_at

    spec = BatchSpec(arrays=rows, layout=layout, dtype=dtype, n=hi - lo, unknown_shape=unknown_shape,
                     names=names)
    bound = prepare(ref.load(), spec, backend, options)
    if tangents is not None:
        spec = TangentSpec.of(spec, tangents)
    u, ctx = spec.chunk(0, hi - lo)
    chunk_size = int(plan["chunk_size"])
    out_ = call(kernel_of(bound, plan), *pad_args(u, ctx, chunk_size), Chunk(index, lo, hi),
                rows=hi - lo)
    return save_chunk_at(fmt, out, arrays, index, lo, hi, Unit(out_, hash_arrays([u, *ctx])))


def jacobian_kernel(bound: Any, plan: dict[str, Any], *, with_outputs: bool,
                    asked: bool = False) -> Any:
    """A Jacobian store's kernel: the plan's mode, chunk size and recorded build. ``asked``: the
    call asked for the mode, which the kernel then computes or refuses, never swaps."""
    from ._backends import CallBudget, under

    budget = CallBudget(mode_asked=asked)
    return under(bound.kernel(plan["mode"], plan["chunk_size"], with_outputs,
                              variant=plan.get("variant"), budget=budget), budget)


def second_kernel(bound: Any, plan: dict[str, Any], *, kind: str, with_outputs: bool,
                  with_jacobian: bool) -> Any:
    """A second-order store's kernel (Hessians, their diagonal, the Laplacian): the plan's order
    and chunk size, its first build, as the local store's (same command, same bytes)."""
    kernel = bound.second_kernel(kind, plan["order"], plan["chunk_size"], with_outputs,
                                 with_jacobian)
    kernel.use(kernel.variants[0], "a store's kernel")
    return kernel


def store_chunks_on_cluster(client: Any, model: Any, backend: str, options: dict[str, Any],
                            bound: Any, spec: Any, with_outputs: bool, pending: Any, *,
                            second: tuple[str, bool] | None = None, asked: bool = False,
                            kernel_of: Callable[[Any, dict[str, Any]], Any] | None = None
                            ) -> None:
    """The store's chunk loop on a Dask cluster (``pending``: the store's chunks still to do,
    ``_stores.Pending``): workers compute and save the chunks; this process reads input rows
    (and the directions of a batch that carries them), keeps a bounded number of tasks in
    flight, and collects the records (which the workers have already written durably). The
    workers' kernel: ``kernel_of(bound, plan)`` (the local loop's recipe, a module-level
    function or one cloudpickle carries), else a Jacobian store's (:func:`jacobian_kernel`;
    ``asked``: the call asked for its mode) or, with ``second`` (``(kind, with_jacobian)``),
    a second-order store's (:func:`second_kernel`)."""
    import functools

    from dask.distributed import as_completed

    from ._errors import ModelError

    del bound  # workers bind their own copy
    ref = client.scatter(ModelRef(model), broadcast=True, hash=False)
    plan = pending.plan
    if kernel_of is None:
        kernel_of = functools.partial(jacobian_kernel, with_outputs=with_outputs, asked=asked) \
            if second is None else functools.partial(second_kernel, kind=second[0],
                                                     with_outputs=with_outputs,
                                                     with_jacobian=second[1])
    directions = getattr(spec, "tangents", None)
    workers = max(1, len(client.scheduler_info().get("workers", {})))
    window = 2 * workers  # enough to keep every worker busy, bounded input memory
    queue = list(pending.todo)
    index_of: dict[Any, int] = {}

    def submit(index: int) -> Any:
        lo, hi = pending.bounds(index)
        rows = [np.asarray(a[lo:hi]) for a in spec.arrays]
        t = None if directions is None else np.asarray(directions[lo:hi])
        fut = client.submit(_store_task, ref, backend, options, spec.layout, spec.dtype,
                            spec.unknown_shape, spec.names, rows, t, index, lo, hi, kernel_of,
                            plan, pending.format, str(pending.out), pending.arrays, pure=False,
                            retries=2)
        index_of[fut] = index
        return fut

    cancelled: set[int] = set()
    in_flight = as_completed([submit(queue.pop(0)) for _ in range(min(window, len(queue)))])
    for fut in in_flight:
        index = index_of.pop(fut)
        try:
            record = fut.result()
        except BatchJacError:
            raise
        except CancelledError:
            # the scheduler dropped the task (seen once on a starved machine: "already
            # forgotten"), not the chunk failing: submit it once more under a new key
            if index in cancelled:
                raise ModelError(f"Chunk {index} was cancelled on the cluster twice; the chunks "
                                 "done are kept: run the same call again to resume.") from None
            cancelled.add(index)
            in_flight.add(submit(index))
            continue
        except Exception as e:
            raise ModelError(f"Chunk {index} failed on the cluster: {type(e).__name__}: {e}") from e
        pending.finished(index, record)
        if queue:
            in_flight.add(submit(queue.pop(0)))


@contextlib.contextmanager
def client_for(client: Any, scheduler: str | None) -> Iterator[Any]:
    """``client``, or one made from ``scheduler`` for the call and closed after it."""
    if client is not None or scheduler is None:
        yield client
        return
    own = make_client(scheduler)
    try:
        yield own
    finally:
        cluster = getattr(own, "cluster", None)
        own.close()
        if cluster is not None and scheduler.startswith("local:"):
            cluster.close()


def run(compute: Callable[..., Any], model: Any, inputs: tuple[Any, ...], *, client: Any,
        rows_per_task: int | None, out: Any, kw: dict[str, Any], output: Any = "auto",
        rows_kw: dict[str, Any] | None = None) -> Any:
    """In-memory results on Dask (a lazy Dask array for Dask inputs; for other inputs, the
    gathered blocks in the inputs' array kind and device, or ``output=``'s, by the rule of
    :mod:`batchjac._arrays`: the workers compute on numpy blocks, so a framework's arrays are
    read to the host once here and the result handed back once, as :func:`~batchjac._arrays.
    on_host` says); ``compute`` is the verb each task runs on its block of rows. Stores on
    Dask go through :func:`store_chunks_on_cluster`, chosen by the caller."""
    if out is not None:
        raise InputError("On Dask, `out` must be a store path (e.g. 'jac.zarr') or None.")
    extra = tuple((rows_kw or {}).values())
    delivery = on_host((*inputs, *extra), output)
    if uses_dask((*inputs, *extra)) and delivery.kind != "numpy":
        raise InputError(
            f"`output={output!r}` with Dask arrays as inputs: the result is a lazy Dask array "
            f"(of numpy blocks). Pass output='auto', or compute it and convert the result, or "
            f"give {delivery.kind} arrays (not Dask arrays) with client= to get {delivery.kind} "
            f"arrays back.")
    kw = dict(kw)
    return_outputs = kw.pop("return_outputs", False)
    kw.pop("progress", None)
    host_kw = dict(zip(rows_kw or {}, host_inputs(extra)))
    return deliver(dask_jacobian(compute, model, host_inputs(inputs), client=client,
                                 rows_per_task=rows_per_task, return_outputs=return_outputs,
                                 kw=kw, rows_kw=host_kw), delivery)


def host_inputs(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``inputs`` with each framework array (a torch tensor, a JAX array, a TensorFlow tensor,
    on any device) read to the host once: the tasks' blocks are numpy."""
    def one(a: Any) -> Any:
        return a if kind_of(a) == "numpy" else ops_of(a).to_numpy(a)

    def each(x: Any) -> Any:
        if isinstance(x, dict):
            return {key: one(a) for key, a in x.items()}
        if isinstance(x, (tuple, list)) and all(hasattr(a, "shape") for a in x):
            return tuple(one(a) for a in x)
        return one(x)

    return tuple(each(x) for x in inputs)


def check_store_inputs(inputs: tuple[Any, ...], client: Any) -> None:
    """A store written on Dask takes numpy arrays or files (the workers write it)."""
    if uses_dask(inputs):
        raise InputError(
            "`out` is a store, but the inputs are Dask arrays: give numpy arrays or files "
            "(the workers write the store), or compute the lazy result yourself with "
            "da.to_zarr.")
    if client is None:
        raise InputError("Writing a store on Dask needs `client=` or `scheduler=`.")
