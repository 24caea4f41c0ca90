"""``batchjac hessian``: per-instance Hessians (or their diagonal, or the Laplacian) of a model
file over input files, into a resumable store.

A thin layer over ``batchjac.hessian(model, files..., out=Store(...))``, as ``batchjac
compute`` is over ``jacobian``: the same inputs, model, store and exit codes (docs/cli.md).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from .common import (
    Files,
    backend_of,
    gather_inputs,
    load_model,
    resolve_output,
    store_paths,
    store_suffix,
)
from .compute import _describe
from .errors import guard
from .options import (
    CONTEXT,
    explain_option,
    input_options,
    json_option,
    max_memory_option,
    model_argument,
    model_options,
    overwrite_option,
    quiet_option,
)

if TYPE_CHECKING:
    from .._plan import OrderArg
    from .._validate import NanPolicy


@click.command("hessian", context_settings=CONTEXT)
@model_argument()
@input_options(several=False)
@click.option("-o", "--out", required=True, metavar="PATH",
              help="Output store: .zarr, .h5/.hdf5 or .npy (resumed if it is unfinished).")
@click.option("--diagonal", is_flag=True,
              help="Only the diagonal of each Hessian, (N, *outputs, *unknowns).")
@click.option("--laplacian", is_flag=True,
              help="Only the Laplacian (trace over the unknowns), (N, *outputs).")
@click.option("--estimator", type=click.Choice(["hutchinson", "hutch++"]),
              help="With --laplacian or --diagonal: estimate it from Hessian-vector products "
                   "(hutch++: the Laplacian only); the store holds (..., 2), each estimate and "
                   "its standard error.")
@click.option("--samples", type=click.IntRange(min=2), default=16, show_default=True,
              help="Products an instance, with --estimator (hutch++: at least 4).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the probes, with --estimator.")
@click.option("--with-outputs", is_flag=True, help="Store the model's outputs beside them.")
@click.option("--with-jacobian", is_flag=True, help="Store the Jacobians of the same pass.")
@click.option("--mode", type=click.Choice(["auto", "forward-over-reverse", "forward-over-forward"]),
              default="auto", show_default=True,
              help="Order of the two differentiations; auto decides from the shapes.")
@click.option("--chunk-size", type=click.IntRange(min=1), metavar="ROWS",
              help="Rows per chunk (default: from --max-memory).")
@max_memory_option
@model_options
@click.option("--nan-policy", type=click.Choice(["raise", "propagate"]), default="raise",
              show_default=True, help="NaN/Inf inputs: stop with an error, or give NaN results.")
@overwrite_option
@quiet_option
@json_option
@explain_option("the chosen order and chunk size")
@guard("hessian", interrupted="finished chunks are kept: run the same command again to continue.")
def hessian(model: str, inputs: str, known: str | None, wrt: str | None, out: str,
            diagonal: bool, laplacian: bool, estimator: str | None, samples: int, seed: int,
            with_outputs: bool, with_jacobian: bool,
            mode: OrderArg, chunk_size: int | None, max_memory: str | None,
            backend: str | None, dtype: str | None, trust_model: bool, nan_policy: NanPolicy,
            overwrite: bool, quiet: bool, as_json: bool, explain: bool) -> None:
    """Hessians of MODEL over the rows of --inputs, written to --out chunk by chunk.

    --diagonal or --laplacian store only that reduction, computed without the full k x k
    Hessian per output, or estimated with --estimator. If the run stops, the same command
    continues from the finished chunks.
    """
    from .._errors import InputError
    from .._hessian import hessian as compute_hessian
    from .._stores import Store
    from .._stores.hessians import second_format

    if diagonal and laplacian:
        raise InputError("--diagonal and --laplacian ask for two results; pass one.")
    # the cheap checks first: loading a framework takes seconds
    resolve_output("--out", out, replaces=store_paths(out, second_format(out, "hessians")),
                   derived=store_suffix())
    with Files() as files:
        args, columns = gather_inputs(files, (inputs,), known=known, wrt=wrt)
        loaded = load_model(model, trust=trust_model)
        store = Store(out, overwrite=overwrite, model_id=loaded.fingerprint)
        result = compute_hessian(
            loaded.model, *args, wrt=columns, diagonal=diagonal, laplacian=laplacian,
            mode=mode, chunk_size=chunk_size, max_memory=max_memory, dtype=dtype,
            return_outputs=with_outputs, return_jacobian=with_jacobian, nan_policy=nan_policy,
            out=store, explain=explain, progress=not quiet, backend=backend_of(backend, loaded),
            estimator=estimator, samples=samples, seed=seed)  # type: ignore[arg-type]
    summary = result.summary()
    if as_json:
        summary["output"] = summary.pop("path")
        click.echo(json.dumps(summary))
    if not quiet:
        click.echo(_describe(result).replace(" mode,", ",", 1), err=True)


command = hessian
