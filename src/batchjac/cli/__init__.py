"""The ``batchjac`` command line: the click group :data:`cli` and :func:`main`.

One module per subcommand (``compute``, ``hessian``, ``jvp``/``vjp``, ``solve``, ``check``,
``propagate``, ``report``, ``demo``, ``bench``), sharing their options (:mod:`.options`), the
opening of input files and models (:mod:`.common`) and the exit codes (:mod:`.errors`).
Frameworks and batchjac's numerics are imported inside the command functions only, so
``batchjac --help`` is fast.
"""

from __future__ import annotations

import sys

import click

from .._version import __version__
from .errors import EXIT_INTERRUPTED
from .options import CONTEXT


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="batchjac")
def cli() -> None:
    """Per-instance Jacobians of neural networks over large batches."""


def _register() -> None:
    from . import bench, check, compute, demo, hessian, products, propagate, report, solve

    for module in (compute, hessian, solve, check, propagate, report, demo, bench):
        cli.add_command(module.command)
    cli.add_command(products.jvp)
    cli.add_command(products.vjp)
    cli.add_command(products.divergence)


_register()


def main() -> None:
    """The ``batchjac`` console script."""
    from .quiet import silence_native_logs

    silence_native_logs(sys.argv[1:])  # before any framework is imported (-v: not at all)
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:  # pragma: no cover - Ctrl-C outside a command (while importing)
        sys.exit(EXIT_INTERRUPTED)


__all__ = ["cli", "main"]
