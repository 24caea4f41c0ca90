"""The public entry point: per-instance Jacobians."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _backends, _differentiable
from ._arrays import OutputArg, deliver, in_memory, native_options, on_host, resolve
from ._bind import BackendName, beside_probes, plan_for, prepare
from ._compute import Derivative, check_out, compute, context
from ._dask import uses_dask
from ._errors import BatchJacError, add_context
from ._loaders import as_model
from ._plan import ModeArg, Plan, check_options
from ._runner import Results, call, run_chunks, run_single
from ._spec import BatchSpec
from ._stores import StoreError, as_store, compute_to_store, is_store_target, progress_bar
from ._tune import chooser as _chooser, fastpath as _fastpath, policy as tuning
from ._validate import DTypeLike, NanPolicy, normalize

log = logging.getLogger("batchjac")

def jacobian(
    model: Any,
    *inputs: Any,
    wrt: Any = None,
    mode: ModeArg = "auto",
    chunk_size: int | None = None,
    max_memory: int | str | None = None,
    dtype: DTypeLike = None,
    return_outputs: bool = False,
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
) -> Any:
    """Per-instance Jacobians ``J[i] = d model(inputs_i) / d unknown_i``.

    Call forms:

    - ``jacobian(model, x)``: every feature of ``x`` is unknown;
    - ``jacobian(model, unknown, known)``: the model takes ``concat([unknown, known], -1)``;
    - ``jacobian(model, x, wrt=[0, 1, 4])`` or ``wrt=slice(0, 5)``: unknown columns of ``x``;
    - ``jacobian(model, {"x": X, "h": H}, wrt="x")`` or ``jacobian(model, (X, H), wrt=0)``
      for multi-input models; ``wrt=("x", [0, 2])`` for some columns of one input.

    Returns an array of shape ``(N, *output_shape, *unknown_shape)`` (the per-instance
    convention of ``torch.func.jacrev``/``jax.jacrev``), or ``(outputs, jacobians)`` with
    ``return_outputs=True`` (the outputs come from the same pass). The result has the kind and
    device of the inputs: numpy for numpy arrays (lists, tables, files), a torch tensor on the
    input's device for torch tensors, a JAX array (committed where the input was) for JAX
    arrays, a TensorFlow tensor for TensorFlow tensors; ``output="numpy"`` (or "torch", "jax",
    "tensorflow") asks for a kind. When the inputs are the model's framework's arrays they
    stay on their device throughout; other kinds are converted once (see
    :mod:`batchjac._arrays`). A result computed in one
    chunk by TensorFlow or JAX is a read-only view of the framework's buffer (no copy of what
    may be gigabytes): ``.copy()`` it to write into it, or pass ``out=``.

    Options: ``mode`` ("auto" picks forward mode when the unknowns are fewer than the
    outputs), ``chunk_size`` or ``max_memory`` (bytes or "1GB"; default from
    ``BATCHJAC_MAX_MEMORY``), ``dtype`` (float32 unless asked or the inputs are float64),
    ``nan_policy`` ("raise" or "propagate"), ``out`` (a writable array of the result's shape,
    e.g. an ``np.memmap``, filled in place chunk by chunk), ``backend`` (detected from the
    model's type unless given), ``explain`` (print the plan and why to stderr; it is also
    logged at debug level on the "batchjac" logger), ``progress`` (a progress bar on stderr,
    or a function called with the number of rows of each finished chunk).

    Inputs may also be files, read chunk by chunk: a path (``.npy``, ``.npz:key``, ``.csv``,
    ``.tsv``, ``.parquet``, ``.h5:/dataset``, ``.zarr``), an h5py dataset, a Zarr array or an
    ``np.memmap``; with column names (CSV, Parquet) ``wrt`` may name columns.
    ``out`` may be a path (``"jac.zarr"``, ``"jac.h5"``, ``"jac.npy"``) or a
    :class:`batchjac.Store`: the result is written there chunk by chunk, memory
    stays flat however many rows there are, and a call that was killed continues where it
    stopped when made again (bitwise the same result). It then returns a
    :class:`batchjac.StoreResult` (path, rows, mode, chunk size, chunks resumed and
    computed, time; ``.open()`` reads the stored array lazily). With ``return_outputs=True``
    the store holds the outputs too.

    Scale-out on Dask: ``client=`` (a ``dask.distributed.Client``) or ``scheduler=`` (an
    address, or ``"local:N"`` for N local single-threaded worker processes). Dask arrays as
    inputs give a lazy Dask array of Jacobians with the same row chunks; numpy inputs are
    split into ``rows_per_task`` blocks and computed on the cluster; with ``out=`` a store,
    the workers write their chunks into it directly, with the same resume guarantees.

    ``differentiable=True``: the Jacobians inside the framework's graph, for a training loss
    (a Jacobian penalty, a physics-informed residual): its gradient reaches the model's
    parameters and the inputs that require it (torch tensors, JAX arrays and tracers inside
    ``jax.jit``/``jax.grad``, TensorFlow tensors under a ``tf.GradientTape``). The mode is
    chosen from the shapes, never timed; under ``max_memory`` the rows are cut into chunks,
    each recomputed in the backward pass (:mod:`batchjac._differentiable`). Not with
    ``out=``, Dask or ``progress``.

    >>> import numpy as np, batchjac
    >>> from batchjac.examples import seed_model
    >>> model = seed_model("tensorflow")          # 5 unknown + 3 known inputs -> 4 outputs
    >>> rng = np.random.default_rng(0)
    >>> unknown, known = rng.normal(size=(1000, 5)), rng.normal(size=(1000, 3))
    >>> J = batchjac.jacobian(model, unknown.astype("f4"), known.astype("f4"))
    >>> J.shape
    (1000, 4, 5)
    """
    if differentiable is not False:
        _differentiable.refuse(out=out, client=client, scheduler=scheduler, progress=progress)
        return _differentiable.derivatives(
            model, inputs, "jacobian", wrt=wrt, mode=mode, chunk_size=chunk_size,
            max_memory=max_memory, dtype=dtype, return_outputs=return_outputs,
            return_jacobian=False, nan_policy=nan_policy, backend=backend,
            backend_options=backend_options, explain=explain, output=output)
    model = as_model(model)  # an ONNX file or ModelProto: its PyTorch module
    if client is not None or scheduler is not None or (
            any(type(a) is not np.ndarray for a in inputs) and uses_dask(inputs)):
        return _on_dask(model, inputs, client=client, scheduler=scheduler, rows_per_task=rows_per_task,
                        out=out, output=output, kw={"wrt": wrt, "mode": mode, "chunk_size": chunk_size,
                                     "max_memory": max_memory, "dtype": dtype,
                                     "return_outputs": return_outputs, "nan_policy": nan_policy,
                                     "backend": backend, "backend_options": backend_options,
                                     "explain": explain, "progress": progress})
    model = _backends.canonical(model)  # a new function object that computes what one did
    fast = None
    if out is None and not explain and not progress and backend_options is None and \
            output in ("auto", "numpy"):
        fast = _fastpath.key(model, inputs, (_wrt_key(wrt), mode, chunk_size, max_memory, str(dtype),
                                             return_outputs, nan_policy, backend))
        entry = _fastpath.lookup(fast, model) if fast is not None else None
        if entry is not None:
            start = time.perf_counter()
            try:
                done = _fast(entry, inputs, return_outputs, _backends.asking(mode))
            except BatchJacError as e:
                raise add_context(e, context(entry.template, entry.backend)) from e
            if done is not None:
                if tuning.repeated(entry.bound, entry.template.n, time.perf_counter() - start):
                    _fastpath.forget(fast)  # a race is due: the next call takes the full path
                return done
    delivery = resolve(inputs, output, lambda: backend or _backends.detect(model), out=out)
    spec = normalize(inputs, wrt=wrt, dtype=dtype, nan_policy=nan_policy, xp=delivery.xp,
                     device=delivery.device)
    name = backend or _backends.detect(model)
    check_options(mode, chunk_size, max_memory)  # before a store exists: nothing left behind
    try:
        # a mode asked for is computed or refused, never swapped for the other
        # (CallBudget.mode_asked)
        if is_store_target(out):
            return compute_to_store(model, spec, name, store=as_store(out), mode=mode,
                                    chunk_size=chunk_size, max_memory=max_memory,
                                    return_outputs=return_outputs, nan_policy=nan_policy,
                                    options=backend_options or {}, explain=explain,
                                    progress=progress)
        options = native_options(delivery, name, model, backend_options or {})
        return deliver(_compute(model, spec, name, mode=mode, chunk_size=chunk_size,
                                max_memory=max_memory, return_outputs=return_outputs,
                                out=out, options=options, explain=explain,
                                progress=progress, fast_key=fast), delivery)
    except StoreError:  # about the output, not the model or inputs: no context to add
        raise
    except BatchJacError as e:
        raise add_context(e, context(spec, name)) from e


def _fast(entry: _fastpath.Entry, inputs: tuple[Any, ...], return_outputs: bool,
          budget: _backends.CallBudget) -> Any:
    """A repeated call with the shapes, model and options of a remembered one: the compiled
    kernel at once, inside the runner's error boundary (its calls carry ``budget``: the mode
    asked for). None when a check fails: the full path then raises the detailed error (or
    retraces for a changed model)."""
    made = entry.bound.kernel(entry.plan.mode, entry.plan.chunk_size, return_outputs)
    if _chooser.calls_race_now(made) or tuning.racing_on_calls(entry.bound):
        return None  # a race rides on the calls: the full path times them
    kernel = _backends.under(made, budget)
    n = entry.template.n
    if entry.direct and _fastpath.same_layout(entry, inputs):
        u, ctx = inputs[0], tuple(inputs[1:])
        if kernel.asynchronous:
            # start it, then check the inputs and the model while it computes: a failed
            # check discards the result and takes the full path (which raises or retraces)
            try:
                pending = kernel.launch(u, ctx)
            except Exception:  # e.g. JAX's x64 mode switched off: the full path explains
                pending = None
            if pending is not None:
                if _fastpath.finite(inputs) and not entry.bound.refresh():
                    return _unpack(call(lambda *_: pending(), u, ctx, f"rows 0:{n}"), return_outputs)
                pending()
        elif _fastpath.finite(inputs) and not entry.bound.refresh():
            return _unpack(call(kernel, u, ctx, f"rows 0:{n}"), return_outputs)
    spec = _fastpath.spec_for(entry, inputs)
    if spec is None:
        return None
    entry.bound.refresh()
    kernel = _backends.under(entry.bound.kernel(entry.plan.mode, entry.plan.chunk_size,
                                                return_outputs), budget)
    if entry.plan.n_chunks == 1:
        return _unpack(run_single(kernel, spec), return_outputs)
    return _run_in_memory(kernel, spec, entry.bound, return_outputs, None, False)


def _unpack(out: Results, return_outputs: bool) -> Any:
    """The in-memory result as the public call returns it: J, or (y, J)."""
    return (out["outputs"], out["jacobians"]) if return_outputs else out["jacobians"]


def _on_dask(model: Any, inputs: tuple[Any, ...], *, client: Any, scheduler: str | None,
             rows_per_task: int | None, out: Any, output: OutputArg, kw: dict[str, Any]) -> Any:
    """The Dask paths: a store written by the workers, or in-memory results (lazy for Dask
    inputs; else in the inputs' array kind, or ``output``'s). The per-block and per-chunk work
    is handed to :mod:`batchjac._dask`, which sits below this module."""
    import functools

    from . import _dask

    if is_store_target(out):
        on_host(inputs, output, out=out)  # (a store takes host chunks: output= must agree)
    with _dask.client_for(client, scheduler) as client:
        if not is_store_target(out):
            return _dask.run(jacobian, model, inputs, client=client, rows_per_task=rows_per_task,
                             out=out, kw=kw, output=output)
        _dask.check_store_inputs(inputs, client)
        check_options(kw["mode"], kw["chunk_size"], kw["max_memory"])
        spec = normalize(inputs, wrt=kw["wrt"], dtype=kw["dtype"], nan_policy=kw["nan_policy"])
        name = kw["backend"] or _backends.detect(model)
        options = kw["backend_options"] or {}
        # a mode asked for is computed or refused on the workers too, never swapped
        on_cluster = functools.partial(_dask.store_chunks_on_cluster, client, model, name, options,
                                       asked=kw["mode"] != "auto")
        return compute_to_store(
            model, spec, name, store=as_store(out), mode=kw["mode"],
            chunk_size=kw["chunk_size"], max_memory=kw["max_memory"],
            return_outputs=kw["return_outputs"], nan_policy=kw["nan_policy"],
            options=options, explain=kw["explain"], progress=kw["progress"],
            compute_chunks=on_cluster)


def _compute(model: Any, spec: BatchSpec, backend: str, *, mode: ModeArg,
             chunk_size: int | None, max_memory: int | str | None, return_outputs: bool,
             out: Any, options: dict[str, Any], explain: bool,
             progress: bool | Callable[[int], None] = False,
             fast_key: tuple[Any, ...] | None = None) -> Any:
    bound = prepare(model, spec, backend, options, overlap=out is None)
    return beside_probes(bound, lambda: _compute_bound(
        model, bound, spec, backend, mode=mode, chunk_size=chunk_size, max_memory=max_memory,
        return_outputs=return_outputs, out=out, explain=explain, progress=progress,
        fast_key=fast_key), dropped=lambda: _fastpath.forget(fast_key))


def _compute_bound(model: Any, bound: _backends.BoundModel, spec: BatchSpec, backend: str, *,
                   mode: ModeArg, chunk_size: int | None, max_memory: int | str | None,
                   return_outputs: bool, out: Any, explain: bool,
                   progress: bool | Callable[[int], None], fast_key: tuple[Any, ...] | None) -> Any:
    plan = plan_for(spec, bound, mode=mode, chunk_size=chunk_size, max_memory=max_memory)
    assert bound.output_shape is not None
    y_shape = (spec.n, *bound.output_shape)
    j_shape = (*y_shape, *spec.unknown_shape)
    if out is not None:
        check_out(out, j_shape, spec.dtype)
    if spec.n == 0:
        jac = out if out is not None else np.empty(j_shape, spec.dtype)
        return (np.empty(y_shape, spec.dtype), jac) if return_outputs else jac

    def run(kernel: _backends.Kernel, plan: Plan) -> Any:
        if out is None and plan.n_chunks == 1:
            return _unpack(run_single(kernel, spec), return_outputs)
        return _run_in_memory(kernel, spec, bound, return_outputs, out, progress)

    def remember(plan: Plan) -> None:  # the next call with these shapes skips to the kernel
        if out is None and fast_key is not None:
            _fastpath.remember(fast_key, model, bound, plan, spec, backend)

    return compute(bound, spec, Derivative("jacobian", return_outputs), plan, backend=backend,
                   rows_free=chunk_size is None and out is None, run=run, explain=explain,
                   on_kernel=remember, mode_asked=mode != "auto")


def _run_in_memory(kernel: Any, spec: BatchSpec, bound: _backends.BoundModel,
                   return_outputs: bool, out: Any, progress: bool | Callable[[int], None]) -> Any:
    """Several chunks into ``out`` (or a new array) and, if asked, a new outputs array."""
    assert bound.output_shape is not None
    y_shape = (spec.n, *bound.output_shape)
    sink, finish = in_memory(spec, y_shape, (*y_shape, *spec.unknown_shape), out, return_outputs)
    bar = progress_bar(progress, spec.n)
    try:
        run_chunks(kernel, spec, sink, on_chunk=bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    out_y, out_j = finish()
    return (out_y, out_j) if return_outputs else out_j


def _wrt_key(wrt: Any) -> Any:
    """``wrt`` as a hashable value for the fast-path key (arrays and lists become tuples)."""
    if isinstance(wrt, slice):
        return ("slice", wrt.start, wrt.stop, wrt.step)
    if isinstance(wrt, (list, np.ndarray)):
        return ("cols", *np.asarray(wrt).ravel().tolist())
    return wrt
