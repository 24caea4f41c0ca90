"""The options the subcommands share, and the parsers of their values.

Each option is defined once here, with one help text, and commands compose them: a flag means
the same in ``compute``, ``solve``, ``check``, ``propagate`` and ``report``. Only click is
imported: ``batchjac --help`` stays fast.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"]}

#: the input formats of :func:`batchjac._io.open_input`, for help texts
INPUT_FORMATS = ".npy, .npz:key, .csv, .tsv, .parquet, .h5:/dataset or .zarr[:array]"

MODEL_HELP = ("MODEL is a Keras .keras/.h5 file, a TensorFlow SavedModel directory, a TorchScript "
              ".pt file, a torch.export .pt2 file, an ONNX .onnx file, or a Python callable as "
              "module:attr or file.py:attr (append '()' to call a factory).")


# The decorator factories below carry `# pragma: no mutate block` (see `make mutate`): they
# run once, when the command modules are imported, before mutmut picks a mutant, so no test
# can execute a mutant of them. What they build is tested through --help and the commands.
def _compose(*decorators: Callable[[F], F]) -> Callable[[F], F]:  # pragma: no mutate block
    def apply(fn: F) -> F:
        for decorator in reversed(decorators):
            fn = decorator(fn)
        return fn

    return apply


def model_argument(*, required: bool = True) -> Callable[[F], F]:  # pragma: no mutate block
    """MODEL, loaded by :func:`batchjac.cli.common.load_model` (honours --trust-model); its
    description is appended to the command's help (put this below ``@click.command``)."""
    argument = click.argument("model", metavar="MODEL" if required else "[MODEL]",
                              required=required)

    def apply(fn: F) -> F:
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\n{MODEL_HELP}"
        return argument(fn)

    return apply


def input_options(*, several: bool) -> Callable[[F], F]:  # pragma: no mutate block
    """``--inputs``, ``--known`` and ``--wrt`` (and ``--wrt-input`` when ``several``: a model
    with several inputs, one --inputs file each). Commands with one input file require it."""
    inputs = click.option(
        "-i", "--inputs", "inputs", metavar="FILE", required=not several, multiple=several,
        help=f"Input rows: {INPUT_FORMATS}" + (" (repeat for a model with several inputs)."
                                               if several else "."))
    known = click.option(
        "-k", "--known", metavar="FILE",
        help="Known inputs, one row per row of --inputs; the model then takes "
             "concat([inputs, known], -1) and every column of --inputs is unknown.")
    wrt = click.option(
        "--wrt", metavar="COLS",
        help="Unknown columns of --inputs: indices 0,1,4, ranges 0:5 or 0-4, or column names.")
    if not several:
        return _compose(inputs, known, wrt)
    wrt_input = click.option("--wrt-input", type=int, metavar="INDEX",
                             help="With several --inputs: which one holds the unknowns.")
    return _compose(inputs, known, wrt, wrt_input)


backend_option = click.option(
    "--backend", type=click.Choice(["tensorflow", "torch", "jax"]),
    help="Framework of the model (default: from the model file or object).")
dtype_option = click.option(
    "--dtype", type=click.Choice(["float32", "float64"]),
    help="Compute dtype (default float32, float64 for float64 arrays).")
trust_option = click.option(
    "--trust-model", is_flag=True,
    help="Allow model files that run code while loading (Keras Lambda layers, pickles).")
def _memory_size(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--max-memory checked when the options are parsed, before any file or output exists
    (a bad size found later left an unfinished store behind)."""
    if value is not None:
        from .._config import parse_bytes
        from .._errors import InputError

        try:
            parse_bytes(value, name="--max-memory")
        except InputError as e:
            raise click.BadParameter(str(e).replace("`--max-memory` must", "must"), ctx, param) from None
    return value


max_memory_option = click.option(
    "--max-memory", metavar="SIZE", callback=_memory_size, help="Memory budget, e.g. 512MB or 2GB.")
overwrite_option = click.option(
    "--overwrite", is_flag=True,
    help="Replace an output, or discard an unfinished one, made by a different job.")
quiet_option = click.option("-q", "--quiet", is_flag=True,
                            help="Only errors on stderr: no progress bar, summary or warnings.")
verbose_option = click.option(
    "-v", "--verbose", is_flag=True,
    help="Show the frameworks' own logs and warnings too (hidden by default).")
#: what every command takes for its terminal output: -q and -v (see batchjac.cli.quiet)
output_options = _compose(quiet_option, verbose_option)
json_option = click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")


def explain_option(what: str) -> Callable[[F], F]:  # pragma: no mutate block
    return click.option("--explain", is_flag=True, help=f"Print {what}, and why.")


def mode_option(help: str) -> Callable[[F], F]:  # pragma: no mutate block
    return click.option("--mode", type=click.Choice(["auto", "forward", "reverse"]), default="auto",
                        show_default=True, help=help)


#: what every command that runs a model takes: MODEL's framework and dtype, and --trust-model
model_options = _compose(backend_option, dtype_option, trust_option)


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


def parse_names(text: str | None, *, option: str) -> list[str] | None:
    """``a,b,c``, or ``@file`` with one name per line."""
    if text is None:
        return None
    if text.startswith("@"):
        from .._io import require_regular

        require_regular(text[1:], f"{option} file")  # a FIFO would block read_text()
        try:
            return [ln.strip() for ln in Path(text[1:]).read_text().splitlines() if ln.strip()]
        except OSError as e:
            from .._io import InputFileError

            raise InputFileError(f"Cannot read the {option} file {text[1:]!r} ({e.strerror or e}); "
                                 f"give a readable file with one name per line, or a,b,c.") from None
    return [t.strip() for t in text.split(",")]


def parse_numbers(text: str) -> list[float] | None:
    """``"0.1"`` or ``"0.1,0.2"`` as floats; None when ``text`` is not numbers (a file)."""
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        return None
