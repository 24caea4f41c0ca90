"""``batchjac demo``: the original question on the built-in seed model, checked and timed."""

from __future__ import annotations

import click

from .errors import guard
from .options import CONTEXT


@click.command("demo", context_settings=CONTEXT)
@click.option("-n", "--rows", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Number of instances.")
@guard("demo")
def demo(rows: int) -> None:
    """The original question on the built-in seed model, checked and timed."""
    from .._demo import main as run_demo

    run_demo(rows)


command = demo
