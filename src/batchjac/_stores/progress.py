"""The progress of a store being written: a tqdm bar on stderr, or the caller's function."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class _Callback:
    def __init__(self, fn: Callable[[int], None]) -> None:
        self.fn = fn
        self.leave = True

    def update(self, rows: int) -> None:
        self.fn(rows)

    def close(self) -> None:
        pass


def progress_bar(progress: bool | Callable[[int], None], total: int, initial: int = 0) -> Any:
    """None, a tqdm bar on stderr (rows, rows/s, ETA), or the caller's function wrapped alike
    (``update(rows)``, ``close()``)."""
    if callable(progress):
        return _Callback(progress)
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="row", unit_scale=True, file=sys.stderr,
                dynamic_ncols=True, smoothing=0.1, desc="batchjac")
