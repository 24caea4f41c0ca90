"""What a row of a PyTorch model holds while batchjac differentiates it, counted from one
forward pass of the probes' rows (:meth:`TorchBound.row_working_set`).

The planner cuts a chunk's temporaries to the CPU's cache (:func:`batchjac._plan.fit_cache`),
from an estimate of the bytes a row holds. JAX reads it from a jaxpr
(:func:`batchjac._backends.jax.cost.peak_row_bytes`); eager PyTorch has no program to read,
so the probes' forward pass runs under a dispatch mode that adds up the bytes of what each
operation returns with the batch's rows on its leading axis. That is the sum, not the peak:
the torch kernels differentiate with autograd, which keeps every such intermediate for its
backward passes. Views share their base's storage and are not counted; weights and other
per-call arrays do not grow with the chunk and are not counted either (told by their leading
axis: an array made per call whose leading size happens to equal the probes' few rows is
counted, which makes the chunks smaller than they need be, never too large).

A model with convolutions gets no estimate: oneDNN tiles its convolutions for the cache
itself, and each new chunk shape costs its primitives' setup on the first call: measured on
a first call in a fresh process, the benchmark's conv net ran slower in cache-sized chunks
than whole, where its MLPs ran faster (docs/thresholds.md, "Measured choices").
"""

from __future__ import annotations

from typing import Any

import torch

from . import compat


class RowBytes:
    """Adds up the bytes of the non-view tensors the operations return whose leading axis is
    the batch's ``rows``; notes whether a convolution ran. A torch dispatch mode once made one
    (:func:`.compat.dispatch_mode`, which keeps TorchDynamo out of its handler)."""

    def __init__(self, rows: int, leaves: Any) -> None:
        super().__init__()
        self.rows, self.total, self.convolution = rows, 0, False
        self.leaves = leaves

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if "convolution" in str(func):
            self.convolution = True
        if not getattr(func, "is_view", False):
            for t in self.leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == self.rows:
                    self.total += t.numel() * t.element_size()
        return out


def counted(fn: Any, rows: int) -> tuple[Any, float | None]:
    """``fn()`` and the bytes a row of its intermediates holds (None where none has the batch's
    rows on its leading axis, or the model convolves; or where this torch lacks the dispatch
    modes or pytrees the count needs: :mod:`.compat`). Raises what ``fn`` raises."""
    mode_class, tree = compat.dispatch_mode(RowBytes), compat.pytree()
    if mode_class is None or tree is None:
        return fn(), None
    mode = mode_class(rows, tree.tree_leaves)
    with mode:
        out = fn()
    if mode.convolution or mode.total <= 0 or rows <= 0:
        return out, None
    return out, mode.total / rows
