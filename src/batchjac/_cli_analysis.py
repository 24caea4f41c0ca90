"""``batchjac check``, ``batchjac propagate`` and ``batchjac report``.

MODEL is a Python callable named ``module:attr`` or ``path/to/file.py:attr`` (``attr`` may be
dotted, and ``attr()`` calls a zero-argument factory); inputs are ``.npy`` files (opened
memory-mapped). Frameworks and batchjac's numerics are imported inside the commands only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

# -- shared helpers ----------------------------------------------------------------------------


class UserError(click.ClickException):
    """A mistake in the command line or its files: message to stderr, exit code 2, no traceback."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = code  # type: ignore[misc]  # click types it a ClassVar; set per error here


def load_model(target: str, *, trust: bool) -> Any:
    """MODEL as ``batchjac compute`` takes it (:func:`batchjac._loaders.load_model`): model files,
    ``module:attr`` or ``file.py:attr`` (dotted ``attr``, ``attr()`` for a factory).

    A model *file* that would run code while loading (a Keras ``Lambda`` layer, a pickled torch
    module) is refused unless ``trust`` (``--trust-model``), as ``compute`` and ``solve`` do:
    ``check`` on a file received from someone else must not run that someone's code."""
    from ._errors import BatchJacError
    from ._loaders import load_model as load

    if ":" not in target and not Path(target).exists():
        raise UserError(f"MODEL must be 'module:attr' or 'path/to/file.py:attr', or a model file; "
                        f"got {target!r}.")
    try:
        return load(target, trust=trust).model
    except BatchJacError as e:  # the exit codes of `compute`: 3 a missing file, 5 a refused model
        from ._cli_compute import _exit_code

        raise UserError(str(e), _exit_code(e) or 2) from e


def load_array(path: str, what: str) -> Any:
    import numpy as np

    if not path.endswith(".npy"):
        raise UserError(f"{what} must be a .npy file (np.save); got {path!r}.")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise UserError(f"{what} file {path!r} does not exist.") from None
    except (ValueError, OSError) as e:
        raise UserError(f"Cannot read {what} file {path!r} as a .npy array: {e}") from None


def parse_columns(text: str | None) -> Any:
    """``"0,1,4"`` -> [0, 1, 4]; ``"0:5"`` -> slice(0, 5); ``"2:"`` -> slice(2, None)."""
    if text is None:
        return None
    try:
        if ":" in text:
            lo, hi = text.split(":", 1)
            return slice(int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--wrt must be column indices such as 0,1,4 or a range 0:5; got "
                        f"{text!r}.") from None


def parse_names(text: str | None) -> list[str] | None:
    """``a,b,c`` or ``@file`` (one name per line)."""
    if text is None:
        return None
    if text.startswith("@"):
        try:
            return [ln.strip() for ln in Path(text[1:]).read_text().splitlines() if ln.strip()]
        except OSError as e:
            raise UserError(f"Cannot read names from {text[1:]!r}: {e}") from None
    return [t.strip() for t in text.split(",")]


def gather_inputs(inputs: tuple[str, ...], known: str | None, wrt: str | None,
                  wrt_input: int | None) -> tuple[tuple[Any, ...], Any]:
    """The positional inputs and ``wrt`` of the Python API from the command-line options."""
    if not inputs:
        raise UserError("Give the model's inputs with --inputs FILE.npy.")
    arrays = [load_array(p, "--inputs") for p in inputs]
    cols = parse_columns(wrt)
    if known is not None:
        if len(arrays) != 1 or cols is not None or wrt_input is not None:
            raise UserError("--known goes with one --inputs file (the unknowns) and no --wrt: the "
                            "model takes concat([unknown, known], -1).")
        return (arrays[0], load_array(known, "--known")), None
    if len(arrays) == 1:
        if wrt_input not in (None, 0):
            raise UserError(f"--wrt-input {wrt_input} is out of range: there is one --inputs file.")
        return (arrays[0],), cols
    if wrt_input is None:
        raise UserError(f"With {len(arrays)} --inputs files, say which holds the unknowns with "
                        f"--wrt-input INDEX (0..{len(arrays) - 1}).")
    return (tuple(arrays),), (wrt_input if cols is None else (wrt_input, cols))


def _guard(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a batchjac call; its user errors become clean command-line errors."""
    from ._errors import BatchJacError

    try:
        return fn(*args, **kwargs)
    except BatchJacError as e:
        raise UserError(str(e)) from e


_MODEL = click.argument("model", metavar="MODEL")
_COMMON = [
    click.option("--inputs", "inputs", multiple=True, metavar="FILE.npy",
                 help="Input array (repeat for a model with several inputs)."),
    click.option("--known", metavar="FILE.npy",
                 help="Known part: the model takes concat([inputs, known], -1)."),
    click.option("--wrt", metavar="COLS", help="Unknown columns, e.g. 0,1,4 or 0:5."),
    click.option("--wrt-input", type=int, metavar="INDEX",
                 help="With several --inputs: which one holds the unknowns."),
    click.option("--backend", type=click.Choice(["tensorflow", "torch", "jax"]),
                 help="Framework of the model (detected from it by default)."),
    click.option("--dtype", type=click.Choice(["float32", "float64"]),
                 help="Compute dtype (default: float32 unless the inputs are float64)."),
    click.option("--trust-model", is_flag=True,
                 help="Allow model files that run code while loading (Keras Lambda layers, pickles)."),
]


def _common(fn: Any) -> Any:
    for option in reversed(_COMMON):
        fn = option(fn)
    return fn


# -- commands ----------------------------------------------------------------------------------


@click.command()
@_MODEL
@_common
@click.option("--rtol", type=float, help="Tolerance on the per-instance error (default 1e-3 "
              "for float32 Jacobians, 1e-6 for float64).")
@click.option("--sample", type=click.IntRange(min=1), help="Check this many random instances.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --sample.")
@click.option("--mode", type=click.Choice(["auto", "forward", "reverse"]), default="auto",
              show_default=True, help="The mode whose Jacobians are checked.")
def check(model: str, inputs: tuple[str, ...], known: str | None, wrt: str | None,
          wrt_input: int | None, backend: str | None, dtype: str | None, trust_model: bool,
          rtol: float | None,
          sample: int | None, seed: int, mode: str) -> None:
    """Check MODEL's Jacobians against central finite differences.

    Prints the per-instance report; the exit code is 0 when the check passes, 1 when it fails.
    """
    from ._check import check as run_check

    fn = load_model(model, trust=trust_model)
    args, wrt_arg = gather_inputs(inputs, known, wrt, wrt_input)
    report = _guard(run_check, fn, *args, wrt=wrt_arg, rtol=rtol, sample=sample, seed=seed,
                    mode=mode, dtype=dtype, backend=backend)
    click.echo(str(report))
    if not report.passed:
        sys.exit(1)


@click.command()
@_MODEL
@_common
@click.option("--cov", metavar="FILE.npy", help="Covariance of the unknowns: (k, k) or (N, k, k).")
@click.option("--std", metavar="STD", help="Standard deviations: a number, a comma list (k "
              "values) or FILE.npy with (k,) or (N, k).")
@click.option("--method", type=click.Choice(["linear", "unscented", "monte_carlo"]),
              default="linear", show_default=True)
@click.option("--samples", type=click.IntRange(min=2), default=10_000, show_default=True,
              help="Samples per instance for monte_carlo.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of monte_carlo.")
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True,
              help="Directory for mean.npy (N, *output_shape) and cov.npy (N, m, m).")
def propagate(model: str, inputs: tuple[str, ...], known: str | None, wrt: str | None,
              wrt_input: int | None, backend: str | None, dtype: str | None, trust_model: bool,
              cov: str | None,
              std: str | None, method: str, samples: int, seed: int, output: str) -> None:
    """Propagate input uncertainty through MODEL: per-instance output mean and covariance.

    --inputs holds the unknowns' means. The results are written chunk by chunk into
    memory-mapped .npy files, so they may be larger than memory.
    """
    import numpy as np

    from ._evaluate import bind, output_size
    from ._propagate import propagate as run_propagate
    from ._validate import normalize

    fn = load_model(model, trust=trust_model)
    args, wrt_arg = gather_inputs(inputs, known, wrt, wrt_input)
    cov_arr = load_array(cov, "--cov") if cov is not None else None
    std_arr: Any = None
    if std is not None:
        if std.endswith(".npy"):
            std_arr = load_array(std, "--std")
        else:
            try:
                std_arr = np.array([float(t) for t in std.split(",")])
            except ValueError:
                raise UserError(f"--std must be a number, a comma list or a .npy file; got "
                                f"{std!r}.") from None
            std_arr = std_arr[0] if std_arr.size == 1 else std_arr
    spec = _guard(normalize, args, wrt=wrt_arg, dtype=dtype, nan_policy="raise")
    _, bound = _guard(bind, fn, spec, backend, None)
    assert bound.output_shape is not None
    m = output_size(bound)
    out_dir = Path(output)
    out_dir.mkdir(parents=True, exist_ok=True)
    # written under temporary names and renamed at the end: a failed or interrupted run never
    # leaves half-filled mean.npy/cov.npy behind (nor replaces those of an earlier run)
    final = {"mean": out_dir / "mean.npy", "cov": out_dir / "cov.npy"}
    partial = {key: out_dir / f".{path.name}.partial" for key, path in final.items()}
    try:
        mean_out = np.lib.format.open_memmap(partial["mean"], mode="w+", dtype=np.float64,
                                             shape=(spec.n, *bound.output_shape))
        cov_out = np.lib.format.open_memmap(partial["cov"], mode="w+", dtype=np.float64,
                                            shape=(spec.n, m, m))
        mean_in, known_in = (args[0], args[1]) if len(args) == 2 else (args[0], None)
        result = _guard(run_propagate, fn, mean_in, known_in, cov=cov_arr, std=std_arr,
                        method=method, wrt=wrt_arg, n_samples=samples, seed=seed, dtype=dtype,
                        backend=backend, out=(mean_out, cov_out))
        first = np.sqrt(np.clip(np.diagonal(result.cov[0]), 0, None)) if spec.n else None
        shapes = mean_out.shape, cov_out.shape
        mean_out.flush()
        cov_out.flush()
        del mean_out, cov_out, result  # closed before the rename
        for key in ("mean", "cov"):
            partial[key].replace(final[key])
    finally:
        for path in partial.values():
            path.unlink(missing_ok=True)
    click.echo(f"{method}: wrote {final['mean']} {shapes[0]} and {final['cov']} {shapes[1]}")
    if first is not None:
        click.echo(f"instance 0: output std {np.array2string(first, precision=4)}")


@click.command()
@click.argument("model", metavar="[MODEL]", required=False)
@_common
@click.option("--jacobians", metavar="FILE.npy", help="Precomputed Jacobians (N, *out, *unknown) "
              "instead of MODEL; --inputs are then the unknowns' values.")
@click.option("--outputs", metavar="FILE.npy", help="With --jacobians: the model's outputs "
              "(for elasticities).")
@click.option("--input-names", metavar="NAMES", help="Names of the unknowns: a,b,c or @file.")
@click.option("--output-names", metavar="NAMES", help="Names of the outputs: a,b,c or @file.")
@click.option("--by", type=click.Choice(["mean_abs", "elasticity", "scaled"]), default="mean_abs",
              show_default=True, help="Measure that ranks the inputs.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Inputs listed per output.")
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True,
              help="Directory for report.md and its PNG charts.")
def report(model: str | None, inputs: tuple[str, ...], known: str | None, wrt: str | None,
           wrt_input: int | None, backend: str | None, dtype: str | None, trust_model: bool,
           jacobians: str | None, outputs: str | None, input_names: str | None,
           output_names: str | None, by: str, top: int, output: str) -> None:
    """Sensitivity report: heatmap, per-output bar charts and report.md.

    From MODEL and --inputs (the Jacobians are computed), or from --jacobians FILE.npy.
    """
    import numpy as np

    from ._jacobian import jacobian
    from ._report import write_report
    from ._sensitivity import sensitivity
    from ._validate import normalize

    if (model is None) == (jacobians is None):
        raise UserError("Give either MODEL (the Jacobians are computed) or --jacobians FILE.npy.")
    if jacobians is not None:
        jac = load_array(jacobians, "--jacobians")
        x = load_array(inputs[0], "--inputs") if inputs else None
        if len(inputs) > 1 or known is not None or wrt is not None:
            raise UserError("With --jacobians, --inputs is one file of the unknowns' values "
                            "(no --known or --wrt).")
        y = load_array(outputs, "--outputs") if outputs is not None else None
    else:
        assert model is not None
        if outputs is not None:
            raise UserError("--outputs goes with --jacobians; with MODEL the outputs are computed.")
        fn = load_model(model, trust=trust_model)
        args, wrt_arg = gather_inputs(inputs, known, wrt, wrt_input)
        y, jac = _guard(jacobian, fn, *args, wrt=wrt_arg, dtype=dtype, backend=backend,
                        return_outputs=True)
        spec = _guard(normalize, args, wrt=wrt_arg, dtype=dtype, nan_policy="raise")
        x = spec.chunk(0, spec.n)[0]
    sens = _guard(sensitivity, jac, None if x is None else np.asarray(x),
                  None if y is None else np.asarray(y), input_names=parse_names(input_names),
                  output_names=parse_names(output_names), by=by)
    path = _guard(write_report, sens, output, top=top)
    click.echo(str(sens))
    click.echo(f"wrote {path}")


COMMANDS = [check, propagate, report]
