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


# Commands of other modules (`COMMANDS = [...]` in each), registered without importing any
# framework: those modules import heavy things inside their command functions only.
_COMMAND_MODULES = ("_cli_compute", "_cli_analysis", "_cli_solve")


def _register() -> None:
    import importlib

    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"batchjac.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"batchjac.{name}":
                raise
            continue
        for command in module.COMMANDS:
            cli.add_command(command)


_register()


def main() -> None:
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:  # pragma: no cover
        sys.exit(130)


_SECTIONS = {"memory": "memory", "w5": "w5", "solve": "solve_bench", "dask": "dask_bench"}


@cli.command()
@click.option("--quick", is_flag=True, help="Smaller batches and fewer repeats (about two minutes).")
@click.option("--output", type=click.Path(dir_okay=False), default="BENCHMARKS.md", show_default=True,
              help="Markdown report to write; the PNG chart goes beside it.")
@click.option("--backend", "backends", multiple=True, type=click.Choice(["tensorflow", "torch", "jax"]),
              help="Only these backends (repeatable); default: every installed one.")
@click.option("--workload", "workloads", multiple=True, type=click.Choice(["W1", "W2", "W3", "W4"]),
              help="Only these workloads (repeatable).")
@click.option("--skip", "skipped", multiple=True, type=click.Choice(list(_SECTIONS)),
              help="Leave out an extra section of the full run (repeatable).")
@click.option("--cold/--no-cold", default=True, show_default=True,
              help="Also time first calls in fresh processes (W1 only with --quick).")
@click.option("--only-cold", is_flag=True, help="Only the first calls in fresh processes.")
def bench(quick: bool, output: str, backends: tuple[str, ...], workloads: tuple[str, ...],
          skipped: tuple[str, ...], cold: bool, only_cold: bool) -> None:
    """Time batchjac beside the hand-written baselines and write BENCHMARKS.md.

    The full run adds, after W1-W4: out-of-core memory (W2, N=100,000), W5 (10M rows streamed
    to Zarr), the solver against scipy, and Dask against the local path. --quick runs W1-W4
    only, on smaller batches."""
    import importlib
    from pathlib import Path

    from ._bench.run import main as run_bench

    extras = [] if quick else [
        importlib.import_module(f"batchjac._bench.{module}").section
        for name, module in _SECTIONS.items() if name not in skipped
    ]
    run_bench(quick=quick, output=Path(output), backends=list(backends) or None,
              workloads=list(workloads) or None, log=lambda s: click.echo(s, err=True),
              command="batchjac " + " ".join(sys.argv[1:]), extras=extras, cold=cold,
              only_cold=only_cold)
