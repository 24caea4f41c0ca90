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
import math
import numbers
import os
import re

from ._errors import InputError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | float | str, *, name: str = "max_memory") -> int:
    """Turn ``"1.5GB"``, ``"512MiB"`` or a number of bytes into an int; anything else (NaN,
    infinity, zero or negative sizes, other strings and types) is an InputError naming
    ``name``, what was received and an example.

    >>> parse_bytes("1.5GB")
    1500000000
    >>> parse_bytes(2048)
    2048
    """

    def bad(why: str = "") -> InputError:
        units = ", ".join(u for u in _UNITS if u)
        return InputError(f"`{name}` must be a number of bytes or a string such as "
                          f"'512MB' or '2GiB' (a positive size; units {units}); got "
                          f"{value!r}{why}.")

    if isinstance(value, bool):
        raise bad()
    if isinstance(value, numbers.Integral):
        nbytes = int(value)
    elif isinstance(value, numbers.Real):
        if not math.isfinite(float(value)):
            raise bad(", which is not a finite number")
        nbytes = int(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise bad()
        size = float(match.group(1)) * _UNITS[unit]
        if not math.isfinite(size):
            raise bad(", which is not a finite number")
        nbytes = int(size)
    else:
        raise bad(f" (a {type(value).__name__})")
    if nbytes <= 0:
        raise bad(", which is not positive" if nbytes < 0 or value == 0 else
                  ", less than one byte")
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
