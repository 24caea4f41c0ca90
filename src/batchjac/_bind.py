"""Binding a model to a batch: the pipeline step between validation and the runner.

``prepare`` binds the model to the batch signature (cached per model and signature by the
backend) and runs the one-off probes; ``plan_for`` turns the bound model's output shape and the
options into a :class:`~batchjac._plan.Plan`. Every verb (``jacobian``, stores, Dask workers,
``check``, ``propagate``, ``solve``) starts here, so this module imports nothing above it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from . import _backends
from ._config import default_max_memory, parse_bytes, probes_enabled
from ._errors import BatchJacError, RebindWarning
from ._plan import ModeArg, Plan, in_mixed_mode, make_plan
from ._probes import check_model, diagnose, run_probes
from ._spec import BatchSpec
from ._tune.policy import persist_probes, recall_probes
from ._tune.state import Ledger

BackendName = Literal["tensorflow", "torch", "jax"]

T = TypeVar("T")

#: rows of a framework's (device) arrays copied to the host for the one-off probes (which
#: read the first 64 rows)
PROBE_HOST_ROWS = 64


def prepare(model: Any, spec: BatchSpec, backend: str, options: dict[str, Any], *,
            overlap: bool = False) -> _backends.BoundModel:
    """Bind the model to the batch signature (cached) and run the one-off probes.

    With ``overlap``, a backend that can tell the output shape without compiling (JAX) runs
    the probes in a background thread while the caller compiles and runs its first kernel
    (XLA compiles outside Python's lock, and the probes' own compilation is most of what they
    cost); the caller must then call :func:`probed` before it hands out a result.

    A model that fails on its first call (in the probes, or while a float64 copy is built) gets
    the clearer error :func:`~batchjac._probes.diagnose` finds, if the inputs' shapes explain
    the failure."""
    be = _backends.get_backend(backend)
    check_model(model)
    try:
        return _prepare(be, model, spec, backend, options, overlap=overlap)
    except BatchJacError as e:
        better = diagnose(model, spec, e)
        if better is None:
            raise
        raise better from e


def _prepare(be: _backends.Backend, model: Any, spec: BatchSpec, backend: str,
             options: dict[str, Any], *, overlap: bool) -> _backends.BoundModel:
    sig = _backends.Signature(layout=spec.layout, dtype=spec.dtype,
                              unknown_shape=spec.unknown_shape, ctx=spec.ctx_specs())
    bound = _backends.bind(be, model, sig, **options)
    if bound.tuning.source is None:  # what the tuning cache fingerprints, if asked
        try:
            bound.tuning.source = weakref.ref(model)
        except TypeError:  # not weakly referenceable: no cached decisions for it
            bound.tuning.source = lambda: None
    bound.refresh()
    if bound.probed:
        _remember_code(bound, backend)
        return bound
    # threads sharing a bound model probe it once: the others wait here, then find it probed
    with bound.prepare_lock:
        return _probe_once(be, model, spec, backend, bound, overlap=overlap)


def _probe_once(be: _backends.Backend, model: Any, spec: BatchSpec, backend: str,
                bound: _backends.BoundModel, *, overlap: bool) -> _backends.BoundModel:
    pending = bound.probing
    if pending is not None:  # started beside another thread's first kernel: their verdict
        pending.result()  # raises what they found (that thread's probed() resets the bound)
        return bound
    if not bound.probed and not _same_code(model, bound, backend) \
            and not (probes_enabled() and recall_probes(bound, backend)):
        spec = spec.on_host(PROBE_HOST_ROWS)  # (a framework's arrays: a few rows to the host)
        unknown_name = spec.names[0 if spec.layout.kind == "concat" else spec.layout.wrt_index]
        if probes_enabled() and overlap and _start_probes(bound, spec, unknown_name, backend):
            return bound
        if probes_enabled():
            run_probes(bound, spec, unknown_name)
            persist_probes(bound, backend, later=_PROBES.submit)  # (its fsync: 5-20 ms)
        else:  # still need the output shape
            u, ctx = spec.chunk(0, min(spec.n, 2))
            bound.output_shape = tuple(bound.forward(u, ctx).shape[1:])
            bound.probed = True
    if bound.probed:
        _remember_code(bound, backend)
    return bound


#: the longest the probes beside a first kernel wait for the caller to start compiling it
PROBE_WAIT = 10.0
_PROBES = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchjac-probes")


def _start_probes(bound: _backends.BoundModel, spec: BatchSpec, name: str, backend: str) -> bool:
    """Start the probes beside the caller's first kernel, if the output shape is known
    without them (the plan needs it). False: the caller runs them now."""
    u, ctx = spec.chunk(0, min(spec.n, 2)) if spec.n else (None, ())
    shape = bound.output_shape_of(u, ctx) if u is not None and len(u) else None
    if shape is None:
        return False
    # (JAX: from the trace that told the shape; the plan cuts chunks to the cache with it)
    assert u is not None
    bound.row_bytes = bound.row_working_set(u, ctx)

    settings = bound.in_thread()  # the caller's framework settings (JAX's x64 mode)

    def probe() -> None:
        # not while the caller traces its kernel (both would take turns at Python's lock)
        bound.compiling.wait(PROBE_WAIT)
        with settings:
            run_probes(bound, spec, name)
        _remember_code(bound, backend)
        # the verdict's file (an fsync: 5-20 ms) is written after the caller stops waiting
        persist_probes(bound, backend, later=_PROBES.submit)

    bound.output_shape = shape
    bound.probing = _PROBES.submit(probe)
    return True


def beside_probes(bound: _backends.BoundModel, compute: Callable[[], T],
                  dropped: Callable[[], object] = lambda: None) -> T:
    """``compute()``, then the probes started beside it (:func:`prepare` with ``overlap``)
    waited for: what they found (a model they refuse) is raised, and the result dropped, with
    ``dropped()`` called; where the computation failed, a probe's finding explains it better
    and is raised in its place. The one way the verbs hand out a result computed beside the
    probes."""
    try:
        result = compute()
    except BaseException as failure:
        try:
            probed(bound)
        except BatchJacError as found:
            dropped()
            raise found from failure
        raise
    try:
        probed(bound)  # before the result is handed out: a probe may refuse the model
    except BaseException:
        dropped()
        raise
    return result


def probed(bound: _backends.BoundModel) -> None:
    """Wait for probes started beside the first kernel; raise what they found (a model whose
    output is not connected, rows that interact): the result computed meanwhile is dropped."""
    future = bound.probing
    if future is None:
        return
    bound.compiling.set()  # (a call that failed before compiling: the probes need not wait)
    try:
        future.result()
    except BaseException:
        bound.probed = False  # the next call probes again, in full, and raises again
        bound.output_shape = None
        raise
    finally:
        bound.probing = None


@dataclass
class _Sibling:
    """What binding a function taught, for new function objects with the same code."""

    output_shape: tuple[int, ...]
    row_bytes: float | None
    ledger: Ledger  # the first bound model's tuning ledger
    tuned: dict[Any, Any]
    tuned_rows: dict[Any, Any]
    binds: int = 1
    warned: bool = False


#: computation fingerprint and signature -> what its first bound model learnt (probes passed,
#: the output shape, the tuning decisions); bounded, least recently used dropped first
_SIBLINGS: OrderedDict[tuple[str, str, str], _Sibling] = OrderedDict()
_MAX_SIBLINGS = 256
#: new function objects of one code after which a warning names the cost of rebinding
REBIND_WARNING = 3


def _code_key(model: Any, bound: _backends.BoundModel, backend: str) -> tuple[str, str, str] | None:
    """Plain functions only (closures, lambdas, partials): the everyday ``jacobian(lambda z:
    net(params, z), ...)`` in a loop passes a new one per call. Modules and Keras models are
    bound once per object and have state of their own; they are not matched by code."""
    stateless = isinstance(model, (types.FunctionType, functools.partial)) or \
        getattr(type(model), "__batchjac_backend__", None) == "numpy"  # batchjac.ClosedForm
    if not stateless:
        return None
    from ._fingerprint import computation_fingerprint

    return computation_fingerprint(model), repr(bound.signature), backend


def _same_code(model: Any, bound: _backends.BoundModel, backend: str) -> bool:
    """A new function object with the code (and closure shapes) of one bound before: it passed
    the same probes, so it is not probed again, and it starts from the decisions the first
    one's calls took (as the native ``jit(vmap(jacrev(f)))`` rebuilt per call would)."""
    key = _code_key(model, bound, backend)
    bound.tuning.code_key = key
    sibling = _SIBLINGS.get(key) if key is not None else None
    if sibling is None:
        return False
    _SIBLINGS.move_to_end(key)  # type: ignore[arg-type]
    bound.output_shape = sibling.output_shape
    bound.row_bytes = sibling.row_bytes
    bound.probed = True
    bound.tuning.ledger = sibling.ledger
    bound.tuned.update(sibling.tuned)
    bound.tuned_rows.update(sibling.tuned_rows)
    sibling.binds += 1
    # worth a word only where the rebinding costs something (JAX and TensorFlow compile)
    if sibling.binds >= REBIND_WARNING and not sibling.warned and bound.compiles_kernels:
        sibling.warned = True
        cost = sibling.ledger.compile_seconds
        warnings.warn(
            f"batchjac was given {sibling.binds} new function objects with the same code; each "
            f"one is traced and compiled again (about {cost:.2f} s each, against "
            f"{(sibling.ledger.seconds_per_row or 0) * 1e6:.1f} us a row of compute). Define the "
            f"function once outside the loop and pass what changes as arguments: "
            f"backend_options={{'params': params}} with a model f(params, x).",
            RebindWarning, stacklevel=4)
    return True


def _remember_code(bound: _backends.BoundModel, backend: str) -> None:
    key = bound.tuning.code_key
    if key is None or bound.output_shape is None or key in _SIBLINGS:
        return
    _SIBLINGS[key] = _Sibling(bound.output_shape, bound.row_bytes, bound.tuning.ledger, bound.tuned,
                              bound.tuned_rows)
    while len(_SIBLINGS) > _MAX_SIBLINGS:
        _SIBLINGS.popitem(last=False)


def plan_for(spec: BatchSpec, bound: _backends.BoundModel, *, mode: ModeArg,
             chunk_size: int | None, max_memory: int | str | None) -> Plan:
    assert bound.output_shape is not None
    m = math.prod(bound.output_shape)
    in_elems = sum(math.prod(a.shape[1:]) for a in spec.arrays)
    mixed = bound.accumulation() if mode == "auto" else None
    plan = make_plan(n=spec.n, k=spec.k, m=m, in_elems=in_elems, dtype=spec.dtype, mode=mode,
                     chunk_size=chunk_size, max_memory=memory_budget(bound, max_memory),
                     forward_bias=bound.forward_bias,
                     basis=None if mixed is None else mixed[1].passes)
    if mixed is not None:
        plan = in_mixed_mode(plan, spec.n, why=mixed[1].describe(),
                             result_row_bytes=spec.dtype.itemsize * m * (spec.k + 1))
    return plan


def memory_budget(bound: _backends.BoundModel, max_memory: int | str | None) -> int:
    """The bytes a chunk may take, for every derivative kind: ``max_memory`` where given;
    computing on a GPU, from the device's free memory, not the host's."""
    if max_memory is not None:
        return parse_bytes(max_memory)
    return default_max_memory(bound.device_free_memory())
