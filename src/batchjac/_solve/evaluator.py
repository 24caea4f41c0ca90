"""The solver's model evaluations: ``(y, J)`` through a few compiled chunk sizes, a smaller one
compiled once the padding it saves has paid for its compilation."""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from .. import _backends
from .._runner import call, pad_args
from .._tune.races import time_modes

_MIN_BUCKET = 8  # smallest chunk kernel compiled for the tail of the active set
_BUCKET_FACTOR = 8  # ratio between successive chunk sizes
#: measured compile time of a chunk kernel, per bound model (for the bucket heuristic)
_compile_seconds: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
#: seconds spent on padded rows so far, per bound model: kept across solve() calls, so a
#: session that solves batch after batch compiles the smaller chunk once it has paid for it
_waste: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


class _Evaluator:
    """``(y, J)`` for any number of rows through a few fixed chunk sizes.

    The full chunk size is compiled first; sizes ``chunk/8``, ``chunk/64``, ... serve a shrinking
    active set. A smaller size is compiled only when the time already spent on padded rows
    (by this model, over all solve calls) exceeds the measured cost of one compilation (ski
    rental: never more than twice the best choice in hindsight), unless the bound model has
    it already; a backend whose kernels cost no compilation (PyTorch) uses the smallest size
    that holds the active set at once. With ``adaptive=False`` that smallest size is always
    used too (compiled when first needed): the sizes then depend on the instances alone.
    """

    def __init__(self, bound: Any, mode: Any, chunk_size: int, adaptive: bool = True,
                 tune_modes: bool = False, asked: bool = False) -> None:
        self.bound, self.mode, self.adaptive, self.tune_modes = bound, mode, adaptive, tune_modes
        #: what the kernels' calls carry: the user asked for ``mode`` (computed or refused,
        #: never swapped for the other)
        self.budget = _backends.CallBudget(mode_asked=asked)
        sizes = [chunk_size]
        while sizes[-1] // _BUCKET_FACTOR >= _MIN_BUCKET:
            sizes.append(sizes[-1] // _BUCKET_FACTOR)
        self.sizes = sizes  # descending
        #: the mode of each size's kernel: the plan's for the full size; with ``tune_modes``
        #: (the cost model could not tell the modes apart) each smaller size is timed in both
        #: when first used, since the faster mode can change with the rows (PyTorch's forward
        #: mode costs ~1 ms a call in Python however small the chunk, its reverse mode ~0.4 ms)
        self.modes: dict[int, Any] = {chunk_size: mode}
        self.compiled = {s for s in sizes if self._exists(s)}
        self.calls = 0
        self.seconds = 0.0

    def _known_mode(self, size: int) -> Any:
        """The mode for ``size``, or None while it still has to be timed."""
        if size in self.modes:
            return self.modes[size]
        if not self.tune_modes:
            return self.mode
        tuned = self.bound.tuned.get((size, True))
        return None if tuned is None else tuned[0]

    def _exists(self, size: int) -> bool:
        mode = self._known_mode(size)
        return mode is not None and self.bound.has_kernel(mode, size, True)

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        rows = u.shape[0]
        full = self.sizes[0]
        if rows >= full:
            parts = [self._run(full, u[lo:lo + full], tuple(c[lo:lo + full] for c in ctx))
                     for lo in range(0, rows, full)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        ideal = min(s for s in self.sizes if s >= rows)
        if not self.adaptive or not self.bound.compiles_kernels:
            return self._run(ideal, u, ctx)
        usable = min(s for s in self.sizes if s >= rows and (s in self.compiled or s == full))
        waste = _waste.get(self.bound, 0.0)
        if usable != ideal and waste >= _compile_seconds.get(self.bound, 0.25):
            usable, waste = ideal, 0.0
        start = time.perf_counter()
        y, jac = self._run(usable, u, ctx)
        if usable != ideal:
            waste += (time.perf_counter() - start) * (1.0 - ideal / usable)
        _waste[self.bound] = waste
        return y, jac

    def _run(self, size: int, u: np.ndarray, ctx: tuple[np.ndarray, ...]
             ) -> tuple[np.ndarray, np.ndarray]:
        rows = u.shape[0]
        new = size not in self.compiled and not self._exists(size)
        start = time.perf_counter()
        u_pad, ctx_pad = pad_args(u, ctx, size)
        mode = self._known_mode(size)
        if mode is None:
            mode = time_modes(self.bound, u_pad, ctx_pad, True, self.mode)[0]
        self.modes[size] = mode
        # not adaptive: the first build, no timing-based choice of implementation either
        kernel = _backends.under(self.bound.kernel(
            mode, size, True, variant=None if self.adaptive else _backends.FIRST_VARIANT,
            budget=self.budget), self.budget)
        out = call(kernel, u_pad, ctx_pad, f"a solver step ({rows} active instances)", rows=rows,
                   zero_check=False)  # a zero Jacobian stalls its instance: the status says so
        y, jac = out["outputs"], out["jacobians"]
        elapsed = time.perf_counter() - start
        if new:
            _compile_seconds[self.bound] = elapsed
        self.compiled.add(size)
        self.calls += 1
        self.seconds += elapsed
        y2 = np.asarray(y, np.float64).reshape(rows, -1)
        return y2, np.asarray(jac, np.float64).reshape(rows, y2.shape[1], -1)
