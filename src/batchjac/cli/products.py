"""``batchjac jvp``, ``batchjac vjp`` and ``batchjac divergence``: per-instance Jacobian-vector
and vector-Jacobian products, and the trace of a square J (exact or estimated), of a model file
over input files, into a resumable store, without forming (or storing) J.

A thin layer over ``batchjac.jvp(model, files..., tangents=..., out=Store(...))`` (and
``vjp``), as ``batchjac hessian`` is over ``hessian``: the same inputs, model, store and exit
codes (docs/cli.md). The directions file has one row per instance: ``(N, *unknowns)`` or
``(N, d, *unknowns)`` for ``jvp``, ``(N, *outputs)`` or ``(N, d, *outputs)`` for ``vjp``; it is
read a chunk's rows at a time, as the inputs are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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
    input_options,
    json_option,
    max_memory_option,
    model_argument,
    model_options,
    overwrite_option,
    quiet_option,
)

if TYPE_CHECKING:
    from .._validate import NanPolicy



def _store_options(verb: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The options every product command shares (what it stores beside the result, chunking,
    memory, the model's backend and dtype, NaN handling, the store's overwrite, output), and
    its error guard."""
    def apply(command: Callable[..., None]) -> Callable[..., None]:
        for option in reversed((
                click.option("--with-outputs", is_flag=True,
                             help="Store the model's outputs beside them."),
                click.option("--chunk-size", type=click.IntRange(min=1), metavar="ROWS",
                             help="Rows per chunk (default: from --max-memory)."),
                max_memory_option, model_options,
                click.option("--nan-policy", type=click.Choice(["raise", "propagate"]),
                             default="raise", show_default=True,
                             help="NaN/Inf inputs: stop with an error, or give NaN results."),
                overwrite_option, quiet_option, json_option,
                guard(verb, interrupted="finished chunks are kept: run the same command "
                                        "again to continue."))):
            command = option(command)
        return command

    return apply


def _report(res: Any, as_json: bool, quiet: bool) -> None:
    """The finished store's summary: JSON on stdout with --json, a line on stderr unless
    --quiet."""
    summary = res.summary()
    if as_json:
        summary["output"] = summary.pop("path")
        click.echo(json.dumps(summary))
    if not quiet:
        click.echo(_describe(res), err=True)


def _command(kind: str) -> click.Command:
    option = "--tangents" if kind == "jvp" else "--cotangents"
    what = ("tangents, one row per instance shaped like its unknowns (or (N, d, ...): d "
            "directions each)" if kind == "jvp" else
            "cotangents, one row per instance shaped like its outputs (or (N, d, ...): d "
            "directions each)")
    result = "J v" if kind == "jvp" else "c^T J"

    @click.command(kind, context_settings=CONTEXT)
    @model_argument()
    @input_options(several=False)
    @click.option(option, "directions", required=True, metavar="FILE",
                  help=f"The {what}: .npy, .npz:key, .csv, .h5:/dataset or .zarr[:array].")
    @click.option("-o", "--out", required=True, metavar="PATH",
                  help="Output store: .zarr, .h5/.hdf5 or .npy (resumed if it is unfinished).")
    @_store_options(kind)
    def command(model: str, inputs: str, known: str | None, wrt: str | None, directions: str,
                out: str, with_outputs: bool, chunk_size: int | None, max_memory: str | None,
                backend: str | None, dtype: str | None, trust_model: bool,
                nan_policy: NanPolicy, overwrite: bool, quiet: bool, as_json: bool) -> None:

        from .. import _products
        from .._stores import Store
        from .._stores.hessians import second_format

        resolve_output("--out", out, replaces=store_paths(out, second_format(
            out, _products.RESULT[kind])), derived=store_suffix())
        with Files() as files:
            args, columns = gather_inputs(files, (inputs,), known=known, wrt=wrt)
            vectors = files.open(directions, option)  # (read a chunk's rows at a time)
            loaded = load_model(model, trust=trust_model)
            store = Store(out, overwrite=overwrite, model_id=loaded.fingerprint)
            verb = _products.jvp if kind == "jvp" else _products.vjp
            named = {"tangents" if kind == "jvp" else "cotangents": vectors}
            res = verb(loaded.model, *args, wrt=columns, chunk_size=chunk_size,
                       max_memory=max_memory, dtype=dtype, return_outputs=with_outputs,
                       nan_policy=nan_policy, out=store, progress=not quiet,
                       backend=backend_of(backend, loaded), **named)
        _report(res, as_json, quiet)

    command.__doc__ = (f"Per-instance {result} of MODEL over the rows of --inputs and "
                       f"{option}, written to --out chunk by chunk, without forming J.\n\n"
                       f"If the run stops, the same command continues from the finished "
                       f"chunks.")
    assert isinstance(command, click.Command)
    return command


jvp = _command("jvp")
vjp = _command("vjp")


@click.command("divergence", context_settings=CONTEXT)
@model_argument()
@input_options(several=False)
@click.option("-o", "--out", required=True, metavar="PATH",
              help="Output store: .zarr, .h5/.hdf5 or .npy (resumed if it is unfinished).")
@click.option("--estimator", type=click.Choice(["hutchinson", "hutch++"]),
              help="Estimate the trace from products instead of computing it: the store holds "
                   "(N, 2), each estimate and its standard error. Default: exact, (N,).")
@click.option("--samples", type=click.IntRange(min=2), default=16, show_default=True,
              help="Products an instance, with --estimator (hutch++: at least 4).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the probes, with --estimator.")
@_store_options("divergence")
def divergence(model: str, inputs: str, known: str | None, wrt: str | None, out: str,
               estimator: str | None, samples: int, seed: int, with_outputs: bool,
               chunk_size: int | None, max_memory: str | None, backend: str | None,
               dtype: str | None, trust_model: bool, nan_policy: NanPolicy, overwrite: bool,
               quiet: bool, as_json: bool) -> None:
    """Per-instance divergence (the trace of a square J) of MODEL over the rows of --inputs,
    written to --out chunk by chunk, exact or estimated, without storing J.

    If the run stops, the same command continues from the finished chunks."""
    from .. import _products
    from .._stores import Store
    from .._stores.hessians import second_format

    resolve_output("--out", out, replaces=store_paths(out, second_format(out, "divergences")),
                   derived=store_suffix())
    with Files() as files:
        args, columns = gather_inputs(files, (inputs,), known=known, wrt=wrt)
        loaded = load_model(model, trust=trust_model)
        store = Store(out, overwrite=overwrite, model_id=loaded.fingerprint)
        res = _products.divergence(loaded.model, *args, wrt=columns, estimator=estimator,  # type: ignore[arg-type]
                                   samples=samples, seed=seed, chunk_size=chunk_size,
                                   max_memory=max_memory, dtype=dtype,
                                   return_outputs=with_outputs, nan_policy=nan_policy, out=store,
                                   progress=not quiet, backend=backend_of(backend, loaded))
    _report(res, as_json, quiet)
