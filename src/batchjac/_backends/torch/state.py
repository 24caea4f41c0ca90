"""PyTorch state shared by its backend's modules (the adapter, :mod:`.builds`, :mod:`.second`,
:mod:`.laplacian`): the process-wide lock of forward mode, a thread-safe warning filter, and the
one-off load of forward mode's decompositions. Its own module so that each imports it and none
imports another for it."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any, cast

from . import compat

#: torch's forward-mode AD levels (``enter_dual_level``, which ``torch.func.jvp`` uses) are
#: process-wide, not per thread: threads running forward mode at once on one module (a thread
#: pool, Dask's threaded scheduler) exited each other's levels, and calls raised "no level
#: exists, make sure to enter_dual_level() first", fell back to reverse mode with a warning
#: blaming the model, or returned zero Jacobians. Forward-mode computations hold this lock
#: (they run one at a time; reverse mode, whose torch.func state is per thread, does not).
_FORWARD_AD = threading.RLock()  # (re-entered by _load_forward_ad under it)

_SILENCED = threading.Lock()
_silenced_count: dict[tuple[str, type[Warning]], int] = {}


@contextlib.contextmanager
def _silenced(message: str, category: type[Warning]) -> Iterator[None]:
    """Ignore one warning of torch's within the block, in a way threads can share.
    ``warnings.catch_warnings`` saves and restores the whole filter list, so blocks of two
    threads that overlap undo each other's filter (one of the blocks then lets the warning
    through, and a warnings-as-errors run fails); here the one filter is added by the first
    block in and removed by the last one out."""
    key = (message, category)
    with _SILENCED:
        _silenced_count[key] = _silenced_count.get(key, 0) + 1
        if _silenced_count[key] == 1:
            warnings.filterwarnings("ignore", message=message, category=category)
    try:
        yield
    finally:
        with _SILENCED:
            _silenced_count[key] -= 1
            if not _silenced_count[key]:
                del _silenced_count[key]
                filters = cast("list[Any]", warnings.filters)
                for i, entry in enumerate(filters):
                    pattern = entry[1]
                    if entry[0] == "ignore" and entry[2] is category and \
                            getattr(pattern, "pattern", None) == message and entry[3] is None:
                        del filters[i]
                        compat.warning_filters_changed()  # (the per-module caches)
                        break


def _load_forward_ad() -> None:
    """torch loads its forward-mode decompositions on the first dual tensor and, in torch
    2.9+, that import warns that ``torch.jit.script`` is deprecated: framework noise the user
    cannot act on, which a warnings-as-errors run would turn into a failure of forward mode.
    Load them here once, with that one warning silenced (other threads wait for it: one that
    went on would load them itself, unsilenced)."""
    global _forward_ad_loaded
    if _forward_ad_loaded:
        return
    with _FORWARD_AD:
        if _forward_ad_loaded:
            return
        with _silenced(".*torch.jit.script.* is deprecated", DeprecationWarning):
            compat.load_forward_decompositions()  # (other torch versions: nothing to load)
        _forward_ad_loaded = True


_forward_ad_loaded = False
