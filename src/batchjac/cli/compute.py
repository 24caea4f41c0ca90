"""``batchjac compute``: Jacobians of a model file over input files, into a resumable store.

A thin layer over ``batchjac.jacobian(model, files..., out=Store(...))``: it opens the files,
loads the model, and leaves the errors to :func:`batchjac.cli.errors.guard` (one line on stderr
and the exit code of docs/cli.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .common import (
    Files,
    backend_of,
    gather_inputs,
    load_model,
    refuse_existing,
    resolve_output,
    store_paths,
    store_suffix,
)
from .errors import guard
from .options import (
    CONTEXT,
    explain_option,
    input_options,
    json_option,
    max_memory_option,
    mode_option,
    model_argument,
    model_options,
    output_options,
    overwrite_option,
)

if TYPE_CHECKING:
    from .._plan import ModeArg
    from .._validate import NanPolicy


@click.command("compute", context_settings=CONTEXT)
@model_argument()
@input_options(several=False)
@click.option("-o", "--out", required=True, metavar="PATH",
              help="Output store: .zarr, .h5/.hdf5 or .npy (resumed if it is unfinished).")
@click.option("--with-outputs", is_flag=True, help="Store the model's outputs beside the Jacobians.")
@mode_option("Differentiation mode; auto decides from the shapes.")
@click.option("--chunk-size", type=click.IntRange(min=1), metavar="ROWS",
              help="Rows per chunk (default: from --max-memory).")
@max_memory_option
@model_options
@click.option("--nan-policy", type=click.Choice(["raise", "propagate"]), default="raise",
              show_default=True, help="NaN/Inf inputs: stop with an error, or give NaN Jacobians.")
@click.option("--output-names", metavar="NAMES",
              help="Comma-separated names of the model's outputs, stored as metadata.")
@overwrite_option
@output_options
@json_option
@explain_option("the chosen mode and chunk size")
@click.option("--scheduler", metavar="ADDRESS|local:N",
              help="Compute on Dask: a scheduler address, or local:N worker processes; "
                   "the workers write the store.")
@guard("compute", interrupted="finished chunks are kept: run the same command again to continue.")
def compute(model: str, inputs: str, known: str | None, wrt: str | None, out: str,
            with_outputs: bool, mode: ModeArg, chunk_size: int | None, max_memory: str | None,
            backend: str | None, dtype: str | None, trust_model: bool, nan_policy: NanPolicy,
            output_names: str | None, overwrite: bool, quiet: bool, as_json: bool, explain: bool,
            scheduler: str | None) -> None:
    """Jacobians of MODEL over the rows of --inputs, written to --out chunk by chunk.

    If the run stops (killed, disk full), the same command continues from the finished chunks.
    """
    from .._jacobian import jacobian
    from .._stores import Store, read_manifest, store_format

    # the cheap checks first: loading a framework takes seconds
    resolve_output("--out", out, replaces=store_paths(out, store_format(out)),
                   derived=store_suffix())
    with Files() as files:
        args, columns = gather_inputs(files, (inputs,), known=known, wrt=wrt)
        refuse_existing([Path(out)], option="--out", overwrite=overwrite,
                        finished=lambda path: read_manifest(path) is not None)
        loaded = load_model(model, trust=trust_model)
        names = [n.strip() for n in output_names.split(",")] if output_names else None
        store = Store(out, overwrite=overwrite, model_id=loaded.fingerprint, output_names=names)
        result = jacobian(loaded.model, *args, wrt=columns, chunk_size=chunk_size,
                          max_memory=max_memory, dtype=dtype, return_outputs=with_outputs,
                          out=store, explain=explain, progress=not quiet, scheduler=scheduler,
                          mode=mode, nan_policy=nan_policy, backend=backend_of(backend, loaded))
    summary = result.summary()
    if as_json:
        summary["output"] = summary.pop("path")
        click.echo(json.dumps(summary))
    if not quiet:
        click.echo(_describe(result), err=True)


def _describe(result: Any) -> str:
    rate = f", {result.rows / result.seconds:,.0f} rows/s" if result.seconds > 0 and result.rows else ""
    resumed = f"; {result.resumed_chunks} of {result.chunks} chunks were already done" \
        if result.resumed_chunks else ""
    chunks = "1 chunk" if result.chunks == 1 else f"{result.chunks} chunks"
    return (f"batchjac: {result.rows:,} rows -> {result.path} in {result.seconds:.1f} s{rate} "
            f"({result.mode} mode, {chunks} of {result.chunk_size:,} rows{resumed})")


command = compute
