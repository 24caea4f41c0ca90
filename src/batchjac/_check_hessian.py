"""``check_hessian``: batchjac's per-instance Hessians against central finite differences of
the Jacobian, instance by instance.

The reference differentiates the model once by autodiff (its float64 Jacobian, computed by
batchjac's first-order kernels, which :func:`batchjac.check` verifies against differences of
the outputs) and once by central differences: ``H_fd[:, :, :, j] = (J(x + h_j e_j) -
J(x - h_j e_j)) / (2 h_j)``. Second-order differences of the outputs alone would lose half
the digits (their error is ``eps^(1/2)`` at best); differences of an exact Jacobian keep
``eps^(2/3)``, ~1e-11 in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._bind import prepare
from ._check import DEFAULT_RTOL, FLOAT32_REFERENCE_RTOL, _column_scale, _pick
from ._errors import BatchJacError, InputError, add_context
from ._evaluate import bind, context, output_size, subset, with_dtype
from ._hessian import _compute, plan_second
from ._loaders import as_model
from ._plan import OrderArg, choose_mode
from ._runner import call, pad_args
from ._spec import BatchSpec
from ._validate import DTypeLike, normalize

#: instances whose perturbed copies go through one Jacobian kernel call
FD_INSTANCES = 64


@dataclass
class HessianCheckReport:
    """The result of :func:`check_hessian`. ``str(report)`` is the readable report."""

    passed: bool
    #: ``max |H_i - H_fd,i| / max |H_fd,i|`` for each checked instance (``instances`` order)
    max_rel_error: np.ndarray
    instances: np.ndarray
    rtol: float
    reference_dtype: str
    compute_dtype: str
    backend: str
    order: str
    n_total: int
    failed: np.ndarray
    rel_step: float
    notes: list[str] = field(default_factory=list)

    @property
    def max_error(self) -> float:
        return float(self.max_rel_error.max()) if self.max_rel_error.size else 0.0

    def __str__(self) -> str:
        n = len(self.instances)
        which = "all" if n == self.n_total else f"a random sample of {n} of {self.n_total}"
        lines = [f"batchjac check (Hessians): {'PASSED' if self.passed else 'FAILED'}",
                 f"  backend {self.backend}, {self.order}, Hessians in {self.compute_dtype}",
                 f"  reference: central finite differences of the {self.reference_dtype} "
                 f"Jacobian, step {self.rel_step:.1e} x max(|x|, column scale) per unknown",
                 f"  checked {which} instances; tolerance: max |H - H_fd| / max |H_fd| <= "
                 f"{self.rtol:.1e} per instance"]
        lines.extend(f"  note: {note}" for note in self.notes)
        if n:
            worst = int(np.argmax(self.max_rel_error))
            lines.append(f"  error: median {np.median(self.max_rel_error):.2e}, worst "
                         f"{self.max_error:.2e} (instance {int(self.instances[worst])})")
        ids = ", ".join(str(int(i)) for i in self.failed[:8])
        lines.append(f"  failed: {len(self.failed)} instance(s)" + (f" [{ids}]" if ids else ""))
        return "\n".join(lines)


def check_hessian(
    model: Any,
    *inputs: Any,
    wrt: Any = None,
    rtol: float | None = None,
    sample: int | Sequence[int] | np.ndarray | None = None,
    seed: int = 0,
    mode: OrderArg = "auto",
    dtype: DTypeLike = None,
    rel_step: float | None = None,
    max_memory: int | str | None = None,
    backend: str | None = None,
    backend_options: dict[str, Any] | None = None,
) -> HessianCheckReport:
    """Compare batchjac's per-instance Hessians with central finite differences of the
    model's float64 Jacobian (float32 where no float64 copy of the model can be made: the
    report says so and the tolerance is widened to at least ``1e-2``).

    ``inputs``, ``wrt``, ``mode``, ``dtype``, ``backend`` and ``backend_options`` are those of
    :func:`batchjac.hessian`; ``sample``, ``seed`` and ``rel_step`` those of
    :func:`batchjac.check`. An instance fails when ``max |H_i - H_fd,i| / max |H_fd,i|``
    exceeds ``rtol`` (default ``1e-3`` for float32 Hessians, ``1e-6`` for float64); the check
    passes when none fails. Costs ``2 k`` Jacobians per checked instance.
    """
    model = as_model(model)  # an ONNX file or ModelProto: its PyTorch module, as check takes it
    spec = normalize(inputs, wrt=wrt, dtype=dtype, nan_policy="raise")
    if spec.n == 0:
        raise InputError("The inputs have no instances (N = 0); there is nothing to check.")
    if rel_step is not None and not 0 < rel_step < 1:
        raise InputError(f"`rel_step` must be between 0 and 1 (e.g. 1e-5); got {rel_step!r}.")
    if rtol is not None and not rtol > 0:
        raise InputError(f"`rtol` must be positive; got {rtol!r}.")
    rows = _pick(spec.n, sample, seed)
    sub = spec if rows is None else subset(spec, rows)
    instances = np.arange(spec.n) if rows is None else rows
    name, bound = bind(model, sub, backend, backend_options)
    try:
        plan = plan_second(sub, bound, "hessian", mode=mode, chunk_size=None, max_memory=max_memory)
        hess = np.asarray(_compute(bound, sub, "hessian", plan, backend=name, return_outputs=False,
                                   return_jacobian=False, out=None, explain=False,
                                   progress=False), np.float64)
        ref, precision, notes = _reference(model, sub, name, backend_options or {}, rel_step)
    except BatchJacError as e:
        raise add_context(e, context(sub, name)) from e
    m, k = output_size(bound), sub.k
    flat_h, flat_ref = hess.reshape(sub.n, m * k * k), ref.reshape(sub.n, m * k * k)
    scale = np.abs(flat_ref).max(axis=1)
    errors = np.abs(flat_h - flat_ref).max(axis=1) / np.where(scale > 0, scale, 1.0)
    compute = sub.dtype.name
    tol = DEFAULT_RTOL.get((compute, precision.name), FLOAT32_REFERENCE_RTOL) if rtol is None \
        else float(rtol)
    if precision == np.float32 and tol < FLOAT32_REFERENCE_RTOL:
        tol = FLOAT32_REFERENCE_RTOL
    step = _step(precision, rel_step)
    return HessianCheckReport(
        passed=bool((errors <= tol).all()), max_rel_error=errors, instances=instances, rtol=tol,
        reference_dtype=precision.name, compute_dtype=compute, backend=name, order=plan.order,
        n_total=spec.n, failed=instances[errors > tol], rel_step=step, notes=notes)


def _step(precision: np.dtype, rel_step: float | None) -> float:
    return float(np.finfo(precision).eps ** (1 / 3)) if rel_step is None else float(rel_step)


def _reference(model: Any, sub: BatchSpec, name: str, options: dict[str, Any],
               rel_step: float | None) -> tuple[np.ndarray, np.dtype, list[str]]:
    """The finite-difference Hessians ``(n, m, k, k)`` (float64 arrays), the precision of
    the Jacobians they come from, and notes for the report."""
    spec64, notes = with_dtype(sub, np.float64), []
    precision: np.dtype[Any]
    try:
        bound = prepare(model, spec64, name, options)
        precision = np.dtype(np.float64)
    except BatchJacError as e:
        spec64, bound, precision = sub, prepare(model, sub, name, options), np.dtype(np.float32)
        notes.append(f"no float64 copy of the model could be made, so the reference Jacobians "
                     f"are float32 and the tolerance is widened "
                     f"({str(e).strip().splitlines()[0]})")
    k, m = spec64.k, output_size(bound)
    rows = min(FD_INSTANCES, spec64.n)
    # every call has the perturbed copies of ``rows`` instances: one kernel, one shape
    kernel = bound.kernel(choose_mode("auto", k, m)[0], rows * 2 * k, False)
    step = _step(precision, rel_step)
    col = _column_scale(spec64)  # the step's scale per unknown, as check's
    signs = np.concatenate([np.eye(k), -np.eye(k)])  # (2k, k): +e_j then -e_j
    out = np.empty((spec64.n, m, k, k))
    for lo in range(0, spec64.n, rows):
        hi = min(lo + rows, spec64.n)
        u, ctx = spec64.chunk(lo, hi)
        flat = u.reshape(hi - lo, k).astype(np.float64)
        h = step * np.maximum(np.abs(flat), col)  # (rows, k)
        pert = flat[:, None, :] + signs[None] * h[:, None, :]  # (rows, 2k, k)
        taken = (pert[:, :k] - pert[:, k:])[:, np.arange(k), np.arange(k)]  # the steps taken
        uu = pert.reshape(-1, *spec64.unknown_shape).astype(spec64.dtype)
        cc = tuple(np.repeat(c, 2 * k, axis=0) for c in ctx)
        n_rows = uu.shape[0]
        jac = call(kernel, *pad_args(uu, cc, kernel.chunk_size),
                   f"the reference Jacobians of rows {lo}:{hi}", rows=n_rows,
                   zero_check=False)["jacobians"]
        jac = np.asarray(jac, np.float64).reshape(hi - lo, 2 * k, m, k)
        diff = (jac[:, :k] - jac[:, k:]) / taken[:, :, None, None]  # (rows, j, m, i)
        out[lo:hi] = diff.transpose(0, 2, 3, 1)
    return out, precision, notes
