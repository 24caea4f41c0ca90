"""``batchjac bench``: batchjac timed beside hand-written baselines, into BENCHMARKS.md."""

from __future__ import annotations

import sys

import click

from .errors import guard
from .options import CONTEXT

#: the extra sections of a full run, and the modules of batchjac._bench that hold them
SECTIONS = {"memory": "memory", "w5": "w5", "w8": "w8", "w9": "w9", "w10": "w10",
            "products": "products", "arrays": "arrays", "solve": "solve_bench",
            "dask": "dask_bench"}


@click.command("bench", context_settings=CONTEXT)
@click.option("--quick", is_flag=True, help="Smaller batches and fewer repeats (about two minutes).")
@click.option("--output", type=click.Path(dir_okay=False), default="BENCHMARKS.md", show_default=True,
              help="Markdown report to write; the PNG chart goes beside it.")
@click.option("--backend", "backends", multiple=True,
              type=click.Choice(["tensorflow", "torch", "jax", "keras-jax", "keras-torch"]),
              help="Only these backends (repeatable); default: every installed one. keras-jax and "
                   "keras-torch: a Keras 3 model on that Keras backend, W1's first calls only.")
@click.option("--workload", "workloads", multiple=True,
              type=click.Choice(["W1", "W2", "W3", "W4", "W6", "W7", "W7H"]),
              help="Only these workloads (repeatable).")
@click.option("--skip", "skipped", multiple=True, type=click.Choice(list(SECTIONS)),
              help="Leave out an extra section of the full run (repeatable).")
@click.option("--cold/--no-cold", default=True, show_default=True,
              help="Also time first calls in fresh processes (W1 only with --quick).")
@click.option("--only-cold", is_flag=True, help="Only the first calls in fresh processes.")
@guard("bench")
def bench(quick: bool, output: str, backends: tuple[str, ...], workloads: tuple[str, ...],
          skipped: tuple[str, ...], cold: bool, only_cold: bool) -> None:
    """Time batchjac beside the hand-written baselines and write BENCHMARKS.md.

    W6, W7 and W7H are second order (Hessians, a Laplacian). The full run adds, after
    W1-W7H: out-of-core memory (W2, N=100,000), W5 (10M rows streamed to Zarr), W8 (10M
    Hessians streamed to Zarr), W9 (a bottleneck: mixed mode against the pure modes and a
    hand-written split), W10 (a physics-informed training step with
    differentiable=True), products without J (the divergence, J Sigma J^T), native arrays
    in and out (W2), the solver against scipy, and Dask
    against the local path.
    --quick runs W1-W7H only, on smaller batches."""
    import importlib
    from pathlib import Path

    from .._bench.run import main as run_bench

    extras = [] if quick else [
        importlib.import_module(f"batchjac._bench.{module}").section
        for name, module in SECTIONS.items() if name not in skipped
    ]
    run_bench(quick=quick, output=Path(output), backends=list(backends) or None,
              workloads=list(workloads) or None, log=lambda s: click.echo(s, err=True),
              command="batchjac " + " ".join(sys.argv[1:]), extras=extras, cold=cold,
              only_cold=only_cold)


command = bench
