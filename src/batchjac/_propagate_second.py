"""Second-order propagation: ``propagate(..., order=2)``.

For Gaussian unknowns ``x ~ N(mu, Sigma)`` and the second-order Taylor model ``y_a ~ f_a +
J_a d + 1/2 d^T H_a d`` (``d = x - mu``), the first two moments are exact:

- ``E[y_a] = f_a(mu) + 1/2 tr(H_a Sigma)``;
- ``Cov(y_a, y_b) = J_a Sigma J_b^T + 1/2 tr(H_a Sigma H_b Sigma)`` (the odd moments of a
  Gaussian vanish, so the cross terms of ``J`` and ``H`` drop out; the fourth moments give
  the trace term).

Outputs, Jacobians and Hessians come from one pass of the second-order kernel, chunk by
chunk through the runner, into the same sink as the other methods.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._hessian import plan_second
from ._plan import OrderArg
from ._runner import iter_results
from ._sinks import ArraySink
from ._spec import BatchSpec


def propagate_second(bound: Any, spec: BatchSpec, unc: Any, sink: ArraySink, m: int, *,
                     mode: OrderArg, chunk_size: int | None, max_memory: int | str | None) -> None:
    """Write the second-order mean and covariance of every instance into ``sink``.
    ``unc`` is the input uncertainty (``factor(lo, hi)``: ``L`` with ``L L^T = Sigma``;
    ``sandwich(A, lo, hi)``: ``A Sigma A^T``)."""
    k = spec.k
    plan = plan_second(spec, bound, "hessian", mode=mode, chunk_size=chunk_size,
                       max_memory=max_memory)
    kernel = bound.second_kernel("hessian", plan.order, plan.chunk_size, True, True)
    assert bound.output_shape is not None
    out_shape = tuple(bound.output_shape)
    for chunk, out, _ in iter_results(kernel, spec):
        lo, hi = chunk.lo, chunk.hi
        jac = np.asarray(out["jacobians"], np.float64).reshape(hi - lo, m, k)
        hess = np.asarray(out["hessians"], np.float64).reshape(hi - lo, m, k, k)
        factor = np.asarray(unc.factor(lo, hi), np.float64)
        sigma = factor @ factor.transpose(0, 2, 1)  # (n, k, k)
        hs = hess @ sigma[:, None]  # H_a Sigma, (n, m, k, k)
        mean = np.asarray(out["outputs"], np.float64).reshape(hi - lo, m) + \
            0.5 * np.trace(hs, axis1=-2, axis2=-1)
        cov = unc.sandwich(jac, lo, hi) + 0.5 * np.einsum("naij,nbji->nab", hs, hs)
        sink.write(lo, hi, {"cov": 0.5 * (cov + cov.transpose(0, 2, 1)),
                            "mean": mean.reshape(hi - lo, *out_shape)})
