"""Configuration read from the environment, in one place, validated on first use.

``BATCHJAC_MAX_MEMORY``  default memory budget for one chunk, e.g. ``"512MB"``, ``"2GB"``
                         (default: 1/4 of physical memory, between 512 MB and 8 GB; on a GPU,
                         half of its free memory, see :func:`default_max_memory`).
``BATCHJAC_PROBES``      ``"on"`` (default) or ``"off"``: the one-off checks that a model's
                         output is connected to the unknowns and that rows do not interact.
``BATCHJAC_AUTOTUNE``    ``"on"`` (default) or ``"off"``: time chunk sizes (and forward against
                         reverse mode when the shapes cannot tell) once per model and shape.
``BATCHJAC_CACHE``       ``"on"`` (default) or ``"off"``: remember tuning decisions on disk, so
                         that the next process runs the tuned kernel on its first call.
                         ``"off"`` reads nothing and writes nothing.
``BATCHJAC_CACHE_DIR``   where that cache lives (default: ``$XDG_CACHE_HOME/batchjac``, else
                         ``~/.cache/batchjac``).
``BATCHJAC_CACHE_MAX_BYTES``  the most the compiled executables in that directory take, e.g.
                         ``"2GB"`` (default 1 GB); past it, the least recently used go.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import re
from pathlib import Path

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


def default_max_memory(device_free: int | None = None) -> int:
    """The memory budget of one chunk: ``BATCHJAC_MAX_MEMORY``; else, computing on an
    accelerator with ``device_free`` bytes free, half of them rounded down to a power of two
    (free memory moves from call to call; a budget that moved with it would change the chunk
    size, and each new size is a compilation); else from the host's memory."""
    raw = os.environ.get("BATCHJAC_MAX_MEMORY")
    if raw is not None:
        return parse_bytes(raw, name="BATCHJAC_MAX_MEMORY")
    if device_free is not None:
        return device_budget(device_free)
    return _physical_default()


#: the smallest budget taken from an accelerator's free memory (a nearly full device still
#: computes, in small chunks, rather than planning chunks of one row)
MIN_DEVICE_BUDGET = 64 << 20


def device_budget(free: int) -> int:
    """Half of ``free`` bytes, rounded down to a power of two, at least MIN_DEVICE_BUDGET.

    >>> device_budget(80 * 2**30) == 32 * 2**30
    True
    """
    half = max(1, free // 2)
    return max(MIN_DEVICE_BUDGET, 1 << (half.bit_length() - 1))


#: the host's memory budget: this share of its physical memory (the rest is the user's, the
#: framework's and the operating system's), between these bounds
HOST_SHARE = 4
HOST_BUDGET_MIN = 512 * 10**6
HOST_BUDGET_MAX = 8 * 10**9


@functools.cache
def _physical_default() -> int:
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        physical = HOST_BUDGET_MAX
    return int(min(HOST_BUDGET_MAX, max(HOST_BUDGET_MIN, physical // HOST_SHARE)))


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


def cache_enabled() -> bool:
    """Whether the tuning cache is read and written (``BATCHJAC_CACHE``, default ``"on"``)."""
    raw = os.environ.get("BATCHJAC_CACHE", "on").strip().lower()
    if raw not in ("on", "off"):
        raise InputError(f"BATCHJAC_CACHE must be 'on' or 'off'; got {raw!r}. Unset it for the "
                         "default ('on'), or set it to 'off' to neither read nor write the cache.")
    return raw == "on"


#: the default of BATCHJAC_CACHE_MAX_BYTES: room for hundreds of the benchmark's executables
#: (their sizes: docs/thresholds.md)
CACHE_MAX_BYTES = 10**9


def cache_max_bytes() -> int:
    """The most the cache's binary payloads may take (``BATCHJAC_CACHE_MAX_BYTES``)."""
    raw = os.environ.get("BATCHJAC_CACHE_MAX_BYTES", "").strip()
    return CACHE_MAX_BYTES if not raw else parse_bytes(raw, name="BATCHJAC_CACHE_MAX_BYTES")


def cache_dir() -> Path:
    """The directory of the tuning cache: ``$BATCHJAC_CACHE_DIR``, else the per-user cache
    directory of the XDG convention, ``$XDG_CACHE_HOME/batchjac`` or ``~/.cache/batchjac``.

    The XDG convention alone, not ``platformdirs``: that is not a dependency of batchjac, and
    using it only when something else happens to have installed it would move the cache (on
    macOS and Windows) with the environment, so that two environments of one user would not see
    each other's decisions. Empty variables count as unset and a relative ``XDG_CACHE_HOME`` is
    ignored, as the XDG specification says; a relative ``BATCHJAC_CACHE_DIR`` is made absolute,
    so that processes started in other directories find the same cache.
    Nothing is created here.
    """
    raw = os.environ.get("BATCHJAC_CACHE_DIR", "").strip()
    if raw:
        return Path(os.path.abspath(os.path.expanduser(raw)))
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "batchjac"
    home = os.path.expanduser("~")
    if home == "~" or not os.path.isabs(home):
        raise InputError(
            f"batchjac cannot find a per-user cache directory: HOME is not set (got {home!r}) and "
            "neither is XDG_CACHE_HOME. Set BATCHJAC_CACHE_DIR to a directory for the tuning "
            "cache, or BATCHJAC_CACHE=off to do without it.")
    return Path(home) / ".cache" / "batchjac"


#: the last-level cache assumed where the machine does not say (this project's CPU: 32 MB),
#: and the most a process is taken to have: a virtual machine's share of a large shared L3
#: is not its own (one of this project's machines reports 105 MB across 2 cores, and blocks
#: sized to that ran slower than blocks of a few tens of MB: docs/thresholds.md)
CACHE_FALLBACK = CACHE_CAP = 32 << 20


@functools.lru_cache(maxsize=1)
def cache_bytes() -> int:
    """The CPU's last-level cache in bytes (Linux's sysfs), at most :data:`CACHE_CAP`, else
    :data:`CACHE_FALLBACK`."""
    import glob

    found = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{index}/level") as f_level, open(f"{index}/size") as f_size:
                level, size = int(f_level.read()), f_size.read().strip()
            found.append((level, parse_bytes(size if size[-1:].isdigit() else size + "iB")))
        except (OSError, ValueError, IndexError, InputError):
            continue
    return min(CACHE_CAP, int(max(found)[1])) if found else CACHE_FALLBACK
