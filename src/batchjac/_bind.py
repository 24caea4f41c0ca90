"""Binding a model to a batch: the pipeline step between validation and the runner.

``prepare`` binds the model to the batch signature (cached per model and signature by the
backend) and runs the one-off probes; ``plan_for`` turns the bound model's output shape and the
options into a :class:`~batchjac._plan.Plan`. Every verb (``jacobian``, stores, Dask workers,
``check``, ``propagate``, ``solve``) starts here, so this module imports nothing above it.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Literal

from . import _backends
from ._config import default_max_memory, parse_bytes, probes_enabled
from ._plan import ModeArg, Plan, make_plan
from ._probes import run_probes
from ._spec import BatchSpec

BackendName = Literal["tensorflow", "torch", "jax"]


def prepare(model: Any, spec: BatchSpec, backend: str, options: dict[str, Any]
            ) -> _backends.BoundModel:
    """Bind the model to the batch signature (cached) and run the one-off probes."""
    be = _backends.get_backend(backend)
    sig = _backends.Signature(layout=spec.layout, dtype=spec.dtype,
                              unknown_shape=spec.unknown_shape, ctx=spec.ctx_specs())
    bound = _backends.bind(be, model, sig, **options)
    if getattr(bound, "_source", None) is None:  # what the tuning cache fingerprints, if asked
        try:
            bound._source = weakref.ref(model)  # type: ignore[attr-defined]
        except TypeError:  # not weakly referenceable: no cached decisions for it
            bound._source = lambda: None  # type: ignore[attr-defined]
    bound.refresh()
    if not bound.probed:
        unknown_name = spec.names[0 if spec.layout.kind == "concat" else spec.layout.wrt_index]
        if probes_enabled():
            run_probes(bound, spec, unknown_name)
        else:  # still need the output shape
            u, ctx = spec.chunk(0, min(spec.n, 2))
            bound.output_shape = tuple(bound.forward(u, ctx).shape[1:])
            bound.probed = True
    return bound


def plan_for(spec: BatchSpec, bound: _backends.BoundModel, *, mode: ModeArg,
             chunk_size: int | None, max_memory: int | str | None) -> Plan:
    assert bound.output_shape is not None
    m = math.prod(bound.output_shape)
    in_elems = sum(math.prod(a.shape[1:]) for a in spec.arrays)
    budget = default_max_memory() if max_memory is None else parse_bytes(max_memory)
    plan = make_plan(n=spec.n, k=spec.k, m=m, in_elems=in_elems, dtype=spec.dtype, mode=mode,
                     chunk_size=chunk_size, max_memory=budget)
    return plan
