"""``batchjac check``: MODEL's Jacobians against central finite differences.

Exit codes as every subcommand (:mod:`batchjac.cli.errors`), and one of its own: 1 when the
check ran and failed (``EXIT_FAILED``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from .common import Files, backend_of, gather_inputs, load_model
from .errors import EXIT_FAILED, guard
from .options import (
    CONTEXT,
    input_options,
    max_memory_option,
    mode_option,
    model_argument,
    model_options,
    output_options,
)

if TYPE_CHECKING:
    from .._plan import ModeArg


@click.command("check", context_settings=CONTEXT)
@model_argument()
@input_options(several=True)
@model_options
@click.option("--rtol", type=float, help="Tolerance on the per-instance error (default 1e-3 "
              "for float32 Jacobians, 1e-6 for float64).")
@click.option("--sample", type=click.IntRange(min=1), help="Check this many random instances.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --sample.")
@mode_option("The mode whose Jacobians are checked.")
@max_memory_option
@click.pass_context
@output_options
@guard("check")
def check(ctx: click.Context, model: str, inputs: tuple[str, ...], known: str | None,
          wrt: str | None, wrt_input: int | None, backend: str | None, dtype: str | None,
          trust_model: bool, rtol: float | None, sample: int | None, seed: int, mode: ModeArg,
          max_memory: str | None) -> None:
    """Check MODEL's Jacobians against central finite differences.

    Prints the per-instance report; the exit code is 0 when the check passes, 1 when it fails.
    """
    from .._check import check as run_check

    with Files() as files:
        args, columns = gather_inputs(files, inputs, known=known, wrt=wrt, wrt_input=wrt_input)
        loaded = load_model(model, trust=trust_model)
        report = run_check(loaded.model, *args, wrt=columns, rtol=rtol, sample=sample, seed=seed,
                           mode=mode, dtype=dtype, backend=backend_of(backend, loaded),
                           max_memory=max_memory)
    click.echo(str(report))
    if not report.passed:
        ctx.exit(EXIT_FAILED)


command = check
