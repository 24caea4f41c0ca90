"""The public entry points of second order: per-instance Hessians, their diagonal, the
Laplacian, and Hessian-vector products.

The pipeline is the Jacobian's: validate and normalise the inputs (:mod:`batchjac._validate`),
bind and probe the model (:mod:`batchjac._bind`), plan the order and the chunk size with the
``k*k`` per output counted (:func:`batchjac._plan.make_second_plan`), then one compiled
second-order kernel per chunk through the runner (:mod:`batchjac._runner`) into a sink. The
kernel's result is a mapping of named arrays (``"hessians"``, ``"diagonals"``,
``"laplacians"`` or ``"hvps"``, with ``"outputs"`` and ``"jacobians"`` when asked), which the
runner and the sinks carry without knowing what they are.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from . import _backends, _differentiable
from ._arrays import OutputArg, deliver, named_results, native_options, on_host, resolve
from ._backends._base import SECOND_RESULT
from ._bind import BackendName, beside_probes, memory_budget, prepare
from ._compute import Derivative, check_out, compute, context
from ._dask import store_chunks_on_cluster, uses_dask
from ._errors import BatchJacError, InputError, OrderFailedError, add_context
from ._estimators import (
    ESTIMATORS,
    WORKING_SET,
    DiagonalEstimate,
    EstimateKernel,
    Estimator,
    Paired,
    Probes,
    TraceEstimate,
    check as check_estimator,
    probes_per_row,
    run as run_estimate,
)
from ._loaders import as_model
from ._plan import (
    OrderArg,
    SecondKindArg,
    SecondPlan,
    check_options,
    choose_order,
    make_second_plan,
    second_bytes_per_row,
)
from ._runner import Results, call, run_chunks, run_single
from ._spec import BatchSpec, TangentSpec, check_finite_rows
from ._stores import StoreError, as_store, is_store_target, progress_bar
from ._stores.hessians import SecondStoreResult, second_to_store
from ._validate import DTypeLike, NanPolicy, as_native, normalize

log = logging.getLogger("batchjac")


def hessian(
    model: Any,
    *inputs: Any,
    wrt: Any = None,
    mode: OrderArg = "auto",
    diagonal: bool = False,
    laplacian: bool = False,
    chunk_size: int | None = None,
    max_memory: int | str | None = None,
    dtype: DTypeLike = None,
    return_outputs: bool = False,
    return_jacobian: bool = False,
    nan_policy: NanPolicy = "raise",
    out: Any = None,
    backend: BackendName | None = None,
    backend_options: dict[str, Any] | None = None,
    explain: bool = False,
    progress: bool | Callable[[int], None] = False,
    client: Any = None,
    scheduler: str | None = None,
    rows_per_task: int | None = None,
    output: OutputArg = "auto",
    differentiable: bool = False,
    estimator: Estimator | None = None,
    samples: int = 16,
    seed: int = 0,
) -> Any:
    """Per-instance Hessians ``H[i] = d^2 model(inputs_i) / d unknown_i^2``.

    The call forms of :func:`batchjac.jacobian` (``hessian(model, x)``, ``hessian(model,
    unknown, known)``, ``wrt=[0, 2]``, dicts and tuples of inputs). Returns an array of
    shape ``(N, *output_shape, *unknown_shape, *unknown_shape)``, the per-instance convention
    of ``torch.func.hessian``/``jax.hessian``; with ``diagonal=True`` only its diagonal,
    ``(N, *output_shape, *unknown_shape)``, and with ``laplacian=True`` its trace over the
    unknowns, ``(N, *output_shape)``: both computed without a ``k x k`` block per output
    where the order allows it (forward over forward, one second-order tangent per unknown).

    ``return_outputs``/``return_jacobian`` add the outputs and the Jacobians of the same pass:
    the result is then a tuple ``(outputs?, jacobians?, hessians)`` in that order.

    Every array of the result has the kind and device of the inputs, as ``jacobian``'s
    (:mod:`batchjac._arrays`): numpy for numpy inputs; torch tensors, JAX arrays or TensorFlow
    tensors into a model of their own framework are computed on their device and come back
    there, with no copy to the host; ``output=`` ("numpy", "torch", "jax", "tensorflow") asks
    for a kind. ``out=`` takes host chunks.

    ``mode``: "auto" (forward over reverse for full Hessians of at most as many outputs as
    unknowns, forward over forward for more outputs and for the reductions), or
    "forward-over-reverse" / "forward-over-forward". ``chunk_size``/``max_memory``,
    ``dtype``, ``nan_policy``, ``backend``, ``backend_options``, ``explain`` and ``progress``
    as for ``jacobian``. ``out``: a writable array of the result's shape, or a path
    (``"hess.zarr"``, ``"hess.h5"``, ``"hess.npy"``) or :class:`batchjac.Store`: the result
    is written there chunk by chunk, resumably (a killed call made again continues where it
    stopped, bitwise the same), and a :class:`batchjac.StoreResult` is returned
    (``.open()`` reads the result, ``.open("jacobians")`` the Jacobians).

    Dask: ``client=``/``scheduler=`` or Dask arrays as inputs, as for ``jacobian`` (the same
    per-block hand-off, :mod:`batchjac._dask`): Dask arrays in give a lazy Dask array out; a
    store path as ``out`` (numpy or file inputs) is written by the workers, chunk by chunk,
    through the same resume protocol (:func:`batchjac._dask.store_chunks_on_cluster`). Not yet
    on Dask: ``return_jacobian`` in memory, ``out=`` arrays, and ``hvp``.

    ``estimator`` (with ``laplacian=True`` or ``diagonal=True``; ``samples`` products a
    instance, ``seed``): the Laplacian or the diagonal estimated from Hessian-vector products
    instead of computed, for many unknowns: ``"hutchinson"`` (``v^T H v``, or ``v * Hv`` for
    the diagonal, over Rademacher probes) or, for the Laplacian, ``"hutch++"`` (a third of the
    products sketch each output's ``H``, whose part of the trace is then exact). Returns a
    :class:`batchjac.TraceEstimate` or :class:`batchjac.DiagonalEstimate` (``value`` and a
    per-instance ``stderr``), or ``(outputs, estimate)`` with ``return_outputs``; or, with
    ``out=`` a store path or :class:`batchjac.Store`, the estimates written chunk by chunk as
    ``(N, *shape, 2)`` (value and standard error), resumably; on Dask (``client=``, Dask
    arrays) each block draws its own instances' probes: the same estimates as a local call, in
    memory or, with a store path as ``out``, written by the workers chunk by chunk
    (:mod:`batchjac._estimators`).

    ``differentiable=True`` (here, in :func:`laplacian` and in :func:`hvp`): the result inside
    the framework's graph, as :func:`batchjac.jacobian`'s (a physics-informed loss on the
    Laplacian trains the model): the order is chosen from the shapes, the forward Laplacian's
    rule set carries gradients too, and under ``max_memory`` each chunk is recomputed in the
    backward pass.

    >>> import numpy as np, batchjac
    >>> from batchjac.examples import seed_model
    >>> model = seed_model("torch")               # 5 unknown + 3 known inputs -> 4 outputs
    >>> rng = np.random.default_rng(0)
    >>> unknown, known = rng.normal(size=(100, 5)), rng.normal(size=(100, 3))
    >>> batchjac.hessian(model, unknown.astype("f4"), known.astype("f4")).shape
    (100, 4, 5, 5)
    """
    if diagonal and laplacian:
        raise InputError("`diagonal=True` and `laplacian=True` ask for two results; pass one "
                         "(the Laplacian is the sum of the diagonal over the unknowns).")
    kind: SecondKindArg = "laplacian" if laplacian else "diagonal" if diagonal else "hessian"
    if estimator is not None:  # randomized, from Hessian-vector products
        on_dask = client is not None or scheduler is not None or (
            any(type(a) is not np.ndarray for a in inputs) and uses_dask(inputs))
        asked = {"out": out if out is not None and not is_store_target(out) else None,
                 "differentiable": differentiable, "return_jacobian": return_jacobian}
        _refuse_with_estimator(kind, estimator, {n: v for n, v in asked.items()
                                                 if v is not None and v is not False})
        check_estimator(estimator, samples, seed,
                        ESTIMATORS if kind == "laplacian" else ("hutchinson",),
                        "laplacian" if laplacian else "hessian")
        if on_dask and out is not None:  # the workers compute and write the store's chunks
            from . import _dask

            with _dask.client_for(client, scheduler) as own:
                _dask.check_store_inputs(inputs, own)
                return _estimated(model, inputs, kind, estimator=estimator, samples=int(samples),
                                  seed=int(seed), wrt=wrt, mode=mode, chunk_size=chunk_size,
                                  max_memory=max_memory, dtype=dtype,
                                  return_outputs=return_outputs, nan_policy=nan_policy,
                                  backend=backend, backend_options=backend_options,
                                  output=output, explain=explain, out=out, progress=progress,
                                  cluster=own)
        if on_dask:  # each block's probes drawn for its own instances
            from . import _dask

            kw = {"kind": kind, "estimator": estimator, "samples": int(samples),
                  "seed": int(seed), "wrt": wrt, "mode": mode, "chunk_size": chunk_size,
                  "max_memory": max_memory, "dtype": dtype, "return_outputs": return_outputs,
                  "nan_policy": nan_policy, "backend": backend,
                  "backend_options": backend_options}
            with _dask.client_for(client, scheduler) as own:
                found = _dask.run(_estimate_task, model, inputs, client=own,
                                  rows_per_task=rows_per_task, out=None, kw=kw, output=output,
                                  rows_kw={"instances": np.arange(_dask.row_count(inputs))})
            y, pair = found if return_outputs else (None, found)
            cls = DiagonalEstimate if kind == "diagonal" else TraceEstimate
            est = cls(value=pair[..., 0], stderr=pair[..., 1], samples=int(samples),
                      estimator=estimator, seed=int(seed))
            return est if y is None else (y, est)
        return _estimated(model, inputs, kind, estimator=estimator, samples=int(samples),
                          seed=int(seed), wrt=wrt, mode=mode, chunk_size=chunk_size,
                          max_memory=max_memory, dtype=dtype, return_outputs=return_outputs,
                          nan_policy=nan_policy, backend=backend,
                          backend_options=backend_options, output=output, explain=explain,
                          out=out, progress=progress)
    if differentiable is not False:  # in the framework's graph, for a training loss
        _differentiable.refuse(out=out, client=client, scheduler=scheduler, progress=progress)
        return _differentiable.derivatives(
            model, inputs, kind, wrt=wrt, mode=mode, chunk_size=chunk_size,
            max_memory=max_memory, dtype=dtype, return_outputs=return_outputs,
            return_jacobian=return_jacobian, nan_policy=nan_policy, backend=backend,
            backend_options=backend_options, explain=explain, output=output)
    if client is not None or scheduler is not None or (
            any(type(a) is not np.ndarray for a in inputs) and uses_dask(inputs)):
        from . import _dask

        if is_store_target(out):  # the workers compute and write the store's chunks
            with _dask.client_for(client, scheduler) as own:
                _dask.check_store_inputs(inputs, own)
                on_cluster = functools.partial(
                    _dask.store_chunks_on_cluster, own, as_model(model),
                    backend or _backends.detect(as_model(model)), backend_options or {},
                    second=(kind, return_jacobian))
                return second_order(model, inputs, kind, wrt=wrt, mode=mode,
                                    chunk_size=chunk_size, max_memory=max_memory, dtype=dtype,
                                    return_outputs=return_outputs,
                                    return_jacobian=return_jacobian, nan_policy=nan_policy,
                                    out=out, backend=backend, backend_options=backend_options,
                                    explain=explain, progress=progress,
                                    compute_chunks=on_cluster, output=output)
        if out is not None:
            raise InputError("On Dask, hessian() computes in memory (a Dask array for Dask "
                             "inputs) or into a store path (`out='hess.zarr'`); an `out=` array "
                             "is not supported there. Compute locally, or pass a store path.")

        kw = {"wrt": wrt, "mode": mode, "diagonal": diagonal, "laplacian": laplacian,
              "chunk_size": chunk_size, "max_memory": max_memory, "dtype": dtype,
              "return_outputs": return_outputs, "return_jacobian": return_jacobian,
              "nan_policy": nan_policy, "backend": backend,
              "backend_options": backend_options, "explain": explain}
        with _dask.client_for(client, scheduler) as own:
            return _dask.run(hessian, model, inputs, client=own, rows_per_task=rows_per_task,
                             out=None, kw=kw, output=output)
    return second_order(model, inputs, kind, wrt=wrt, mode=mode, chunk_size=chunk_size,
                        max_memory=max_memory, dtype=dtype, return_outputs=return_outputs,
                        return_jacobian=return_jacobian, nan_policy=nan_policy, out=out,
                        backend=backend, backend_options=backend_options, explain=explain,
                        progress=progress, output=output)


def laplacian(model: Any, *inputs: Any, **options: Any) -> Any:
    """The per-instance Laplacian ``sum_j d^2 model / d unknown_j^2``, shape ``(N,
    *output_shape)``: ``hessian(model, *inputs, laplacian=True, **options)``, in the inputs'
    array kind and device as ``hessian``'s result.

    >>> import numpy as np, batchjac
    >>> import torch
    >>> x = np.random.default_rng(0).normal(size=(10, 3))
    >>> lap = batchjac.laplacian(lambda z: torch.sin(z).sum(-1), x)
    >>> bool(np.allclose(lap, -np.sin(x).sum(-1)))
    True
    """
    return hessian(model, *inputs, laplacian=True, **options)


def hvp(model: Any, *inputs: Any, v: Any, wrt: Any = None, mode: OrderArg = "auto",
        **options: Any) -> Any:
    """Per-instance Hessian-vector products ``H[i] @ v[i]``: ``v`` has one row per instance
    shaped like the unknowns, ``(N, *unknown_shape)``; the result is ``(N, *output_shape,
    *unknown_shape)``, computed in one forward pass over the reverse-mode Jacobian per chunk
    (no Hessian is formed). Other options as for :func:`hessian`; the result has the kind and
    device of the inputs and ``v`` (one framework's arrays among them: a torch ``v`` beside
    torch inputs stays on their device), or ``output=``'s. On Dask (``client=``,
    ``scheduler=``, or Dask arrays among the inputs and ``v``) the rows of the inputs and of
    ``v`` are split into the same blocks, one task each, and the result is computed in memory
    as :func:`hessian`'s (``out=`` a store is not offered for products)."""
    client, scheduler = options.pop("client", None), options.pop("scheduler", None)
    rows_per_task = options.pop("rows_per_task", None)
    if options.pop("differentiable", False) is not False:
        _differentiable.refuse(out=options.pop("out", None), client=client, scheduler=scheduler,
                               progress=options.pop("progress", False))
        unknown = sorted(set(options) - _HVP_DIFFERENTIABLE)
        if unknown:
            raise InputError(f"hvp() got unexpected keyword argument(s) {unknown}.")
        return _differentiable.derivatives(
            model, inputs, "hvp", wrt=wrt, mode=mode, tangents=v,
            **{"chunk_size": None, "max_memory": None, "dtype": None, "return_outputs": False,
               "return_jacobian": False, "nan_policy": "raise", "backend": None,
               "backend_options": None, "explain": False, "output": "auto", **options})
    if client is not None or scheduler is not None or (
            any(type(a) is not np.ndarray for a in (*inputs, v)) and uses_dask((*inputs, v))):
        from . import _dask

        if options.get("out") is not None:
            raise InputError("On Dask, hvp() computes in memory (a Dask array for Dask inputs); "
                             "`out=` is not supported there. Compute locally to fill `out`, or "
                             "drop it.")
        output = options.pop("output", "auto")
        kw = {"wrt": wrt, "mode": mode, **options}
        with _dask.client_for(client, scheduler) as own:
            return _dask.run(_hvp_task, model, inputs, client=own, rows_per_task=rows_per_task,
                             out=None, kw=kw, output=output, rows_kw={"v": v})
    return second_order(model, inputs, "hvp", wrt=wrt, mode=mode, tangents=v, **options)


#: the options of a differentiable hvp()
_HVP_DIFFERENTIABLE = {"chunk_size", "max_memory", "dtype", "return_outputs", "return_jacobian",
                       "nan_policy", "backend", "backend_options", "explain", "output"}


def _hvp_task(model: Any, *inputs: Any, v: Any, **options: Any) -> Any:
    """One Dask task of :func:`hvp`: its block of rows and of ``v``, computed locally."""
    return hvp(model, *inputs, v=v, **options)


def _refuse_with_estimator(kind: str, estimator: str, asked: dict[str, Any]) -> None:
    """What an estimate does not offer, refused by name before anything is bound."""
    if kind == "hessian":
        raise InputError(f"estimator={estimator!r} estimates the Laplacian or the Hessian's "
                         f"diagonal: pass laplacian=True (or batchjac.laplacian) or "
                         f"diagonal=True; a full Hessian is computed, not estimated.")
    if asked:
        names = ", ".join(f"{name}=" for name in asked)
        raise InputError(f"With estimator={estimator!r}, {names} is not offered: an estimate "
                         f"is computed in memory or into a store path (out='lap.zarr'), "
                         f"outside the framework's graph, without the Jacobians. Drop "
                         f"{names}, or compute the exact result (estimator=None).")


def _estimated(model: Any, inputs: tuple[Any, ...], kind: SecondKindArg, *, estimator: str,
               samples: int, seed: int, wrt: Any, mode: OrderArg, chunk_size: int | None,
               max_memory: int | str | None, dtype: DTypeLike, return_outputs: bool,
               nan_policy: NanPolicy, backend: BackendName | None,
               backend_options: dict[str, Any] | None, output: OutputArg, explain: bool,
               out: Any = None, progress: bool | Callable[[int], None] = False,
               first_row: int = 0, cluster: Any = None) -> Any:
    """The Laplacian or the Hessian's diagonal estimated from Hessian-vector products
    (:mod:`batchjac._estimators`): each chunk's rows repeated once per direction into the
    ``hvp`` kernel, of the order :func:`hvp` takes; in memory, or into a store (``out``) as
    ``(N, *shape, 2)``, each value and its standard error, its chunks computed and written by
    the workers of the Dask client ``cluster`` where given (each with its rows' probes)."""
    model = as_model(model)
    check_options("auto", chunk_size, max_memory)
    delivery = on_host(inputs, output)
    spec = normalize(inputs, wrt=wrt, dtype=dtype, nan_policy=nan_policy)
    name = backend or _backends.detect(model)
    try:
        bound = prepare(model, spec, name, backend_options or {})
        assert bound.output_shape is not None
        out_shape, ushape = tuple(bound.output_shape), tuple(spec.unknown_shape)
        k, m = spec.k, math.prod(out_shape)
        order, why = choose_order(mode, "hvp", k, m)
        # the directions a row pushes at once (Hutch++'s second round: each output's own)
        count = probes_per_row(estimator, samples)
        widest = count * (m if estimator == "hutch++" else 1)
        in_elems = sum(math.prod(a.shape[1:]) for a in spec.arrays)
        per_row = second_bytes_per_row("hvp", order, k, m, in_elems, spec.dtype.itemsize)
        fits = min(memory_budget(bound, max_memory), WORKING_SET)
        rows = chunk_size or max(1, fits // (per_row * widest))
        rows = min(rows, max(spec.n, 1))

        shape = (*out_shape, *(ushape if kind == "diagonal" else ()))
        recipe = functools.partial(_estimate_kernel, order=order, estimator=estimator,
                                   samples=samples, shape=shape, diagonal=kind == "diagonal",
                                   with_outputs=return_outputs)
        kernel = recipe(bound, {"chunk_size": rows})
        reason = (f"{kind} by {estimator}: {samples} products an instance, Hessian-vector "
                  f"products in {order} ({why}); chunks of {rows} rows, each row pushed along "
                  f"up to {widest} directions at once")
        probes = Probes(seed, spec.n, count, ushape, spec.dtype, first_row)
        if out is not None:
            result = SECOND_RESULT[kind]
            make = functools.partial(_paired_estimate, recipe=recipe, result=result)
            axes = (*[f"output{i}" for i in range(len(out_shape))],
                    *([f"unknown{i}" for i in range(len(ushape))] if kind == "diagonal" else []),
                    "estimate")
            return second_to_store(
                model, TangentSpec.of(spec, probes), name, store=as_store(out), name=result,
                describe_options={"mode": f"{kind} ({estimator}, samples={samples}, "
                                          f"seed={seed}, {order})",
                                  "chunk_size": chunk_size, "max_memory": max_memory,
                                  "backend_options": backend_options or {},
                                  "nan_policy": nan_policy},
                bind=lambda: bound,
                plan=lambda _: {"order": order, "chunk_size": rows,
                                "chunks": -(-spec.n // rows) if spec.n else 0, "rows": spec.n,
                                "reason": reason},
                kernel=make, with_outputs=return_outputs, with_jacobian=False,
                explain=explain, progress=progress, result=lambda _: ((*shape, 2), axes),
                compute_chunks=None if cluster is None else functools.partial(
                    store_chunks_on_cluster, cluster, model, name, backend_options or {},
                    kernel_of=make))
        if explain:
            print(f"batchjac: {reason}", file=sys.stderr)
        y, value, stderr = run_estimate(kernel, spec, probes,
                                        out_shape if return_outputs else None)
    except BatchJacError as e:
        raise add_context(e, context(spec, name)) from e
    cls = DiagonalEstimate if kind == "diagonal" else TraceEstimate
    value, stderr = deliver((value, stderr), delivery)
    found = cls(value=value, stderr=stderr, samples=samples, estimator=estimator, seed=seed)
    return (deliver(y, delivery), found) if return_outputs else found


def _estimate_kernel(bound: Any, plan: dict[str, Any], *, order: str, estimator: str,
                     samples: int, shape: tuple[int, ...], diagonal: bool,
                     with_outputs: bool) -> EstimateKernel:
    """An estimate's kernel over chunks of ``plan["chunk_size"]`` rows: each chunk's rows
    repeated once per direction into ``bound``'s ``hvp`` kernel of ``order``."""
    assert bound.output_shape is not None
    m, ushape = math.prod(bound.output_shape), tuple(bound.signature.unknown_shape)
    k = math.prod(ushape)

    def apply(u: Any, ctx: tuple[Any, ...], v: np.ndarray) -> tuple[Any, np.ndarray]:
        n, d = v.shape[:2]
        kernel = bound.second_kernel("hvp", order, n * d, with_outputs, False)
        found = call(kernel, np.repeat(u, d, axis=0),
                     (*(np.repeat(c, d, axis=0) for c in ctx), v.reshape(n * d, *ushape)),
                     "Hessian-vector products", zero_check=False)
        y = found.get("outputs")
        hv = np.asarray(found[SECOND_RESULT["hvp"]]).reshape(n, d, m, k)
        return (None if y is None else np.asarray(y)[::d]), hv

    return EstimateKernel(apply, plan["chunk_size"], estimator, samples, shape, diagonal,
                          with_outputs)


def _paired_estimate(bound: Any, plan: dict[str, Any], *, recipe: Any, result: str) -> Paired:
    """A store's estimate kernel (:func:`_estimate_kernel`), its value and standard error as
    one ``(rows, *shape, 2)`` result."""
    return Paired(recipe(bound, plan), result)


def _estimate_task(model: Any, *inputs: Any, kind: SecondKindArg, instances: Any,
                   **options: Any) -> Any:
    """One Dask task of an estimated Laplacian or diagonal: its block's estimates as one array,
    ``(rows, *shape, 2)`` (value and standard error), its probes those of the block's
    ``instances``."""
    first = int(instances[0]) if len(instances) else 0
    found = _estimated(model, inputs, kind, first_row=first, output="numpy", explain=False,
                       **options)
    y, est = found if options.get("return_outputs") else (None, found)
    pair = np.stack([np.asarray(est.value), np.asarray(est.stderr)], -1)
    return pair if y is None else (y, pair)


def second_order(model: Any, inputs: tuple[Any, ...], kind: SecondKindArg, *, wrt: Any = None,
                 mode: OrderArg = "auto", chunk_size: int | None = None,
                 max_memory: int | str | None = None, dtype: DTypeLike = None,
                 return_outputs: bool = False, return_jacobian: bool = False,
                 nan_policy: NanPolicy = "raise", out: Any = None,
                 backend: BackendName | None = None,
                 backend_options: dict[str, Any] | None = None, explain: bool = False,
                 progress: bool | Callable[[int], None] = False, tangents: Any = None,
                 output: OutputArg = "auto",
                 compute_chunks: Callable[..., None] | None = None) -> Any:
    """The one path of every second-order verb (``kind`` says which result); a store's chunks
    computed by ``compute_chunks`` where given (the Dask path's)."""
    model = as_model(model)  # an ONNX file or ModelProto: its PyTorch module
    choose_order(mode, kind, 1, 1)  # bad options fail before anything is bound or created
    check_options("auto", chunk_size, max_memory)
    # the result's kind and device: the inputs' (v's too: it is an input of hvp), as jacobian's
    given = (*inputs, tangents) if kind == "hvp" and tangents is not None else inputs
    delivery = resolve(given, output, lambda: backend or _backends.detect(model), out=out)
    spec = normalize(inputs, wrt=wrt, dtype=dtype, nan_policy=nan_policy, xp=delivery.xp,
                     device=delivery.device)
    name = backend or _backends.detect(model)
    options = native_options(delivery, name, model, backend_options or {})
    try:
        if kind == "hvp":
            spec = _with_tangents(spec, tangents, nan_policy, delivery.device)
        if is_store_target(out):
            return _to_store(model, spec, name, kind, as_store(out), mode=mode,
                             chunk_size=chunk_size, max_memory=max_memory,
                             return_outputs=return_outputs, return_jacobian=return_jacobian,
                             nan_policy=nan_policy, options=options, explain=explain,
                             progress=progress, compute_chunks=compute_chunks)
        # (JAX: the probes beside the first kernel's compilation, as jacobian's: a first call
        # waits little for them)
        bound = prepare(model, _plain(spec), name, options, overlap=out is None)

        def compute() -> Any:
            plan = plan_second(spec, bound, kind, mode=mode, chunk_size=chunk_size,
                               max_memory=max_memory)
            try:
                return _compute(bound, spec, kind, plan, backend=name, return_outputs=return_outputs,
                                return_jacobian=return_jacobian, out=out, explain=explain,
                                progress=progress)
            except OrderFailedError:
                # (raised before any chunk is written: building or running the first)
                if mode != "auto" or plan.order != "forward-over-forward":
                    raise
                bound.tuning.failed_orders.add(plan.order)
            plan = plan_second(spec, bound, kind, mode=mode, chunk_size=chunk_size,
                               max_memory=max_memory)
            return _compute(bound, spec, kind, plan, backend=name, return_outputs=return_outputs,
                            return_jacobian=return_jacobian, out=out, explain=explain,
                            progress=progress)

        return deliver(beside_probes(bound, compute), delivery)
    except StoreError:  # about the output, not the model or inputs: no context to add
        raise
    except BatchJacError as e:
        raise add_context(e, context(spec, name)) from e


def _to_store(model: Any, spec: BatchSpec, backend: str, kind: SecondKindArg, store: Any, *,
              mode: OrderArg, chunk_size: int | None, max_memory: int | str | None,
              return_outputs: bool, return_jacobian: bool, nan_policy: NanPolicy,
              options: dict[str, Any], explain: bool,
              progress: bool | Callable[[int], None],
              compute_chunks: Callable[..., None] | None = None) -> SecondStoreResult:
    """The result written chunk by chunk into a resumable store (the resume protocol of
    :mod:`batchjac._stores`, as Jacobian stores are): the plan and the kernel from here."""
    def plan(bound: _backends.BoundModel) -> dict[str, Any]:
        planned = plan_second(spec, bound, kind, mode=mode, chunk_size=chunk_size,
                              max_memory=max_memory)
        return {"order": planned.order, "chunk_size": planned.chunk_size,
                "chunks": planned.n_chunks, "rows": spec.n, "reason": planned.reason}

    def kernel(bound: _backends.BoundModel, planned: dict[str, Any]) -> Any:
        built = bound.second_kernel(kind, planned["order"], planned["chunk_size"], return_outputs,
                                    return_jacobian)
        # same command, same bytes: the first build, never a timed choice (as Jacobian stores)
        built.use(built.variants[0], "a store's kernel")
        return built

    return second_to_store(
        model, spec, backend, store=store, name=SECOND_RESULT[kind],
        describe_options={"mode": mode, "chunk_size": chunk_size, "max_memory": max_memory,
                          "backend_options": options, "nan_policy": nan_policy},
        bind=lambda: prepare(model, _plain(spec), backend, options), plan=plan, kernel=kernel,
        with_outputs=return_outputs, with_jacobian=return_jacobian, explain=explain,
        progress=progress, compute_chunks=compute_chunks)


def _plain(spec: BatchSpec) -> BatchSpec:
    """The batch without the tangents: what the model is bound to."""
    if not isinstance(spec, TangentSpec):
        return spec
    return BatchSpec(arrays=spec.arrays, layout=spec.layout, dtype=spec.dtype, n=spec.n,
                     unknown_shape=spec.unknown_shape, names=spec.names,
                     finite_check=spec.finite_check, xp=spec.xp)


def _with_tangents(spec: BatchSpec, v: Any, nan_policy: NanPolicy, device: Any = None
                   ) -> TangentSpec:
    """The batch with the tangents ``v`` checked and of the batch's kind (on ``device``)."""
    if v is None:
        raise InputError("hvp() needs the tangents `v`: one row per instance, shaped like the "
                         f"unknowns, i.e. ({spec.n}, {', '.join(map(str, spec.unknown_shape))}).")
    xp = spec.xp
    arr = np.asarray(v) if xp.kind == "numpy" else as_native(v, "v", xp, device)
    shape, dt = tuple(int(d) for d in arr.shape), xp.dtype_of(arr)
    want = (spec.n, *spec.unknown_shape)
    if shape != want:
        raise InputError(f"`v` has shape {shape}, but the unknowns have shape {want}: it "
                         f"needs one tangent per instance, shaped like that instance's unknowns.")
    if dt.kind not in "fiu":
        raise InputError(f"`v` must hold real numbers; got dtype {dt}.")
    if nan_policy == "raise":
        cast = xp.cast(arr, spec.dtype)
        if xp.kind == "numpy" or not xp.all_finite(cast):  # (on the device: a bool comes back)
            check_finite_rows(xp.to_numpy(cast), "v", 0, whole=True)
    return TangentSpec.of(spec, arr)


def plan_second(spec: BatchSpec, bound: _backends.BoundModel, kind: SecondKindArg, *,
                mode: OrderArg, chunk_size: int | None, max_memory: int | str | None
                ) -> SecondPlan:
    assert bound.output_shape is not None
    m = math.prod(bound.output_shape)
    in_elems = sum(math.prod(a.shape[1:]) for a in spec.arrays)
    budget = memory_budget(bound, max_memory)

    def plan(order: OrderArg) -> SecondPlan:
        return make_second_plan(kind=kind, n=spec.n, k=spec.k, m=m, in_elems=in_elems,
                                dtype=spec.dtype, order=order, chunk_size=chunk_size,
                                max_memory=budget,
                                reductions_over_forward=bound.reductions_over_forward,
                                forward_hessian=bound.forward_hessian)

    chosen = plan(mode)
    if mode == "auto" and chosen.order in bound.tuning.failed_orders:
        # an order that failed for this model (OrderFailedError): the other one
        other = plan("forward-over-reverse")
        return replace(other, reason=other.reason.replace(
            "mode='forward-over-reverse' was asked for",
            f"{chosen.order} cannot differentiate this model twice"))
    return chosen


def result_shapes(spec: BatchSpec, output_shape: tuple[int, ...], kind: SecondKindArg
                  ) -> dict[str, tuple[int, ...]]:
    """The shape of each named result of ``kind`` for the whole batch."""
    y = (spec.n, *output_shape)
    unk = spec.unknown_shape
    main = {"hessian": (*y, *unk, *unk), "diagonal": (*y, *unk), "laplacian": y,
            "hvp": (*y, *unk)}[kind]
    return {SECOND_RESULT[kind]: main, "outputs": y, "jacobians": (*y, *unk)}


def _compute(bound: _backends.BoundModel, spec: BatchSpec, kind: SecondKindArg,
             plan: SecondPlan, *, backend: str, return_outputs: bool, return_jacobian: bool,
             out: Any, explain: bool, progress: bool | Callable[[int], None]) -> Any:
    assert bound.output_shape is not None
    what = Derivative(kind, return_outputs, return_jacobian)
    name = what.result
    shapes = result_shapes(spec, bound.output_shape, kind)
    if out is not None:
        check_out(out, shapes[name], spec.dtype, name)
    asked = [n for n, flag in (("outputs", return_outputs), ("jacobians", return_jacobian)) if flag]
    if spec.n == 0:
        if explain:
            sys.stderr.write(f"batchjac: {plan.reason}\n")
        empty = {n: np.empty(s, spec.dtype) for n, s in shapes.items()}
        if out is not None:
            empty[name] = out
        return _unpack(empty, name, asked)

    def run(kernel: _backends.Kernel, plan: SecondPlan) -> Results:
        if out is None and plan.n_chunks == 1:
            return run_single(kernel, spec)
        sink, finish = named_results(spec, {n: shapes[n] for n in (name, *asked)}, {name: out})
        bar = progress_bar(progress, spec.n)
        try:
            run_chunks(kernel, spec, sink, on_chunk=bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
        return finish()

    # the rows ladder (smaller chunks can run a Hessian much faster than one large one:
    # docs/thresholds.md) and the kernel's builds (TensorFlow: graph, XLA) race only when the
    # work seen repays it, in the ledger of second-order work
    result = compute(bound, spec, what, plan, backend=backend,
                     rows_free=out is None and plan.budget_rows is not None, run=run,
                     explain=explain)
    return _unpack(result, name, asked)


def _unpack(result: Results, name: str, asked: list[str]) -> Any:
    if not asked:
        return result[name]
    return (*(result[n] for n in asked), result[name])
