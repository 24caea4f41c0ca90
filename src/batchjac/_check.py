"""``check``: batchjac's Jacobians against central finite differences, instance by instance.

The reference is computed in float64 from a float64 copy of the model when the framework
allows it (Keras: a float64 clone; PyTorch: float64 copies of the weights; JAX: needs x64
mode). When it does not, the reference is float32, the report says why, and the tolerance is
widened: a check never quietly compares against something weaker than it claims.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._bind import prepare
from ._errors import BatchJacError, InputError, add_context
from ._evaluate import (
    Evaluator,
    bind,
    block_rows,
    context,
    output_size,
    reduce_jacobians,
    subset,
    with_dtype,
)
from ._loaders import as_model
from ._plan import ModeArg, Plan
from ._spec import BatchSpec
from ._validate import DTypeLike, normalize

#: default tolerance on the per-instance error, by (compute dtype, reference dtype)
DEFAULT_RTOL = {("float32", "float64"): 1e-3, ("float64", "float64"): 1e-6}
#: the smallest tolerance used with a float32 reference (its own error is ~1e-4..1e-3)
FLOAT32_REFERENCE_RTOL = 1e-2
#: more inconclusive instances than this fraction, and the check does not pass
MAX_INCONCLUSIVE = 0.1


@dataclass(frozen=True)
class CheckEntry:
    """One Jacobian entry ``J[instance][output][unknown]`` beside its finite-difference value."""

    instance: int
    output: tuple[int, ...]
    unknown: tuple[int, ...]
    jacobian: float
    reference: float
    rel_error: float  # |J - J_fd| / max |J_fd| of the instance


@dataclass
class CheckReport:
    """The result of :func:`check`. ``str(report)`` is the readable report."""

    passed: bool
    #: ``max |J_i - J_fd,i| / max |J_fd,i|`` for each checked instance (in ``instances`` order)
    max_rel_error: np.ndarray
    #: indices (into the batch) of the checked instances, ascending
    instances: np.ndarray
    rtol: float
    reference_dtype: str
    compute_dtype: str
    backend: str
    mode: str
    n_total: int
    #: checked instances over the tolerance, and those where the finite differences themselves
    #: are unreliable (a kink or a jump within the step: one-sided differences disagree)
    failed: np.ndarray
    inconclusive: np.ndarray
    worst_entries: list[CheckEntry]
    output_shape: tuple[int, ...]
    unknown_shape: tuple[int, ...]
    notes: list[str] = field(default_factory=list)
    rel_step: float = 0.0
    unknown_labels: tuple[str, ...] = ()

    @property
    def worst_instances(self) -> np.ndarray:
        """Checked instances ordered from the largest error down (at most 5)."""
        order = np.argsort(-self.max_rel_error, kind="stable")[:5]
        return self.instances[order]

    @property
    def max_error(self) -> float:
        return float(self.max_rel_error.max()) if self.max_rel_error.size else 0.0

    def __str__(self) -> str:
        n = len(self.instances)
        lines = [f"batchjac check: {'PASSED' if self.passed else 'FAILED'}"]
        lines.append(f"  backend {self.backend}, {self.mode} mode, Jacobians in {self.compute_dtype}")
        lines.append(f"  reference: central finite differences in {self.reference_dtype}, step "
                     f"{self.rel_step:.1e} x max(|x|, column scale) per unknown")
        which = "all" if n == self.n_total else f"a random sample of {n} of {self.n_total}"
        lines.append(f"  checked {which} instances; tolerance: max |J - J_fd| / max |J_fd| "
                     f"<= {self.rtol:.1e} per instance")
        lines.extend(f"  note: {note}" for note in self.notes)
        if n:
            errs = self.max_rel_error
            lines.append(f"  error: median {np.median(errs):.2e}, worst {errs.max():.2e} "
                         f"(instance {int(self.worst_instances[0])})")
        lines.append(f"  failed: {len(self.failed)} instance(s)"
                     + (f" {_list(self.failed)}" if len(self.failed) else "")
                     + f"; inconclusive (kink or jump within the step): {len(self.inconclusive)}"
                     + (f" {_list(self.inconclusive)}" if len(self.inconclusive) else ""))
        if n:
            lines.append("  worst instances:  " + ", ".join(
                f"{int(i)} ({e:.2e})" for i, e in zip(
                    self.worst_instances,
                    np.sort(self.max_rel_error)[::-1][: len(self.worst_instances)])))
        if self.worst_entries:
            lines.append("  worst entries:")
            lines.append(f"    {'instance':>8}  {'output':>10}  {'unknown':>12}  {'J':>12}  "
                         f"{'finite diff.':>12}  {'rel. error':>10}")
            for e in self.worst_entries:
                lines.append(
                    f"    {e.instance:>8}  {_index(e.output, 'y'):>10}  "
                    f"{self._unknown_label(e.unknown):>12}  {e.jacobian:>12.5g}  "
                    f"{e.reference:>12.5g}  {e.rel_error:>10.2e}")
        return "\n".join(lines)

    def _unknown_label(self, idx: tuple[int, ...]) -> str:
        if self.unknown_labels and len(idx) == 1 and idx[0] < len(self.unknown_labels):
            return self.unknown_labels[idx[0]]
        return _index(idx, "u")


def _index(idx: tuple[int, ...], name: str) -> str:
    return f"{name}[{', '.join(map(str, idx))}]"


def _list(ids: np.ndarray, limit: int = 8) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}]"


def check(
    model: Any,
    *inputs: Any,
    wrt: Any = None,
    rtol: float | None = None,
    sample: int | Sequence[int] | np.ndarray | None = None,
    seed: int = 0,
    mode: ModeArg = "auto",
    dtype: DTypeLike = None,
    rel_step: float | None = None,
    chunk_size: int | None = None,
    max_memory: int | str | None = None,
    backend: str | None = None,
    backend_options: dict[str, Any] | None = None,
    top: int = 5,
) -> CheckReport:
    """Compare batchjac's per-instance Jacobians with central finite differences.

    ``inputs``, ``wrt``, ``mode``, ``dtype``, ``backend`` and ``backend_options`` are those of
    :func:`batchjac.jacobian`; the Jacobians checked are the ones ``jacobian`` would return
    (pass ``mode="forward"`` or ``"reverse"`` to check a given mode).

    The reference: central differences of a float64 copy of the model (float32 when no float64
    copy can be made, which the report says, with the tolerance widened to at least
    ``1e-2``). The step for unknown ``j`` of instance ``i`` is ``rel_step * max(|x_ij|, s_j)``,
    with ``s_j`` the root mean square of column ``j`` over the checked instances (1 if it is
    0) and ``rel_step = eps^(1/3)`` of the reference dtype, the optimum of central
    differences.

    The error of instance ``i`` is ``max |J_i - J_fd,i| / max |J_fd,i|`` (norm-wise, so a tiny
    entry's relative rounding error does not fail a check). An instance fails when it exceeds
    ``rtol`` (default ``1e-3`` for float32 Jacobians, ``1e-6`` for float64), unless the
    one-sided differences disagree as much as the error itself: then the finite differences
    are unreliable there (a ReLU kink within the step) and the instance is *inconclusive*.
    The check passes when no instance fails and at most 10% are inconclusive.

    ``sample``: check this many instances, drawn at random with ``seed`` (or the given
    indices); None checks all. Finite differences cost ``2 k + 1`` forward passes per instance.

    >>> import numpy as np, batchjac
    >>> from batchjac.examples import seed_model
    >>> model = seed_model("tensorflow")
    >>> rng = np.random.default_rng(0)
    >>> unknown, known = rng.normal(size=(100, 5)), rng.normal(size=(100, 3))
    >>> report = batchjac.check(model, unknown.astype("f4"), known.astype("f4"), sample=20)
    >>> report.passed, report.reference_dtype, report.max_rel_error.shape
    (True, 'float64', (20,))
    """
    model = as_model(model)
    spec = normalize(inputs, wrt=wrt, dtype=dtype, nan_policy="raise")
    if spec.n == 0:
        raise InputError("The inputs have no instances (N = 0); there is nothing to check.")
    rows = _pick(spec.n, sample, seed)
    sub = spec if rows is None else subset(spec, rows)
    instances = np.arange(spec.n) if rows is None else rows
    if rel_step is not None and not 0 < rel_step < 1:
        raise InputError(f"`rel_step` must be between 0 and 1 (e.g. 1e-5); got {rel_step!r}.")
    if top < 0:
        raise InputError(f"`top` must be >= 0; got {top!r}.")
    if rtol is not None and not rtol > 0:
        raise InputError(f"`rtol` must be positive; got {rtol!r}.")
    name, bound = bind(model, sub, backend, backend_options)
    try:
        # the mode asked for is the one checked: refused if it fails, never swapped
        # (reduce_jacobians)
        return _run(model, sub, instances, name, bound, rtol=rtol, mode=mode,
                    rel_step=rel_step, chunk_size=chunk_size, max_memory=max_memory,
                    options=backend_options or {}, top=top, n_total=spec.n)
    except BatchJacError as e:
        raise add_context(e, context(sub, name)) from e


def _pick(n: int, sample: Any, seed: int) -> np.ndarray | None:
    if sample is None:
        return None
    if isinstance(sample, (bool, np.bool_)):
        raise InputError(f"`sample` must be a number of instances or their indices; got {sample!r}.")
    if isinstance(sample, (int, np.integer)):
        if sample < 1:
            raise InputError(f"`sample` must be at least 1 (instances to check); got {sample}.")
        if sample >= n:
            return None
        return np.sort(np.random.default_rng(seed).choice(n, size=int(sample), replace=False))
    idx = np.asarray(sample)
    if idx.ndim != 1 or idx.dtype.kind not in "iu" or idx.size == 0:
        raise InputError(f"`sample` must be a number of instances or a 1-D array of instance "
                         f"indices; got {sample!r}.")
    if idx.min() < 0 or idx.max() >= n:
        raise InputError(f"`sample` holds index {int(idx.max() if idx.max() >= n else idx.min())}, "
                         f"out of range for {n} instances (0..{n - 1}).")
    return np.unique(idx)


def _reference(model: Any, sub: BatchSpec, name: str, options: dict[str, Any], bound: Any,
               block: int) -> tuple[Evaluator, BatchSpec, np.dtype, list[str]]:
    """The bound model the finite differences use, the spec that feeds it, the precision it
    really has (which sets the step and the tolerance), and notes for the report."""
    if sub.dtype == np.float64:
        ref, ref_spec = bound, sub
    else:
        spec64 = with_dtype(sub, np.float64)
        try:
            ref, ref_spec = prepare(model, spec64, name, options), spec64
        except BatchJacError as e:
            first = str(e).strip().splitlines()[0]
            return Evaluator(bound, block), sub, np.dtype(np.float32), [
                f"no float64 copy of the model could be made, so the reference is float32 and "
                f"the tolerance is widened ({first})"]
    evaluator = Evaluator(ref, block)
    if not _resolves_float64(evaluator, ref_spec):
        return evaluator, ref_spec, np.dtype(np.float32), [
            "the model in float64 does not resolve float64 perturbations (it rounds to lower "
            "precision inside), so the reference is treated as float32 and the tolerance is "
            "widened"]
    return evaluator, ref_spec, np.dtype(np.float64), []


def _resolves_float64(evaluator: Evaluator, spec: BatchSpec) -> bool:
    """Whether outputs move when the unknowns move by 1e-12 relative: true of a float64
    computation, false (for nearly every row) of one that rounds to float32 inside."""
    u, ctx = spec.chunk(0, min(spec.n, 64))
    if u.shape[0] == 0:
        return True
    flat = u.reshape(len(u), -1)
    bump = flat + 1e-12 * np.maximum(np.abs(flat), 1.0)
    y0 = evaluator(u, ctx).reshape(len(u), -1)
    y1 = evaluator(bump.reshape(u.shape), ctx).reshape(len(u), -1)
    moved = (y0 != y1).any(axis=1)
    return bool(moved.mean() >= 0.5)


def _run(model: Any, sub: BatchSpec, instances: np.ndarray, name: str, bound: Any, *,
         rtol: float | None, mode: ModeArg, rel_step: float | None, chunk_size: int | None,
         max_memory: int | str | None, options: dict[str, Any], top: int,
         n_total: int) -> CheckReport:
    k, m = sub.k, output_size(bound)
    fd_rows = max(1, block_rows(sub, m, max_memory) // (2 * k + 1))
    evaluator, ref_spec, precision, notes = _reference(model, sub, name, options, bound,
                                                       fd_rows * (2 * k + 1))
    ref_dtype = precision.name
    compute = np.dtype(sub.dtype).name
    default = DEFAULT_RTOL.get((compute, ref_dtype), FLOAT32_REFERENCE_RTOL)
    tol = default if rtol is None else float(rtol)
    if ref_dtype == "float32" and tol < FLOAT32_REFERENCE_RTOL:
        if rtol is not None:
            notes.append(f"rtol={rtol:g} widened to {FLOAT32_REFERENCE_RTOL:g} for the float32 "
                         f"reference")
        tol = FLOAT32_REFERENCE_RTOL
    step = float(np.finfo(precision).eps ** (1 / 3)) if rel_step is None else float(rel_step)

    scale = _column_scale(sub)
    errors = np.zeros(sub.n)
    inconclusive = np.zeros(sub.n, bool)
    entries: list[CheckEntry] = []
    assert bound.output_shape is not None
    out_shape, ushape = bound.output_shape, sub.unknown_shape

    def compare(chunks: Iterator[tuple[int, int, Any, Any]], planned: Plan) -> Plan:
        nonlocal entries
        for lo, hi, _, jac in chunks:
            jac = np.asarray(jac, np.float64).reshape(hi - lo, m, k)
            for a in range(lo, hi, fd_rows):
                b = min(a + fd_rows, hi)
                u, ctx = ref_spec.chunk(a, b)
                fd, spread = _central(evaluator, u, ctx, scale, step)
                err, bad, worst = _compare(jac[a - lo: b - lo], fd, spread, tol, top)
                errors[a:b] = err
                inconclusive[a:b] = bad
                for i, o, j, e, jv, rv in worst:
                    entries.append(CheckEntry(
                        instance=int(instances[a + i]),
                        output=tuple(int(t) for t in np.unravel_index(o, out_shape)),
                        unknown=tuple(int(t) for t in np.unravel_index(j, ushape)),
                        jacobian=jv, reference=rv, rel_error=e))
                entries = sorted(entries, key=lambda c: -c.rel_error)[:top]
        return planned

    # (the Jacobians as batchjac.jacobian computes them: its build, remembered or raced)
    plan = reduce_jacobians(bound, sub, name, mode=mode, chunk_size=chunk_size,
                            max_memory=max_memory, with_outputs=False, consume=compare,
                            extra_bytes_per_row=4 * 8 * m * k)

    over = errors > tol
    failed = over & ~inconclusive
    unsure = over & inconclusive
    passed = not failed.any() and unsure.sum() <= MAX_INCONCLUSIVE * max(sub.n, 1)
    if not failed.any() and not passed:
        notes.append(f"{int(unsure.sum())} of {sub.n} instances are inconclusive: the model is "
                     f"not differentiable at too many checked points for finite differences")
    return CheckReport(
        passed=bool(passed), max_rel_error=errors, instances=instances, rtol=tol,
        reference_dtype=ref_dtype, compute_dtype=compute, backend=name, mode=plan.mode,
        n_total=n_total, failed=instances[failed], inconclusive=instances[unsure],
        worst_entries=entries, output_shape=tuple(out_shape), unknown_shape=tuple(ushape),
        notes=notes, rel_step=step, unknown_labels=_unknown_labels(sub),
    )


def _unknown_labels(spec: BatchSpec) -> tuple[str, ...]:
    """``x[:, 4]``-style names of the unknowns when they are columns picked with ``wrt``."""
    lay = spec.layout
    if lay.columns is None or len(spec.unknown_shape) != 1:
        return ()
    src = spec.names[lay.wrt_index]
    return tuple(f"{src}[:, {c}]" for c in lay.columns)


def _column_scale(spec: BatchSpec) -> np.ndarray:
    """Root mean square of each unknown over the instances (1 where it is 0): the scale the
    finite-difference step follows, so columns in small units get small steps."""
    total = np.zeros(spec.k)
    for lo in range(0, spec.n, 65536):
        u, _ = spec.chunk(lo, min(lo + 65536, spec.n))
        total += np.square(u.reshape(len(u), -1).astype(np.float64)).sum(axis=0)
    rms = np.sqrt(total / max(spec.n, 1))
    return np.where(rms > 0, rms, 1.0)


def _central(evaluator: Evaluator, u: np.ndarray, ctx: tuple[np.ndarray, ...],
             scale: np.ndarray, rel_step: float) -> tuple[np.ndarray, np.ndarray]:
    """Central differences ``(r, m, k)`` for ``r`` instances, in one batch of ``(2k + 1) r``
    rows, and ``|D+ - D-|`` (forward minus backward difference), large at a kink."""
    r, ushape = u.shape[0], u.shape[1:]
    flat = u.reshape(r, -1)
    k = flat.shape[1]
    h = rel_step * np.maximum(np.abs(flat), scale)
    up, down = flat + h, flat - h  # in the reference dtype: the steps actually taken follow
    pts = np.empty((2 * k + 1, r, k), u.dtype)
    pts[:] = flat
    cols = np.arange(k)
    pts[1 + cols, :, cols] = up.T
    pts[1 + k + cols, :, cols] = down.T
    ys = evaluator(pts.reshape((2 * k + 1) * r, *ushape),
                   tuple(np.concatenate([c] * (2 * k + 1)) for c in ctx))
    ys = ys.reshape(2 * k + 1, r, -1)  # (2k+1, r, m)
    f0, fu, fd = ys[0], ys[1:k + 1], ys[k + 1:]
    hu = (up - flat).astype(np.float64).T[:, :, None]  # (k, r, 1)
    hd = (flat - down).astype(np.float64).T[:, :, None]
    central = (fu - fd) / (hu + hd)
    spread = np.abs((fu - f0) / hu - (f0 - fd) / hd)
    return central.transpose(1, 2, 0), spread.transpose(1, 2, 0)  # (r, m, k)


def _compare(jac: np.ndarray, fd: np.ndarray, spread: np.ndarray, tol: float, top: int
             ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int, float, float, float]]]:
    """Per-instance errors, whether an over-tolerance instance is inconclusive, and the
    ``top`` worst entries ``(row, output, unknown, error, J, J_fd)``."""
    r = jac.shape[0]
    diff = np.abs(jac - fd)
    with np.errstate(invalid="ignore"):
        big_fd = np.abs(fd).reshape(r, -1).max(axis=1)
        big_j = np.abs(jac).reshape(r, -1).max(axis=1)
    scale = np.where(big_fd > 0, big_fd, np.where(big_j > 0, big_j, 1.0))
    rel = diff / scale[:, None, None]
    rel = np.where(np.isnan(rel), np.inf, rel)  # a NaN Jacobian entry is a failure
    err = rel.reshape(r, -1).max(axis=1)
    bad = rel > tol
    # inconclusive: every over-tolerance entry sits where the one-sided differences disagree
    # by at least half the discrepancy (a kink or jump between x - h and x + h)
    explained = ~bad | (spread >= 0.5 * diff)
    unsure = (err > tol) & explained.reshape(r, -1).all(axis=1)
    worst: list[tuple[int, int, int, float, float, float]] = []
    if top:
        flat = rel.reshape(-1)
        pick = np.argpartition(-flat, min(top, flat.size) - 1)[:top] if flat.size > top \
            else np.arange(flat.size)
        for p in pick:
            i, o, j = np.unravel_index(int(p), rel.shape)
            worst.append((int(i), int(o), int(j), float(flat[p]), float(jac[i, o, j]),
                          float(fd[i, o, j])))
    return err, unsure, worst
