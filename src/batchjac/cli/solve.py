"""``batchjac solve``: find the unknowns for every row of a targets file, into a resumable
output (:mod:`batchjac._solve_store`): streamed inputs, a progress bar, and the same command
continues after a kill. Exit codes as every subcommand (:mod:`batchjac.cli.errors`).
"""

from __future__ import annotations

import json
from typing import Any

import click

from .common import Files, load_model, resolve_output, store_paths, store_suffix
from .errors import guard
from .options import (
    CONTEXT,
    INPUT_FORMATS,
    explain_option,
    json_option,
    max_memory_option,
    model_argument,
    model_options,
    output_options,
    overwrite_option,
)


@click.command("solve", context_settings=CONTEXT)
@model_argument()
@click.option("--targets", required=True, metavar="FILE",
              help=f"Observed outputs, (N, *output_shape): {INPUT_FORMATS}.")
@click.option("-k", "--known", metavar="FILE",
              help="Known inputs, (N, h); the model takes concat([x, known]).")
@click.option("--x0", metavar="FILE", help="Starting points, (N, k) or (k,).")
@click.option("-o", "--out", "out", required=True, metavar="PATH",
              help="Output: a directory of .npy files (no suffix), or .zarr / .h5 "
                   "(resumed if it is unfinished).")
@click.option("--lower", metavar="NUM|FILE", help="Lower bounds: a number, (k,) or (N, k).")
@click.option("--upper", metavar="NUM|FILE", help="Upper bounds: a number, (k,) or (N, k).")
@click.option("--method", type=click.Choice(["lm", "gn"]), default="lm", show_default=True,
              help="Levenberg-Marquardt or Gauss-Newton with a line search.")
@click.option("--max-iter", type=click.IntRange(min=0), default=100, show_default=True)
@click.option("--xtol", type=float, help="Default: 1e-8 in float64, 1e-6 in float32.")
@click.option("--ftol", type=float)
@click.option("--gtol", type=float)
@click.option("--weights", metavar="NUM|FILE",
              help="Per-output weights: a number, the output shape, or one row per instance.")
@click.option("--sigma", metavar="NUM|FILE", help="Per-output standard deviations instead of weights.")
@click.option("--n-starts", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seed", type=int, help="Seed of the random starts (drawn and recorded if not given).")
@click.option("--fit-tol", type=click.FloatRange(min=0, min_open=True), metavar="REL",
              help="A converged instance succeeds when its residual norm is at most REL times "
                   "the targets' norm (default 1e-6 in float64, 1e-4 in float32); with --sigma, "
                   "a chi-square test instead.")
@click.option("--n-unknowns", type=click.IntRange(min=1),
              help="k, when neither --x0 nor bound files give it.")
@model_options
@max_memory_option
@click.option("--block-size", type=click.IntRange(min=1), metavar="ROWS",
              help="Instances per block (the unit of progress and resume).")
@click.option("--covariance", is_flag=True, help="Also write the covariance of x, (N, k, k).")
@click.option("--jacobian", is_flag=True, help="Also write the Jacobian at the solutions.")
@overwrite_option
@output_options
@json_option
@explain_option("the blocks, mode and chunk size")
@guard("solve", interrupted="finished blocks are kept: run the same command again to continue.")
def solve(model: str, targets: str, known: str | None, x0: str | None, out: str,
          lower: str | None, upper: str | None, method: str, max_iter: int, xtol: float | None,
          ftol: float | None, gtol: float | None, weights: str | None, sigma: str | None,
          n_starts: int, seed: int | None, fit_tol: float | None, n_unknowns: int | None,
          backend: str | None,
          dtype: str | None, trust_model: bool, max_memory: str | None, block_size: int | None,
          covariance: bool, jacobian: bool, overwrite: bool, quiet: bool, as_json: bool,
          explain: bool) -> None:
    """Solve MODEL(concat([x, known])) = targets for the unknowns x, row by row.

    Writes x, residual (the weighted residual norm), cost, success, status, iterations,
    rank, rank_deficient and start (one row per instance) to OUT, with the status counts and
    codes in summary.json (or the manifest of a .zarr/.h5 output). success means converged
    and fitted (see --fit-tol); converged to a point that does not fit is the status
    local_minimum. If the run stops, the same command continues.
    """
    from .._solve_store import SolveInputs, result_format, solve_to_store

    # the cheap checks first: loading a framework takes seconds
    resolve_output("--out", out, replaces=store_paths(out, result_format(out)),
                   derived=store_suffix())
    with Files() as files:
        inputs = SolveInputs(
            targets=files.open(targets, "--targets"), known=files.value(known, "--known"),
            x0=files.value(x0, "--x0"), lower=files.value(lower, "--lower"),
            upper=files.value(upper, "--upper"), weights=files.value(weights, "--weights"),
            sigma=files.value(sigma, "--sigma"))
        loaded = load_model(model, trust=trust_model)
        result = solve_to_store(
            loaded.model, inputs, out, overwrite=overwrite, model_id=loaded.fingerprint,
            method=method, max_iter=max_iter, xtol=xtol, ftol=ftol, gtol=gtol,
            n_starts=n_starts, seed=seed, fit_tol=fit_tol, n_unknowns=n_unknowns, dtype=dtype,
            backend=backend or loaded.backend, return_covariance=covariance,
            return_jacobian=jacobian, max_memory=max_memory, block_size=block_size,
            progress=not quiet, explain=explain)
    if as_json:
        click.echo(json.dumps(result.summary()))
    if not quiet:
        click.echo(_describe(result, n_starts), err=True)


def _describe(result: Any, n_starts: int) -> str:
    counts = ", ".join(f"{k} {v}" for k, v in result.status_counts.items())
    resumed = (f"; {result.resumed_blocks} of {result.blocks} blocks were already done"
               if result.resumed_blocks else "")
    minima = (f"; {result.local_minima} converged without fitting the targets (local_minimum): "
              f"--n-starts {max(8, 2 * n_starts)} restarts them from random points"
              if result.local_minima else "")
    return (f"batchjac solve: {result.succeeded}/{result.instances} instances fitted "
            f"({counts}) in {result.seconds:.2f} s{minima}{resumed}; results in {result.path}")


command = solve
