"""``batchjac solve``: find the unknowns for every row of a targets file, into a resumable
output (:mod:`batchjac._solve_store`): streamed inputs, a progress bar, and the same command
continues after a kill. Exit codes as ``batchjac compute`` (docs/cli.md).

Heavy imports (numpy's friends, frameworks, the solver) happen inside the command, so
``batchjac --help`` stays fast.
"""

from __future__ import annotations

import json
from typing import Any

import click

from ._cli_compute import EXIT_INTERRUPTED, _exit_code, _one_line


def _load(ref: str, trust: bool) -> Any:
    """MODEL as ``batchjac compute`` takes it (:func:`batchjac._loaders.load_model`), e.g.
    ``file.py:model`` or ``batchjac.examples:seed_model()`` (``()`` calls a factory)."""
    from ._loaders import load_model

    return load_model(ref, trust=trust)


def _value(value: str | None, what: str, readers: list[Any]) -> Any:
    """None, a number, or a file opened for reading rows (any format of ``compute``)."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    from ._io import open_input

    reader = open_input(value, what=what)
    readers.append(reader)
    return reader


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--targets", required=True, metavar="FILE",
              help="Observed outputs, (N, *output_shape): .npy, .npz:key, .csv, .parquet, "
                   ".h5:/dataset or .zarr[:array].")
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
@click.option("--n-unknowns", type=click.IntRange(min=1),
              help="k, when neither --x0 nor bound files give it.")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), help="Compute dtype.")
@click.option("--backend", type=click.Choice(["tensorflow", "torch", "jax"]))
@click.option("--max-memory", metavar="SIZE", help="Memory budget, e.g. 512MB or 2GB.")
@click.option("--block-size", type=click.IntRange(min=1), metavar="ROWS",
              help="Instances per block (the unit of progress and resume).")
@click.option("--covariance", is_flag=True, help="Also write the covariance of x, (N, k, k).")
@click.option("--jacobian", is_flag=True, help="Also write the Jacobian at the solutions.")
@click.option("--overwrite", is_flag=True,
              help="Replace an output, or discard an unfinished one, made by a different job.")
@click.option("--trust-model", is_flag=True,
              help="Allow model files that run code while loading (Keras Lambda layers, pickles).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@click.option("--explain", is_flag=True, help="Print the blocks, mode and chunk size, and why.")
@click.pass_context
def solve(ctx: click.Context, model: str, targets: str, known: str | None, x0: str | None,
          out: str, lower: str | None, upper: str | None, method: str, max_iter: int,
          xtol: float | None, ftol: float | None, gtol: float | None, weights: str | None,
          sigma: str | None, n_starts: int, seed: int | None, n_unknowns: int | None,
          dtype: str | None, backend: str | None, max_memory: str | None,
          block_size: int | None, covariance: bool, jacobian: bool, overwrite: bool,
          trust_model: bool, quiet: bool, as_json: bool, explain: bool) -> None:
    """Solve MODEL(concat([x, known])) = targets for the unknowns x, row by row.

    MODEL is a model file or 'module:attr' / 'file.py:attr' (append '()' to call a factory).
    Writes x, residual, cost, success, status, iterations, rank, rank_deficient and start
    (one row per instance) to OUT, with the status counts and codes in summary.json (or the
    manifest of a .zarr/.h5 output). If the run stops, the same command continues.
    """
    readers: list[Any] = []
    try:
        from ._solve_store import SolveInputs, output_format, solve_to_store

        output_format(out)  # the cheap checks first: loading a framework takes seconds
        t = _value(targets, "--targets", readers)
        if isinstance(t, float):
            raise click.UsageError("--targets must be a file with one row per instance.")
        inputs = SolveInputs(
            targets=t, known=_value(known, "--known", readers), x0=_value(x0, "--x0", readers),
            lower=_value(lower, "--lower", readers), upper=_value(upper, "--upper", readers),
            weights=_value(weights, "--weights", readers), sigma=_value(sigma, "--sigma", readers))
        loaded = _load(model, trust_model)
        result = solve_to_store(
            loaded.model, inputs, out, overwrite=overwrite, model_id=loaded.fingerprint,
            method=method, max_iter=max_iter, xtol=xtol, ftol=ftol, gtol=gtol,
            n_starts=n_starts, seed=seed, n_unknowns=n_unknowns, dtype=dtype,
            backend=backend or loaded.backend, return_covariance=covariance,
            return_jacobian=jacobian, max_memory=max_memory, block_size=block_size,
            progress=not quiet, explain=explain)
    except KeyboardInterrupt:
        click.echo("batchjac solve: interrupted; finished blocks are kept: run the same command "
                   "again to continue.", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    except click.ClickException:
        raise
    except Exception as e:
        code = _exit_code(e)
        if code is None:
            raise  # a bug: keep the traceback
        click.echo(f"batchjac solve: error: {_one_line(e)}", err=True)
        ctx.exit(code)
    finally:
        for r in readers:
            r.close()
    if as_json:
        click.echo(json.dumps(result.summary()))
    if not quiet:
        counts = ", ".join(f"{k} {v}" for k, v in result.status_counts.items())
        resumed = (f"; {result.resumed_blocks} of {result.blocks} blocks were already done"
                   if result.resumed_blocks else "")
        click.echo(f"batchjac solve: {result.succeeded}/{result.instances} instances converged "
                   f"({counts}) in {result.seconds:.2f} s{resumed}; results in {result.path}",
                   err=True)


COMMANDS = [solve]
