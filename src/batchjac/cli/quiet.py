"""A quiet terminal: what the frameworks print is kept off stderr, unless ``-v``.

Two parts, applied by :func:`batchjac.cli.main` and by :func:`batchjac.cli.errors.guard`:

- **The frameworks' C++ logs** (:func:`silence_native_logs`, the console script only). TensorFlow
  2.21 prints its oneDNN banner and absl's "All log messages before absl::InitializeLog()" line
  while it is imported, and XLA its service lines when it compiles, whatever
  ``TF_CPP_MIN_LOG_LEVEL`` says (it is read too late for them). So before any framework is
  imported, stderr's file descriptor is put behind a pipe (Python's ``sys.stderr`` still writes
  to the real one), and a thread forwards everything but
  glog-format lines (``I0000 00:00:1796131449.801629   30259 port.cc:153] ...``) below the
  severity asked for: ``TF_CPP_MIN_LOG_LEVEL`` if the user set it (their setting is kept, and
  honoured for these lines too), else 2 (errors and fatal messages pass). ``-v`` (or
  ``--verbose``) leaves stderr alone and sets ``TF_CPP_MIN_LOG_LEVEL=0`` unless the user set it.
  A crash's traceback (``faulthandler``) goes to the real stderr, past the pipe.
- **Python warnings and framework loggers** (:func:`command_output`, every command, also
  in-process): batchjac's own warnings are printed as ``batchjac: warning: <message>``, one
  line, with advice given in the command's flags (``--mode reverse``, not ``mode='reverse'``);
  other libraries' warnings, and the ``tensorflow``/``absl``/``jax`` loggers' messages below
  ERROR (TensorFlow's retracing warnings), are not shown unless ``-v``; ``-q`` shows no warning
  at all, only errors.

Only the standard library is imported here: it runs before any framework.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import IO, Any

VERBOSE_FLAGS = ("-v", "--verbose")
#: Python loggers of the frameworks, held at ERROR unless -v
FRAMEWORK_LOGGERS = ("tensorflow", "absl", "jax", "jaxlib", "h5py", "torch._dynamo", "onnx2torch")

_GLOG = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:[\d.]+ +\d+ [^ \]]+:\d+\] ")
_ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called"
_SEVERITY = {b"I": 0, b"W": 1, b"E": 2, b"F": 3}


def wants_verbose(argv: Sequence[str]) -> bool:
    """``-v``/``--verbose`` among the arguments (before a ``--``)."""
    for arg in argv:
        if arg == "--":
            return False
        if arg in VERBOSE_FLAGS:
            return True
    return False


def min_log_level(verbose: bool) -> int:
    """The severity below which native log lines are dropped: the user's TF_CPP_MIN_LOG_LEVEL
    if they set one, else 0 with -v and 2 without."""
    given = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    if given is not None and given.strip().isdigit():
        return int(given)
    return 0 if verbose else 2


def is_noise(line: bytes, level: int) -> bool:
    """A complete line of native logging below ``level`` (glog severity I=0, W=1, E=2, F=3).

    >>> is_noise(b"I0000 00:00:1796131449.801629   30259 port.cc:153] oneDNN custom operations are on.", 2)
    True
    >>> is_noise(b"E0000 00:00:1796131449.801629   30259 cuda.cc:12] failed", 2)
    False
    >>> is_noise(b"batchjac: 300 rows -> j.npy in 0.3 s", 2)
    False
    """
    body = line.lstrip(b"\r")
    if body.startswith(_ABSL_PREAMBLE):
        return level >= 1
    m = _GLOG.match(body)
    return m is not None and _SEVERITY[m.group(1)] < level


def _may_become_noise(partial: bytes) -> bool:
    """An unfinished line that could still turn out to be a log line: held until its end."""
    if not partial or partial[:1] not in (b"I", b"W", b"E", b"F"):
        return False
    if _ABSL_PREAMBLE.startswith(partial[:len(_ABSL_PREAMBLE)]) or partial.startswith(_ABSL_PREAMBLE):
        return True
    return re.match(rb"^[IWEF]\d{0,4}( |$)", partial) is not None


class _Filter:
    """File descriptor 2 behind a pipe, drained by a thread that drops native log lines.

    Python's own ``sys.stderr`` keeps writing to the real stderr (a terminal stays a terminal
    for the progress bar's width and for click), so only what native code (and child
    processes) write to descriptor 2 passes through the pipe."""

    def __init__(self, level: int) -> None:
        self.level = level
        sys.stderr.flush()
        self.real = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.read = read
        self.python_stderr = sys.stderr
        sys.stderr = open(self.real, "w", buffering=1, closefd=False,  # noqa: SIM115
                          encoding=self.python_stderr.encoding, errors=self.python_stderr.errors)
        self.crash_file: IO[str] = os.fdopen(os.dup(self.real), "w")
        faulthandler.enable(file=self.crash_file)
        self.thread = threading.Thread(target=self._pump, name="batchjac-stderr", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.real, data):]

    def _pump(self) -> None:
        pending = b""
        while True:
            try:
                data = os.read(self.read, 65536)
            except OSError:
                break
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            out = b"".join(ln + b"\n" for ln in lines if not is_noise(ln, self.level))
            if pending and not _may_become_noise(pending.lstrip(b"\r")):
                out, pending = out + pending, b""
            if out:
                self._write(out)
        if pending and not is_noise(pending, self.level):
            self._write(pending)

    def close(self) -> None:
        """Put the real stderr back and forward what is left in the pipe."""
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        sys.stderr = self.python_stderr
        os.dup2(self.real, 2)  # the pipe's last writer (unless a child process still holds it)
        self.thread.join(timeout=2)


_active: _Filter | None = None


def silence_native_logs(argv: Sequence[str]) -> None:
    """For the console script, before any framework is imported (see the module docstring)."""
    global _active
    verbose = wants_verbose(argv)
    level = min_log_level(verbose)
    # the frameworks' own switch, for what they do honour (a user's setting is kept)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", str(level))
    if verbose or level == 0 or _active is not None:
        return
    try:
        _active = _Filter(level)
    except OSError:  # no usable stderr descriptor (closed, or not a file): leave it be
        _active = None


#: keyword arguments of the Python API in batchjac's advice -> the flags that set them
_FLAGS = {"mode": "--mode", "dtype": "--dtype", "chunk_size": "--chunk-size",
          "max_memory": "--max-memory", "backend": "--backend", "nan_policy": "--nan-policy",
          "overwrite": "--overwrite"}
_KWARG = re.compile(r"\b(" + "|".join(_FLAGS) + r")=(?:'([^']*)'|\"([^\"]*)\"|([\w.]+))?")
#: a flag followed by itself in brackets (the API's keyword and its flag, both made the flag)
_TWICE = re.compile(r"(--[\w-]+(?: [\w.]+)?) \(\1\)")


def in_cli_terms(message: str) -> str:
    """Advice written for the Python API, in the command line's flags.

    >>> in_cli_terms("Pass mode='reverse' to skip the attempt, or pass dtype= to compute in another dtype.")
    'Pass --mode reverse to skip the attempt, or pass --dtype to compute in another dtype.'
    >>> in_cli_terms("Choose another output path, or pass overwrite=True to replace it.")
    'Choose another output path, or pass --overwrite to replace it.'

    Advice that names both (``overwrite=True (--overwrite)``) names the flag once:

    >>> in_cli_terms("Pass overwrite=True (--overwrite) to discard it and start again.")
    'Pass --overwrite to discard it and start again.'
    """
    def flag(m: re.Match[str]) -> str:
        value = next((g for g in m.groups()[1:] if g is not None), None)
        # a flag is on by itself (overwrite=True is --overwrite)
        return f"{_FLAGS[m.group(1)]} {value}" if value and value != "True" else _FLAGS[m.group(1)]

    return _TWICE.sub(r"\1", _KWARG.sub(flag, message))


def _one_line(message: Warning | str) -> str:
    lines = [ln.strip() for ln in str(message).splitlines()]
    return " ".join(ln for ln in lines if ln and not (ln.startswith("[") and ln.endswith("]")))


@contextlib.contextmanager
def command_output(*, quiet: bool, verbose: bool) -> Iterator[None]:
    """Within a command: warnings and framework loggers as the module docstring says."""
    from .._errors import BatchJacWarning

    saved_show = warnings.showwarning
    loggers = {name: logging.getLogger(name) for name in FRAMEWORK_LOGGERS}
    levels = {name: lg.level for name, lg in loggers.items()}

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if issubclass(category, BatchJacWarning):
            from tqdm import tqdm  # its write() moves a progress bar out of the way, then redraws it

            tqdm.write(f"batchjac: warning: {in_cli_terms(_one_line(message))}", file=file or sys.stderr)
        else:
            saved_show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        elif not verbose:
            warnings.simplefilter("ignore")
            warnings.simplefilter("default", BatchJacWarning)
        warnings.showwarning = show
        if not verbose:
            for lg in loggers.values():
                lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for name, lg in loggers.items():
                lg.setLevel(levels[name])
