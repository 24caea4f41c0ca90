"""The runner: feeds fixed-size chunks through a kernel, in order, into a sink."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._backends import Kernel
from ._errors import BatchJacError, ModelError, add_context
from ._sinks import ArraySink
from ._spec import BatchSpec


def _pad(a: np.ndarray, rows: int) -> np.ndarray:
    """Pad to ``rows`` by repeating the last row: real values keep every op finite (zeros
    might not, e.g. log or division), and padded results are dropped anyway."""
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.repeat(a[-1:], rows - a.shape[0], axis=0)], axis=0)


def pad_chunk(spec: BatchSpec, lo: int, hi: int, rows: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Rows ``lo:hi`` of the batch as kernel arguments, padded to ``rows``."""
    u, ctx = spec.chunk(lo, hi)
    return _pad(u, rows), tuple(_pad(c, rows) for c in ctx)


def run_chunks(
    kernel: Kernel,
    spec: BatchSpec,
    sink: ArraySink,
    *,
    on_chunk: Callable[[int], None] | None = None,
) -> None:
    """Compute rows ``0..n`` chunk by chunk, in order, into ``sink``."""
    cs = kernel.chunk_size
    for index, lo in enumerate(range(0, spec.n, cs)):
        hi = min(lo + cs, spec.n)
        try:  # reading (from disk, for lazy inputs) fails as an input error, not the model's
            args = pad_chunk(spec, lo, hi, cs)
        except BatchJacError as e:
            raise add_context(e, f"chunk {index}, rows {lo}:{hi}") from e
        try:
            y, jac = kernel(*args)
        except BatchJacError as e:
            raise add_context(e, f"chunk {index}, rows {lo}:{hi}") from e
        except Exception as e:  # framework errors at run time
            raise ModelError(
                f"The model failed on chunk {index} (rows {lo}:{hi}): {type(e).__name__}: {e}"
            ) from e
        sink.write(lo, hi, jac[: hi - lo], None if y is None else y[: hi - lo])
        del y, jac, args  # the next chunk's buffers then take this one's place, not join it
        if on_chunk is not None:
            on_chunk(hi - lo)


def run_single(kernel: Kernel, spec: BatchSpec) -> tuple[np.ndarray | None, np.ndarray]:
    """All rows in one chunk: return the kernel's arrays without another copy."""
    cs = kernel.chunk_size
    args = pad_chunk(spec, 0, spec.n, cs)
    try:
        y, jac = kernel(*args)
    except BatchJacError as e:
        raise add_context(e, f"rows 0:{spec.n}") from e
    except Exception as e:
        raise ModelError(f"The model failed on rows 0:{spec.n}: {type(e).__name__}: {e}") from e
    if cs != spec.n:
        jac = jac[: spec.n]
        y = y[: spec.n] if y is not None else None
    return y, jac
