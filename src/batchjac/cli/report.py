"""``batchjac report``: a sensitivity report (heatmap, per-output bar charts, report.md) from
MODEL and its inputs, or from precomputed Jacobians. A report already in the output
directory (``report.md``, ``sensitivity_*.png``) is kept unless ``--overwrite`` (exit 6, as
every output: nothing records which run wrote it). Exit codes as every subcommand
(:mod:`batchjac.cli.errors`); a failure to write the report is 7.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    writing_output,
)
from .errors import guard
from .options import (
    CONTEXT,
    INPUT_FORMATS,
    input_options,
    max_memory_option,
    model_argument,
    model_options,
    output_options,
    overwrite_option,
    parse_names,
)

if TYPE_CHECKING:
    from .._sensitivity import Measure


@click.command("report", context_settings=CONTEXT)
@model_argument(required=False)
@input_options(several=True)
@model_options
@max_memory_option
@click.option("--jacobians", metavar="FILE", help="Precomputed Jacobians (N, *out, *unknown) "
              f"instead of MODEL ({INPUT_FORMATS}); --inputs are then the unknowns' values.")
@click.option("--outputs", metavar="FILE", help="With --jacobians: the model's outputs "
              "(for elasticities).")
@click.option("--input-names", metavar="NAMES", help="Names of the unknowns: a,b,c or @file.")
@click.option("--output-names", metavar="NAMES", help="Names of the outputs: a,b,c or @file.")
@click.option("--by", type=click.Choice(["mean_abs", "elasticity", "scaled"]), default="mean_abs",
              show_default=True, help="Measure that ranks the inputs.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Inputs listed per output.")
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True,
              help="Directory for report.md and its PNG charts.")
@overwrite_option
@output_options
@guard("report")
def report(model: str | None, inputs: tuple[str, ...], known: str | None, wrt: str | None,
           wrt_input: int | None, backend: str | None, dtype: str | None, trust_model: bool,
           max_memory: str | None, jacobians: str | None, outputs: str | None,
           input_names: str | None, output_names: str | None, by: Measure, top: int,
           output: str, overwrite: bool) -> None:
    """Sensitivity report: heatmap, per-output bar charts and report.md.

    From MODEL and --inputs (the Jacobians are computed), or from --jacobians FILE.
    """
    from .._report import write_report
    from .._sensitivity import of_model, sensitivity

    if (model is None) == (jacobians is None):
        raise click.UsageError("Give either MODEL (the Jacobians are computed) or --jacobians FILE.")
    directory = resolve_output("--output", output, replaces=[
        Path(output, "report.md"), Path(output, "sensitivity_heatmap.png")])
    # (the charts' names follow the outputs' names: any earlier report's are kept too)
    earlier = [directory / "report.md", *sorted(directory.glob("sensitivity_*.png"))] \
        if directory.is_dir() else []
    refuse_existing(earlier, option="--output directory", overwrite=overwrite)
    inputs_named = parse_names(input_names, option="--input-names")
    outputs_named = parse_names(output_names, option="--output-names")
    with Files() as files:
        if jacobians is not None:
            if known is not None or wrt is not None or wrt_input is not None:
                raise click.UsageError("With --jacobians, --inputs is one file of the unknowns' "
                                       "values (no --known, --wrt or --wrt-input).")
            jac, x, y = _from_files(files, jacobians, inputs, outputs)
            sens = sensitivity(jac, x, y, by=by, input_names=inputs_named,
                               output_names=outputs_named)
        else:
            assert model is not None
            if outputs is not None:
                raise click.UsageError("--outputs goes with --jacobians; with MODEL the outputs are "
                                       "computed.")
            args, columns = gather_inputs(files, inputs, known=known, wrt=wrt, wrt_input=wrt_input)
            loaded = load_model(model, trust=trust_model)
            # (summed chunk by chunk as the Jacobians are computed: no Jacobian set held)
            sens = of_model(loaded.model, args, wrt=columns, dtype=dtype,
                            backend=backend_of(backend, loaded), max_memory=max_memory, by=by,
                            input_names=inputs_named, output_names=outputs_named)
    with writing_output(f"-o {output!r}"):
        path = write_report(sens, directory, top=top)
    click.echo(str(sens))
    click.echo(f"wrote {path}")


def _from_files(files: Files, jacobians: str, inputs: Sequence[str], outputs: str | None
                ) -> tuple[Any, Any, Any]:
    """(Jacobians, unknowns or None, outputs or None) as row readers of the given files."""
    if len(inputs) > 1:
        raise click.UsageError(f"With --jacobians, --inputs is one file of the unknowns' values; "
                               f"got {len(inputs)} --inputs files.")
    jac = files.open(jacobians, "--jacobians")
    x = files.open(inputs[0], "--inputs") if inputs else None
    y = files.open(outputs, "--outputs") if outputs is not None else None
    return jac, x, y


command = report
