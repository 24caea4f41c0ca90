"""Exit codes of every ``batchjac`` subcommand, and the guard that applies them.

One map from batchjac's errors to exit codes (docs/cli.md), and one decorator, :func:`guard`,
that every subcommand wears: a batchjac error becomes one line on stderr, ``batchjac CMD:
error: ...``, with its exit code and no traceback; Ctrl-C becomes exit 130 and a "run the same
command again" line; anything else is a bug and keeps its traceback (exit 1). Usage errors are
click's (exit 2, with the usage line).

Only click is imported here; batchjac's error classes are imported when an error is mapped.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import click

EXIT_OK = 0
#: ``check`` only: the check ran and failed (elsewhere 1 is a bug, with its traceback)
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_FILE = 3
EXIT_INPUT = 4
EXIT_MODEL = 5
EXIT_EXISTS = 6
EXIT_WRITE = 7
EXIT_INTERRUPTED = 130

P = ParamSpec("P")
R = TypeVar("R")


def exit_code(e: BaseException) -> int | None:
    """The documented exit code of a batchjac error; None for anything else (a bug)."""
    from .._errors import BackendNotAvailableError, BatchJacError, InputError, ModelError
    from .._io import InputFileError
    from .._stores import StoreExistsError, StoreWriteError

    if isinstance(e, StoreWriteError):
        return EXIT_WRITE
    if isinstance(e, StoreExistsError):
        return EXIT_EXISTS
    if isinstance(e, InputFileError):
        return EXIT_FILE
    if isinstance(e, (ModelError, BackendNotAvailableError)):
        return EXIT_MODEL
    if isinstance(e, (InputError, BatchJacError)):
        return EXIT_INPUT
    return None


def one_line(e: BaseException) -> str:
    """The message on one line, without the bracketed context batchjac adds at its boundary,
    and without the frameworks' tracebacks inside it (:func:`_without_tracebacks`)."""
    lines = [ln.strip() for ln in _without_tracebacks(str(e)).splitlines()]
    return " ".join(ln for ln in lines if ln and not (ln.startswith("[") and ln.endswith("]")))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_KERAS_CALL = re.compile(r"Exception encountered when calling [\w.]+\(\)\.\s*")
_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): ")


def _without_tracebacks(text: str) -> str:
    """A framework error as its meaningful line: a TorchScript error's traceback (the
    serialized and the original code, with markers) is cut down to the error it ends with;
    Keras's 'Exception encountered when calling ...' and 'Arguments received by ...' framing
    and its terminal colour codes are dropped."""
    text = _ANSI.sub("", text)
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "Traceback of TorchScript" in ln), None)
    if start is not None:
        end = next((j for j in range(len(lines) - 1, start, -1) if _ERROR_LINE.match(lines[j])), None)
        if end is not None:
            head = " ".join(lines[:start]).replace(
                "The following operation failed in the TorchScript interpreter.", "").rstrip()
            kind = _ERROR_LINE.match(lines[end]).group(1)  # type: ignore[union-attr]
            if head.endswith(f"{kind}:"):  # "...: RuntimeError:" + "RuntimeError: what"
                head = head[: -len(kind) - 1].rstrip()
            lines = [f"{head} {lines[end]}".strip(), *lines[end + 1:]]
    kept: list[str] = []
    arguments = False
    for ln in lines:
        bare = ln.strip()
        if bare.startswith("Arguments received by "):
            arguments = True
            continue
        if arguments and bare.startswith("\u2022"):  # the bullets of the arguments received
            continue
        arguments = False
        kept.append(_KERAS_CALL.sub("", ln))
    return "\n".join(kept)


def guard(name: str, *, interrupted: str = "run the same command again."
          ) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Wrap the command function of ``batchjac NAME`` (put it below the click decorators).

    ``interrupted`` ends the line printed on Ctrl-C, after ``batchjac NAME: interrupted;``:
    what was kept and how to continue.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        takes = set(inspect.signature(fn).parameters)

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            from .quiet import command_output

            quiet = bool(kwargs.get("quiet")) if "quiet" in takes else bool(kwargs.pop("quiet", False))
            verbose = bool(kwargs.get("verbose")) if "verbose" in takes else \
                bool(kwargs.pop("verbose", False))
            try:
                with command_output(quiet=quiet, verbose=verbose), warnings.catch_warnings():
                    # one command loads its model once: advice about defining a function once
                    # per process is for the Python API (in-process runs load it again)
                    from .._errors import RebindWarning

                    warnings.simplefilter("ignore", RebindWarning)
                    return fn(*args, **kwargs)
            except (click.ClickException, click.exceptions.Exit, click.Abort):
                raise  # usage errors (exit 2) and deliberate exits are click's
            except KeyboardInterrupt:
                click.echo(f"batchjac {name}: interrupted; {interrupted}", err=True)
                raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
            except Exception as e:
                code = exit_code(e)
                if code is None:
                    raise  # a bug: keep the traceback (exit 1)
                from .quiet import in_cli_terms

                click.echo(f"batchjac {name}: error: {in_cli_terms(one_line(e))}", err=True)
                raise click.exceptions.Exit(code) from None

        return run

    return decorate
