"""``batchjac compute``: Jacobians of a model file over input files, into a resumable store.

A thin layer over ``batchjac.jacobian(model, files..., out=Store(...))``: it opens the files,
loads the model, and maps errors to one line on stderr and an exit code (docs/cli.md):

    0 done (or already done)      4 invalid input data          7 writing the output failed
    1 internal error (a bug)      5 model cannot be loaded or   (disk full...): run again
    2 usage error                   differentiated                to continue
    3 missing/unreadable file,    6 output exists or belongs    130 interrupted: run again
      unknown format                to another job                to continue

Heavy imports (frameworks, zarr, h5py) happen inside the command, so ``--help`` is fast.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import click

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_FILE = 3
EXIT_INPUT = 4
EXIT_MODEL = 5
EXIT_EXISTS = 6
EXIT_WRITE = 7
EXIT_INTERRUPTED = 130


def parse_wrt(text: str) -> list[int | str]:
    """``"0,1,4"``, ``"0:5"`` (end excluded), ``"0-4"`` (end included), column names, or a mix.

    >>> parse_wrt("0:3,7,x9,1-2")
    [0, 1, 2, 7, 'x9', 1, 2]
    """
    out: list[int | str] = []
    for raw in text.split(","):
        token = raw.strip()
        if not token:
            raise click.BadParameter(f"empty item in {text!r}; separate columns by commas.",
                                     param_hint="--wrt")
        if re.fullmatch(r"-?\d+", token):
            out.append(int(token))
        elif m := re.fullmatch(r"(\d*):(\d+)", token):
            out.extend(range(int(m.group(1) or 0), int(m.group(2))))
        elif m := re.fullmatch(r"(\d+)-(\d+)", token):
            out.extend(range(int(m.group(1)), int(m.group(2)) + 1))
        else:
            out.append(token)
    return out


def _one_line(e: BaseException) -> str:
    """The message without the bracketed context batchjac adds at its boundary."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    return " ".join(ln for ln in lines if ln and not (ln.startswith("[") and ln.endswith("]")))


def _exit_code(e: BaseException) -> int | None:
    from ._errors import BackendNotAvailableError, BatchJacError, InputError, ModelError
    from ._io import InputFileError
    from ._stores import StoreExistsError, StoreWriteError

    if isinstance(e, StoreWriteError):
        return EXIT_WRITE
    if isinstance(e, StoreExistsError):
        return EXIT_EXISTS
    if isinstance(e, InputFileError):
        return EXIT_FILE
    if isinstance(e, (ModelError, BackendNotAvailableError)):
        return EXIT_MODEL
    if isinstance(e, (InputError, BatchJacError)):
        return EXIT_INPUT
    return None


@click.command("compute", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("-i", "--inputs", required=True, metavar="FILE",
              help="Input rows: .npy, .npz:key, .csv, .tsv, .parquet, .h5:/dataset or .zarr[:array].")
@click.option("-k", "--known", metavar="FILE",
              help="Known inputs, one row per row of --inputs; the model then takes "
                   "concat([inputs, known], -1) and every column of --inputs is unknown.")
@click.option("--wrt", metavar="COLS",
              help="Unknown columns of --inputs: indices 0,1,4, ranges 0:5 or 0-4, or column names.")
@click.option("-o", "--out", required=True, metavar="PATH",
              help="Output store: .zarr, .h5/.hdf5 or .npy (resumed if it is unfinished).")
@click.option("--with-outputs", is_flag=True, help="Store the model's outputs beside the Jacobians.")
@click.option("--mode", type=click.Choice(["auto", "forward", "reverse"]), default="auto",
              show_default=True, help="Differentiation mode; auto decides from the shapes.")
@click.option("--chunk-size", type=click.IntRange(min=1), metavar="ROWS",
              help="Rows per chunk (default: from --max-memory).")
@click.option("--max-memory", metavar="SIZE", help="Memory budget per chunk, e.g. 512MB or 2GB.")
@click.option("--dtype", type=click.Choice(["float32", "float64"]),
              help="Compute dtype (default float32, float64 for float64 arrays).")
@click.option("--backend", type=click.Choice(["tensorflow", "torch", "jax"]),
              help="Framework of the model (default: from the model file or object).")
@click.option("--nan-policy", type=click.Choice(["raise", "propagate"]), default="raise",
              show_default=True, help="NaN/Inf inputs: stop with an error, or give NaN Jacobians.")
@click.option("--output-names", metavar="NAMES",
              help="Comma-separated names of the model's outputs, stored as metadata.")
@click.option("--overwrite", is_flag=True,
              help="Replace an output, or discard an unfinished one, made by a different job.")
@click.option("--trust-model", is_flag=True,
              help="Allow model files that run code while loading (Keras Lambda layers, pickles).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@click.option("--explain", is_flag=True, help="Print the chosen mode and chunk size, and why.")
@click.option("--scheduler", metavar="ADDRESS|local:N",
              help="Compute on Dask: a scheduler address, or local:N worker processes; "
                   "the workers write the store.")
@click.pass_context
def compute(ctx: click.Context, model: str, inputs: str, known: str | None, wrt: str | None,
            out: str, with_outputs: bool, mode: str, chunk_size: int | None,
            max_memory: str | None, dtype: str | None, backend: str | None, nan_policy: str,
            output_names: str | None, overwrite: bool, trust_model: bool, quiet: bool,
            as_json: bool, explain: bool, scheduler: str | None) -> None:
    """Jacobians of MODEL over the rows of --inputs, written to --out chunk by chunk.

    MODEL is a Keras .keras/.h5 file, a TensorFlow SavedModel directory, a TorchScript .pt
    file, a torch.export .pt2 file, or a Python callable as module:attr or file.py:attr.
    If the run stops (killed, disk full), the same command continues from the finished chunks.
    """
    if known is not None and wrt is not None:
        raise click.UsageError("--wrt selects unknown columns of --inputs, but with --known every "
                               "column of --inputs is unknown; use one or the other.")
    columns = parse_wrt(wrt) if wrt is not None else None
    names = [n.strip() for n in output_names.split(",")] if output_names else None
    try:
        result = _run(model, inputs, known, columns, out, with_outputs=with_outputs, mode=mode,
                      chunk_size=chunk_size, max_memory=max_memory, dtype=dtype, backend=backend,
                      nan_policy=nan_policy, output_names=names, overwrite=overwrite,
                      trust=trust_model, quiet=quiet, explain=explain, scheduler=scheduler)
    except KeyboardInterrupt:
        click.echo("batchjac compute: interrupted; finished chunks are kept: run the same command "
                   "again to continue.", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    except Exception as e:
        code = _exit_code(e)
        if code is None:
            raise  # a bug: keep the traceback
        click.echo(f"batchjac compute: error: {_one_line(e)}", err=True)
        ctx.exit(code)
    summary = result.summary()
    if as_json:
        summary["output"] = summary.pop("path")
        click.echo(json.dumps(summary))
    if not quiet:
        click.echo(_describe(result), err=True)


def _run(model_ref: str, inputs: str, known: str | None, wrt: list[int | str] | None, out: str, *,
         with_outputs: bool, mode: str, chunk_size: int | None, max_memory: str | None,
         dtype: str | None, backend: str | None, nan_policy: str, output_names: list[str] | None,
         overwrite: bool, trust: bool, quiet: bool, explain: bool, scheduler: str | None = None) -> Any:
    from ._errors import InputError
    from ._io import open_input
    from ._jacobian import jacobian
    from ._loaders import load_model
    from ._stores import Store, StoreExistsError, format_of, read_manifest

    # the cheap checks first: loading a framework takes seconds
    format_of(out)
    x = open_input(inputs, what="--inputs")
    readers = [x]
    try:
        if known is not None:
            h = open_input(known, what="--known")
            readers.append(h)
            if len(h) != len(x):
                raise InputError(f"--known {known!r} has {len(h)} rows but --inputs {inputs!r} has "
                                 f"{len(x)}; they must have one row per instance.")
        if not overwrite and _exists(out) and read_manifest(out) is None:
            raise StoreExistsError(f"The output {out!r} exists and is not a finished batchjac "
                                   f"output; choose another --out, or pass --overwrite to replace it.")
        loaded = load_model(model_ref, trust=trust)
        store = Store(out, overwrite=overwrite, model_id=loaded.fingerprint, output_names=output_names)
        options: dict[str, Any] = {"mode": mode, "nan_policy": nan_policy,
                                   "backend": backend or loaded.backend}
        return jacobian(loaded.model, *readers, wrt=wrt, chunk_size=chunk_size,
                        max_memory=max_memory, dtype=dtype, return_outputs=with_outputs,
                        out=store, explain=explain, progress=not quiet, scheduler=scheduler, **options)
    finally:
        for r in readers:
            r.close()


def _exists(path: str) -> bool:
    import os

    return os.path.lexists(path)


def _describe(result: Any) -> str:
    rate = f", {result.rows / result.seconds:,.0f} rows/s" if result.seconds > 0 and result.rows else ""
    resumed = f"; {result.resumed_chunks} of {result.chunks} chunks were already done" \
        if result.resumed_chunks else ""
    chunks = "1 chunk" if result.chunks == 1 else f"{result.chunks} chunks"
    return (f"batchjac: {result.rows:,} rows -> {result.path} in {result.seconds:.1f} s{rate} "
            f"({result.mode} mode, {chunks} of {result.chunk_size:,} rows{resumed})")


COMMANDS = [compute]


if __name__ == "__main__":  # pragma: no cover - `python -m batchjac._cli_compute`
    sys.exit(compute.main(prog_name="batchjac compute"))
