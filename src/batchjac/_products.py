"""Products with the per-instance Jacobians: ``jvp`` (``J_i v_i``, tangents pushed forward) and
``vjp`` (``c_i^T J_i``, cotangents pulled back), which never form ``J``, and ``divergence``
(the trace of a square ``J_i``: exact, from a chunk of Jacobians at a time, or Hutchinson's
estimate, from probes pushed forward).

A product costs one forward-mode pass per direction (``jvp``) or one forward pass and one
backward pass per direction (``vjp``), and holds ``d`` results a row where the Jacobian holds
``k m``: on a GPU the bytes of J, not its arithmetic, bound the throughput. The rows go
through the bound model's backend in blocks of a fixed size (the last one padded, so a
compiled function is traced once), sized to the memory budget; each backend computes a block
in its ``products`` module (:meth:`batchjac._backends.BoundModel.product`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np

from ._arrays import OutputArg, deliver, on_host
from ._dask import uses_dask
from ._errors import BatchJacError, InputError, add_context
from ._estimators import (
    ESTIMATORS,
    WORKING_SET,
    EstimateKernel,
    Estimator,
    Paired,
    Probes,
    TraceEstimate,
    check as check_estimator,
    probes_per_row,
    run as run_estimate,
)
from ._evaluate import bind, budget, context, in_elems, output_size, reduce_jacobians
from ._loaders import as_model
from ._runner import results, run_chunks
from ._sinks import ArraySink
from ._spec import BatchSpec, TangentSpec
from ._validate import DTypeLike, NanPolicy, as_input, is_lazy, normalize, to_numpy

Kind = Literal["jvp", "vjp"]

#: most rows one block of a product call gets (fixed per call: one trace per shapes)
MAX_BLOCK = 16384
MIN_BLOCK = 16
#: directions a row at which the products go through each chunk's Jacobians: ``d`` passes
#: against ``min(k, m)`` passes and a product per row (docs/thresholds.md)
FORM_J = 3


def jvp(model: Any, *inputs: Any, tangents: Any, wrt: Any = None, **options: Any) -> Any:
    """Per-instance Jacobian-vector products ``J_i v_i``, without forming ``J``.

    ``inputs`` as for :func:`batchjac.jacobian` (``x``; ``unknown, known``; a dict with
    ``wrt``). ``tangents``: ``(N, *unknown_shape)``, one direction per instance, giving
    ``(N, *output_shape)``; or ``(N, d, *unknown_shape)``, ``d`` directions per instance, giving
    ``(N, d, *output_shape)``; on disk (a path, an ``np.memmap``, an h5py dataset, a Zarr
    array), they are read a chunk's rows at a time. One forward-mode pass per direction; where the directions
    outnumber ``min(k, m)`` three times, each chunk's Jacobians are formed instead (``min(k,
    m)`` passes) and multiplied by them.

    Options: ``dtype``, ``chunk_size`` (rows per block), ``max_memory``, ``return_outputs``
    (then ``(y, Jv)``), ``nan_policy``, ``backend``, ``backend_options``, ``output``, ``out``
    (a store path, ``"jvp.zarr"``, ``.h5`` or ``.npy``, or a :class:`batchjac.Store`: written
    chunk by chunk and resumed as :func:`batchjac.hessian`'s, the result ``"jvps"``/``"vjps"``
    beside ``"outputs"``; returns its :class:`~batchjac.StoreResult`) with ``progress``; on Dask
    ``client=``, ``scheduler=`` or Dask arrays among the inputs and ``tangents`` (their rows
    split into the same blocks, the result in memory; with a store path as ``out`` and numpy or
    file inputs, the workers compute and write its chunks, each with its rows' directions). The
    result has the kind and device of the inputs, or ``output=``'s."""
    return _verb("jvp", model, inputs, tangents, wrt, options)


def vjp(model: Any, *inputs: Any, cotangents: Any, wrt: Any = None, **options: Any) -> Any:
    """Per-instance vector-Jacobian products ``c_i^T J_i``, without forming ``J``.

    ``cotangents``: ``(N, *output_shape)``, one per instance, giving ``(N, *unknown_shape)``;
    or ``(N, d, *output_shape)``, giving ``(N, d, *unknown_shape)``. One forward pass and one
    backward pass per direction. Other arguments as for :func:`jvp`."""
    return _verb("vjp", model, inputs, cotangents, wrt, options)


def divergence(model: Any, *inputs: Any, wrt: Any = None, estimator: Estimator | None = None,
               samples: int = 16, seed: int = 0, **options: Any) -> Any:
    """Per-instance divergence ``tr J_i`` of a model whose outputs match its unknowns
    (``output_shape == unknown_shape``), without storing ``J``: ``(N,)``.

    Exact (``estimator=None``): the Jacobians of a chunk of rows at a time, as
    :func:`batchjac.jacobian` computes them (its mode and build), each reduced to its trace. With
    ``estimator="hutchinson"``: ``samples`` Rademacher probes ``v`` per instance (drawn from
    ``seed`` and the instance's index, so results do not depend on the blocks), ``v^T J_i v``
    averaged, unbiased; ``estimator="hutch++"``: Hutch++ over the same number of products (a
    third sketch ``J_i``'s range, whose part of the trace is then exact, Hutchinson's on the
    rest: far closer where a few directions dominate ``J_i``). Either returns a
    :class:`TraceEstimate` with the per-instance standard error (:mod:`batchjac._estimators`).
    Other arguments as for :func:`jvp`; on Dask, each block's probes are its instances'. ``out=`` a store path
    (``"div.zarr"``, ``.h5``, ``.npy``) or :class:`batchjac.Store`: written chunk by chunk and
    resumed as :func:`jvp`'s; the result ``"divergences"`` is ``(N,)``, or ``(N, 2)`` for an
    estimate (each value and its standard error)."""
    if estimator is not None:
        check_estimator(estimator, samples, seed, ESTIMATORS, "divergence")
    elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"`seed` must be a non-negative int; got {seed!r}.")
    return _verb("divergence", model, inputs, None, wrt, options,
                 estimator=(estimator, samples, int(seed)))


_OPTIONS = {"dtype", "chunk_size", "max_memory", "return_outputs", "nan_policy", "backend",
            "backend_options", "output", "client", "scheduler", "rows_per_task", "out",
            "progress"}


def _verb(kind: str, model: Any, inputs: tuple[Any, ...], vectors: Any, wrt: Any,
          options: dict[str, Any], estimator: tuple[str | None, int, int] = (None, 0, 0)) -> Any:
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise InputError(f"{kind}() got unexpected keyword argument(s) {unknown}; it takes "
                         f"{sorted(_OPTIONS)}.")
    if not inputs:
        raise InputError(f"{kind}() needs the model's inputs: {kind}(model, x, ...).")
    client, scheduler = options.pop("client", None), options.pop("scheduler", None)
    rows_per_task = options.pop("rows_per_task", None)
    extra = () if vectors is None else (vectors,)
    if client is not None or scheduler is not None or (
            any(type(a) is not np.ndarray for a in (*inputs, *extra)) and
            uses_dask((*inputs, *extra))):
        from . import _dask
        from ._stores import is_store_target

        out = options.get("out")
        if is_store_target(out):  # the workers compute and write the store's chunks
            with _dask.client_for(client, scheduler) as own:
                _dask.check_store_inputs(inputs, own)
                return _local(kind, model, inputs, vectors, wrt=wrt, estimator=estimator,
                              cluster=own, **options)
        if out is not None:
            raise InputError(f"On Dask, {kind}() computes in memory (a Dask array for Dask "
                             f"inputs) or into a store path (`out='{kind}.zarr'`); an `out=` "
                             f"array is not supported there. Compute locally, or pass a store "
                             f"path.")
        output = options.pop("output", "auto")
        name = {"jvp": "tangents", "vjp": "cotangents"}.get(kind)
        kw = {"wrt": wrt, "kind": kind, **options}
        rows_kw = {name: vectors} if name else None
        if estimator[0] is not None:  # each block's probes drawn for its own instances
            kw["estimator"] = estimator
            rows_kw = {"instances": np.arange(_dask.row_count(inputs))}
        with _dask.client_for(client, scheduler) as own:
            found = _dask.run(_task, model, inputs, client=own, rows_per_task=rows_per_task,
                              out=None, kw=kw, output=output, rows_kw=rows_kw)
        if estimator[0] is None:
            return found
        return estimate_of(found, estimator, options.get("return_outputs", False))
    return _local(kind, model, inputs, vectors, wrt=wrt, estimator=estimator, **options)


def _task(model: Any, *inputs: Any, kind: str, tangents: Any = None, cotangents: Any = None,
          instances: Any = None, **options: Any) -> Any:
    """One Dask task: its block of rows (and of the vectors), computed locally; an estimate's
    as one array, ``(rows, 2)`` (value and standard error), its probes those of the block's
    ``instances``."""
    vectors = tangents if kind == "jvp" else cotangents
    if instances is None:
        return _local(kind, model, inputs, vectors, **options)
    first = int(instances[0]) if len(instances) else 0
    found = _local(kind, model, inputs, vectors, first_row=first, **options)
    y, est = found if options.get("return_outputs") else (None, found)
    pair = np.stack([np.asarray(est.value), np.asarray(est.stderr)], -1)
    return pair if y is None else (y, pair)


def estimate_of(found: Any, estimator: tuple[str | None, int, int], with_outputs: bool) -> Any:
    """The :class:`TraceEstimate` of the Dask path's ``(N, 2)`` result (lazy for Dask inputs)."""
    y, pair = found if with_outputs else (None, found)
    how, samples, seed = estimator
    assert how is not None
    est = TraceEstimate(value=pair[:, 0], stderr=pair[:, 1], samples=samples, estimator=how,
                        seed=seed)
    return est if y is None else (y, est)


def _local(kind: str, model: Any, inputs: tuple[Any, ...], vectors: Any, *, wrt: Any = None,
           dtype: DTypeLike = None, chunk_size: int | None = None,
           max_memory: int | str | None = None, return_outputs: bool = False,
           nan_policy: NanPolicy = "raise", backend: str | None = None,
           backend_options: dict[str, Any] | None = None, output: OutputArg = "auto",
           out: Any = None, progress: bool | Any = False,
           estimator: tuple[str | None, int, int] = (None, 0, 0), first_row: int = 0,
           cluster: Any = None) -> Any:
    """The verb ``kind`` in this process; a store's chunks on the Dask client ``cluster``
    where given (its workers compute and write them)."""
    model = as_model(model)
    if not isinstance(return_outputs, bool):
        raise InputError(f"`return_outputs` must be True or False; got {return_outputs!r}.")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise InputError(f"`chunk_size` must be a positive int or None; got {chunk_size!r}.")
    extra = () if vectors is None else (vectors,)
    delivery = on_host((*inputs, *extra), output, out=out)
    spec = normalize(inputs, wrt=wrt, dtype=dtype, nan_policy=nan_policy)
    name, bound = bind(model, spec, backend, backend_options)
    assert bound.output_shape is not None
    out_shape, ushape = tuple(bound.output_shape), tuple(spec.unknown_shape)
    try:
        if kind == "divergence":
            if out_shape != ushape:
                raise InputError(
                    f"divergence() needs a square Jacobian: outputs shaped like the unknowns; "
                    f"the model maps unknowns of shape {ushape} to outputs of shape "
                    f"{out_shape}. Choose the unknowns with `wrt=` so that they match the "
                    f"outputs, or compute batchjac.jacobian and reduce it.")
            if out is not None:
                return _divergence_to_store(model, bound, spec, name, out, estimator,
                                            chunk_size=chunk_size, max_memory=max_memory,
                                            return_outputs=return_outputs, nan_policy=nan_policy,
                                            options=backend_options or {}, progress=progress,
                                            cluster=_on(cluster, model, name, backend_options))
            found = _divergence(bound, spec, name, estimator, chunk_size, max_memory, return_outputs,
                                first_row)
            y, div = found if return_outputs else (None, found)
            if isinstance(div, TraceEstimate):  # (its arrays in the inputs' kind)
                div.value, div.stderr = deliver((div.value, div.stderr), delivery)
            else:
                div = deliver(div, delivery)
            return (deliver(y, delivery), div) if return_outputs else div
        name_v = "tangents" if kind == "jvp" else "cotangents"
        shape_v = ushape if kind == "jvp" else out_shape
        v, single = _vectors(vectors, name_v, spec, shape_v, nan_policy)
        d = v.shape[1]
        result_shape = (*(() if single else (d,)), *(out_shape if kind == "jvp" else ushape))
        with_v = TangentSpec.of(spec, v)
        m = output_size(bound)
        mode = via_jacobian(kind, d, spec.k, m)
        block = min(_block_rows(spec, m, d, chunk_size, max_memory,
                                None if mode is None else min(spec.k, m)), max(spec.n, 1))
        result = RESULT[kind]
        if out is not None:
            return _to_store(model, bound, with_v, name, kind, out, block, single,
                             result_shape, chunk_size=chunk_size, max_memory=max_memory,
                             return_outputs=return_outputs, nan_policy=nan_policy,
                             options=backend_options or {}, progress=progress,
                             cluster=_on(cluster, model, name, backend_options))
        targets = {result: np.empty((spec.n, *result_shape), spec.dtype)}
        if return_outputs:
            targets["outputs"] = np.empty((spec.n, *out_shape), spec.dtype)
        run_chunks(_ProductKernel(bound, kind, block, single, return_outputs, mode), with_v,
                   ArraySink(targets))
    except BatchJacError as e:
        raise add_context(e, context(spec, name)) from e
    p = targets[result]
    return deliver((targets["outputs"], p) if return_outputs else p, delivery)


#: the result's name, in memory and in a store
RESULT = {"jvp": "jvps", "vjp": "vjps"}


def via_jacobian(kind: str, d: int, k: int, m: int) -> str | None:
    """The mode that forms each chunk's Jacobians where that is cheaper than pushing the ``d``
    directions one by one: ``min(k, m)`` passes and a product per row against ``d`` passes,
    once the directions outnumber those passes ``FORM_J`` times; else None (the products)."""
    if d < FORM_J * min(k, m):
        return None
    return "reverse" if m < k else "forward"


class _ProductKernel:
    """A product over chunks of ``chunk_size`` rows, as the runner calls a kernel: the
    directions come last among the chunk's arrays (:class:`batchjac._spec.TangentSpec`).
    With ``mode`` (:func:`via_jacobian`), the chunk's Jacobians are formed in that mode (the
    backend's first build: the same bytes in every run) and multiplied by the directions."""

    def __init__(self, bound: Any, kind: str, chunk_size: int, single: bool,
                 with_outputs: bool, mode: str | None = None) -> None:
        self.bound, self.kind, self.chunk_size = bound, kind, chunk_size
        self.single, self.with_outputs, self.mode = single, with_outputs, mode

    def __call__(self, u: Any, ctx: tuple[Any, ...]) -> dict[str, np.ndarray]:
        *model_ctx, t = ctx
        if self.mode is None:
            y, p = self.bound.product(self.kind, u, tuple(model_ctx), np.ascontiguousarray(t))
        else:
            y, p = self._via_jacobian(u, tuple(model_ctx), np.asarray(t))
        out = {RESULT[self.kind]: p[:, 0] if self.single else p}
        if self.with_outputs:
            out["outputs"] = y
        return out

    def _via_jacobian(self, u: Any, ctx: tuple[Any, ...], t: np.ndarray) -> tuple[Any, Any]:
        from ._backends import FIRST_VARIANT

        assert self.mode is not None
        kernel = self.bound.kernel(self.mode, self.chunk_size, self.with_outputs,
                                   variant=FIRST_VARIANT)
        found = results(kernel(u, ctx))
        rows, d = t.shape[:2]
        out_shape, ushape = tuple(self.bound.output_shape), tuple(u.shape[1:])
        jac = np.asarray(found["jacobians"]).reshape(rows, math.prod(out_shape), -1)
        flat = t.reshape(rows, d, -1)
        if self.kind == "jvp":
            p = np.einsum("nmk,ndk->ndm", jac, flat).reshape(rows, d, *out_shape)
        else:
            p = np.einsum("nmk,ndm->ndk", jac, flat).reshape(rows, d, *ushape)
        return found.get("outputs"), p.astype(t.dtype, copy=False)


def _to_store(model: Any, bound: Any, spec: BatchSpec, backend: str, kind: str, out: Any,
              block: int, single: bool, result_shape: tuple[int, ...], *,
              chunk_size: int | None, max_memory: int | str | None, return_outputs: bool,
              nan_policy: NanPolicy, options: dict[str, Any], progress: Any,
              cluster: Callable[..., None] | None = None) -> Any:
    """The products written chunk by chunk into a resumable store (the protocol of
    :mod:`batchjac._stores`, as the second-order results are): a chunk's rows and directions
    hashed, a finished chunk never computed again; each chunk's Jacobians formed where the
    store's plan says so (``via``). ``cluster``: the chunk loop on Dask (:func:`_on`), given
    the kernel recipe."""
    from ._stores import as_store, is_store_target
    from ._stores.hessians import second_to_store

    if not is_store_target(out):
        raise InputError(f"`out` of {kind}() must be a store path ('{RESULT[kind]}.zarr', .h5 "
                         f"or .npy) or a batchjac.Store; got {type(out).__name__}.")
    named = "output" if kind == "jvp" else "unknown"
    axes = (*(() if single else ("direction",)),
            *[f"{named}{i}" for i in range(len(result_shape) - (0 if single else 1))])

    d = 1 if single else result_shape[0]
    via = via_jacobian(kind, d, spec.k, output_size(bound))

    def plan(_: Any) -> dict[str, Any]:
        how = "" if via is None else f", each chunk's Jacobians formed in {via} mode"
        return {"order": via or ("forward" if kind == "jvp" else "reverse"), "chunk_size": block,
                "chunks": -(-spec.n // block) if spec.n else 0, "rows": spec.n, "via": via,
                "reason": f"{kind}: chunks of {block} rows{how}"}

    # (a store made before the route was recorded has no "via": its products were pushed)
    make = functools.partial(_product_kernel, kind=kind, single=single, with_outputs=return_outputs)
    return second_to_store(
        model, spec, backend, store=as_store(out), name=RESULT[kind],
        describe_options={"mode": kind, "chunk_size": chunk_size, "max_memory": max_memory,
                          "backend_options": options, "nan_policy": nan_policy},
        bind=lambda: bound, plan=plan, kernel=make, with_outputs=return_outputs,
        with_jacobian=False, explain=False, progress=progress,
        compute_chunks=None if cluster is None else functools.partial(cluster, kernel_of=make),
        result=lambda _: (result_shape, axes))


def _product_kernel(bound: Any, plan: dict[str, Any], *, kind: str, single: bool,
                    with_outputs: bool) -> _ProductKernel:
    """A product store's kernel: its plan's chunk size and route (``via``)."""
    return _ProductKernel(bound, kind, plan["chunk_size"], single, with_outputs, plan.get("via"))


def _on(client: Any, model: Any, backend: str, options: dict[str, Any] | None
        ) -> Callable[..., None] | None:
    """The store's chunk loop on the Dask ``client`` (None: this process's), to be given the
    kernel recipe (``kernel_of``)."""
    if client is None:
        return None
    from . import _dask

    return functools.partial(_dask.store_chunks_on_cluster, client, model, backend, options or {})


def _divergence_to_store(model: Any, bound: Any, spec: BatchSpec, backend: str, out: Any,
                         estimator: tuple[str | None, int, int], *, chunk_size: int | None,
                         max_memory: int | str | None, return_outputs: bool,
                         nan_policy: NanPolicy, options: dict[str, Any], progress: Any,
                         cluster: Callable[..., None] | None = None) -> Any:
    """The divergences written chunk by chunk into a resumable store, as the products are
    (:func:`_to_store`): exact (``"divergences"`` ``(N,)``, the Jacobian kernel of the plan's
    mode, its first build: the same bytes in every run) or an estimate (``(N, 2)``: the value
    and its standard error; the probes are functions of the seed and the instance, hashed with
    the rows)."""
    from ._backends import FIRST_VARIANT
    from ._bind import plan_for
    from ._stores import as_store, is_store_target
    from ._stores.hessians import second_to_store

    if not is_store_target(out):
        raise InputError(f"`out` of divergence() must be a store path ('div.zarr', .h5 or .npy) "
                         f"or a batchjac.Store; got {type(out).__name__}.")
    how, samples, seed = estimator
    k, shape = spec.k, tuple(spec.unknown_shape)
    fits = min(budget(max_memory), WORKING_SET)
    if how is None:
        planned = plan_for(spec, bound, mode="auto", chunk_size=chunk_size, max_memory=fits)
        mode, block, target = planned.mode, planned.chunk_size, spec
        reason = (f"divergence: the Jacobians in {mode} mode, chunks of {block} rows, each "
                  f"reduced to its trace")

        def make(b: Any, p: dict[str, Any]) -> Any:
            return _TraceKernel(b.kernel(p["order"], p["chunk_size"], return_outputs,
                                         variant=FIRST_VARIANT), k)

        per_row: tuple[tuple[int, ...], tuple[str, ...]] = ((), ())
        what = "exact"
    else:
        count = probes_per_row(how, samples)
        block = min(_block_rows(spec, output_size(bound), count, chunk_size, max_memory),
                    max(spec.n, 1))
        mode, target = "forward", TangentSpec.of(spec, Probes(seed, spec.n, count, shape,
                                                               spec.dtype))
        reason = f"divergence by {how}: {samples} products an instance, chunks of {block} rows"

        def make(b: Any, p: dict[str, Any]) -> Any:
            return Paired(EstimateKernel(_pushed(b, k), p["chunk_size"], how, samples, (), False,
                                         return_outputs), "divergences")

        per_row = ((2,), ("estimate",))
        what = f"{how}, samples={samples}, seed={seed}"

    def plan(_: Any) -> dict[str, Any]:
        return {"order": mode, "chunk_size": block, "chunks": -(-spec.n // block) if spec.n else 0,
                "rows": spec.n, "reason": reason}

    return second_to_store(
        model, target, backend, store=as_store(out), name="divergences",
        describe_options={"mode": f"divergence ({what})", "chunk_size": chunk_size,
                          "max_memory": max_memory, "backend_options": options,
                          "nan_policy": nan_policy},
        bind=lambda: bound, plan=plan, kernel=make, with_outputs=return_outputs,
        with_jacobian=False, explain=False, progress=progress, result=lambda _: per_row,
        compute_chunks=None if cluster is None else functools.partial(cluster, kernel_of=make))


class _TraceKernel:
    """A Jacobian kernel's chunk reduced to each row's trace: ``"divergences"`` ``(rows,)``."""

    def __init__(self, kernel: Any, k: int) -> None:
        self.kernel, self.k, self.chunk_size = kernel, k, kernel.chunk_size

    def __call__(self, u: Any, ctx: tuple[Any, ...]) -> dict[str, np.ndarray]:
        out = results(self.kernel(u, ctx))
        jac = np.asarray(out.pop("jacobians")).reshape(-1, self.k, self.k)
        return {**out, "divergences": np.einsum("njj->n", jac)}


def _pushed(bound: Any, k: int) -> Any:
    """The products of an estimate of ``tr J``: ``J v`` for each direction, as ``(rows, d, 1, k)``."""
    def apply(u: Any, ctx: tuple[Any, ...], v: np.ndarray) -> tuple[Any, np.ndarray]:
        y, jv = bound.product("jvp", u, ctx, v)
        return y, np.asarray(jv).reshape(v.shape[0], v.shape[1], 1, k)

    return apply


def _vectors(vectors: Any, name: str, spec: BatchSpec, shape: tuple[int, ...],
             nan_policy: NanPolicy) -> tuple[Any, bool]:
    """The tangents or cotangents as ``(N, d, *shape)`` in the compute dtype, and whether one
    direction was given per instance (``(N, *shape)``). Directions on disk (a path, a batchjac
    file reader, an ``np.memmap``, an h5py dataset, a Zarr array) stay there: read a chunk's
    rows at a time (:class:`_LazyDirections`), as lazy inputs are."""
    if vectors is None:
        raise InputError(f"`{name}` is required: one row per instance, ({spec.n}, "
                         f"{', '.join(map(str, shape))}), or ({spec.n}, d, ...) for d "
                         f"directions each.")
    lazy = isinstance(vectors, (str, os.PathLike)) or is_lazy(vectors)
    v = as_input(vectors, name) if lazy else to_numpy(vectors, name)
    got = tuple(int(s) for s in v.shape)
    if got == (spec.n, *shape):
        single = True
    elif len(got) == len(shape) + 2 and got[0] == spec.n and got[2:] == shape and got[1] >= 1:
        single = False
    else:
        raise InputError(
            f"`{name}` has shape {got}; it must be ({spec.n}, "
            f"{', '.join(map(str, shape))}) (one direction per instance) or ({spec.n}, d, "
            f"{', '.join(map(str, shape))}) (d >= 1 directions per instance), for {spec.n} "
            f"instances whose {'unknowns' if name == 'tangents' else 'outputs'} have shape "
            f"{shape}.")
    if np.dtype(v.dtype).kind not in "fiu":
        raise InputError(f"`{name}` must hold real numbers; got dtype {v.dtype}.")
    if lazy:
        return _LazyDirections(v, single, name, nan_policy == "raise"), single
    if single:
        v = v[:, None]
    if nan_policy == "raise" and v.size and not np.isfinite(v).all():
        row = int(np.argmax(~np.isfinite(v.reshape(v.shape[0], -1)).all(axis=1)))
        raise InputError(f"`{name}` has a NaN or Inf in row {row}; give finite directions, or "
                         f"nan_policy='propagate'.")
    return np.ascontiguousarray(v, spec.dtype), single


class _LazyDirections:
    """Directions left on disk, ``(N, d, *shape)``: a chunk's rows read when the chunk is
    computed (a copy: a memmap's pages are not kept), checked for NaN and Inf there where
    ``check``; ``single``: the file holds one direction per instance, ``(N, *shape)``."""

    def __init__(self, a: Any, single: bool, name: str, check: bool) -> None:
        self.a, self.single, self.name, self.check = a, single, name, check
        n, *rest = (int(s) for s in a.shape)
        self.shape = (n, 1, *rest) if single else (n, *rest)
        self.dtype = np.dtype(a.dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        lo = rows.start or 0
        part = np.array(self.a[rows])
        if self.check and part.size and not np.isfinite(part).all():
            row = lo + int(np.argmax(~np.isfinite(part.reshape(part.shape[0], -1)).all(axis=1)))
            raise InputError(f"`{self.name}` has a NaN or Inf in row {row}; give finite "
                             f"directions, or nan_policy='propagate'.")
        return part[:, None] if self.single else part


def _block_rows(spec: BatchSpec, m: int, d: int, chunk_size: int | None,
                max_memory: int | str | None, passes: int | None = None) -> int:
    """Rows per block: ``chunk_size``, else what half the memory budget, at most
    :data:`batchjac._estimators.WORKING_SET`, holds at the product's bytes a row: inputs and
    outputs, and per direction its tangent, its result and the activations it carries (a few
    times the inputs and outputs)."""
    if chunk_size is not None:
        return int(chunk_size)
    item = spec.dtype.itemsize
    passes = d if passes is None else passes  # (through the Jacobians: min(k, m) passes)
    per_row = 2 * item * ((1 + passes) * 4 * (in_elems(spec) + m) + 2 * d * (spec.k + m))
    return int(min(MAX_BLOCK, max(MIN_BLOCK, min(budget(max_memory) // 2, WORKING_SET) // per_row)))


def _divergence(bound: Any, spec: BatchSpec, backend: str, estimator: tuple[str | None, int, int],
                chunk_size: int | None, max_memory: int | str | None,
                with_outputs: bool, first_row: int = 0) -> Any:
    """The trace of each square Jacobian: exact (the Jacobians of a chunk, as
    :func:`batchjac.jacobian` computes them, reduced to their traces: no more than a chunk of
    ``J`` at a time) or Hutchinson's estimate (Rademacher probes pushed forward)."""
    how, samples, seed = estimator
    k = spec.k
    shape = tuple(spec.unknown_shape)
    if how is None:  # batchjac's Jacobian kernels, chunk by chunk, each chunk's trace kept
        y = np.empty((spec.n, *shape), spec.dtype) if with_outputs else None
        trace = np.empty(spec.n, spec.dtype)
        # (chunks within the working set: the peak stays far below J's, as fast or faster)
        fits = min(budget(max_memory), WORKING_SET)

        def traces(parts: Iterator[tuple[int, int, Any, Any]], _: Any) -> None:
            for lo, hi, yc, jac in parts:
                trace[lo:hi] = np.einsum("njj->n", np.asarray(jac).reshape(hi - lo, k, k))
                if y is not None:
                    y[lo:hi] = np.asarray(yc).reshape(hi - lo, *shape)

        reduce_jacobians(bound, spec, backend, mode="auto", chunk_size=chunk_size,
                         max_memory=fits, with_outputs=with_outputs, consume=traces)
        return (y, trace) if with_outputs else trace

    # the probes as the chunks' last array (as jvp's tangents), drawn chunk by chunk
    count = probes_per_row(how, samples)  # (Hutch++'s second round pushes as many)
    block = min(_block_rows(spec, output_size(bound), count, chunk_size, max_memory),
                max(spec.n, 1))
    kernel = EstimateKernel(_pushed(bound, k), block, how, samples, (), False, with_outputs)
    y, value, stderr = run_estimate(kernel, spec, Probes(seed, spec.n, count, shape, spec.dtype,
                                                         first_row),
                                    tuple(bound.output_shape) if with_outputs else None)
    estimate = TraceEstimate(value=value, stderr=stderr, samples=samples, estimator=how,
                             seed=seed)
    return (y, estimate) if with_outputs else estimate
