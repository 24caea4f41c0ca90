"""Configuration read from the environment, in one place, validated on first use.

``BATCHJAC_MAX_MEMORY``  default memory budget for one chunk, e.g. ``"512MB"``, ``"2GB"``
                         (default: 1/4 of physical memory, between 512 MB and 8 GB).
``BATCHJAC_PROBES``      ``"on"`` (default) or ``"off"``: the one-off checks that a model's
                         output is connected to the unknowns and that rows do not interact.
``BATCHJAC_AUTOTUNE``    ``"on"`` (default) or ``"off"``: time chunk sizes (and forward against
                         reverse mode when the shapes cannot tell) once per model and shape.
"""

from __future__ import annotations

import functools
import os
import re

from ._errors import InputError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | float | str, *, name: str = "max_memory") -> int:
    """Turn ``"1.5GB"``, ``"512MiB"`` or a number of bytes into an int.

    >>> parse_bytes("1.5GB")
    1500000000
    >>> parse_bytes(2048)
    2048
    """
    if isinstance(value, bool):
        raise InputError(f"`{name}` must be a number of bytes or a string like '1GB'; got {value!r}.")
    if isinstance(value, (int, float)):
        nbytes = int(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise InputError(
                f"`{name}` must be a number of bytes or a string like '512MB' or '2GiB'; "
                f"got {value!r}. Valid units: {', '.join(u for u in _UNITS if u)}."
            )
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise InputError(f"`{name}` must be a number of bytes or a string like '1GB'; "
                         f"got {type(value).__name__} {value!r}.")
    if nbytes <= 0:
        raise InputError(f"`{name}` must be positive; got {value!r}.")
    return nbytes


def default_max_memory() -> int:
    raw = os.environ.get("BATCHJAC_MAX_MEMORY")
    if raw is not None:
        return parse_bytes(raw, name="BATCHJAC_MAX_MEMORY")
    return _physical_default()


@functools.cache
def _physical_default() -> int:
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        physical = 8 * 10**9
    return int(min(8 * 10**9, max(512 * 10**6, physical // 4)))


def probes_enabled() -> bool:
    raw = os.environ.get("BATCHJAC_PROBES", "on").strip().lower()
    if raw not in ("on", "off"):
        raise InputError(f"BATCHJAC_PROBES must be 'on' or 'off'; got {raw!r}.")
    return raw == "on"


def autotune_enabled() -> bool:
    raw = os.environ.get("BATCHJAC_AUTOTUNE", "on").strip().lower()
    if raw not in ("on", "off"):
        raise InputError(f"BATCHJAC_AUTOTUNE must be 'on' or 'off'; got {raw!r}.")
    return raw == "on"
