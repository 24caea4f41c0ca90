"""The ``batchjac`` command line. Heavy imports happen inside commands, so ``--help`` is fast."""

from __future__ import annotations

import sys

import click

from ._version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="batchjac")
def cli() -> None:
    """Per-instance Jacobians of neural networks over large batches."""


@cli.command()
@click.option("-n", "--rows", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Number of instances.")
def demo(rows: int) -> None:
    """The original question on the built-in seed model, checked and timed."""
    from ._demo import main as run_demo

    run_demo(rows)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:  # pragma: no cover
        sys.exit(130)
