"""``batchjac propagate``: per-instance output mean and covariance of MODEL given uncertain
inputs, written chunk by chunk into memory-mapped ``mean.npy`` and ``cov.npy``.

The results are written under temporary names and renamed at the end: a failed or interrupted
run never leaves half-filled files behind, nor replaces those of an earlier run. An existing
``mean.npy`` or ``cov.npy`` is kept unless ``--overwrite`` (nothing records which run wrote
them: the rule of a file beside a ``compute`` output, exit 6), and one of the command's own
inputs is never replaced, even with ``--overwrite``. Exit codes as every subcommand
(:mod:`batchjac.cli.errors`); a failure to write the results is 7.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .common import (
    Files,
    backend_of,
    gather_inputs,
    load_model,
    refuse_existing,
    require_file,
    resolve_output,
    writing_output,
)
from .errors import guard
from .options import (
    CONTEXT,
    input_options,
    max_memory_option,
    model_argument,
    model_options,
    output_options,
    overwrite_option,
    parse_numbers,
)

if TYPE_CHECKING:
    from .._propagate import Method

#: (N, output shape, m): the shapes of mean.npy (N, *output shape) and cov.npy (N, m, m)
Shapes = tuple[int, tuple[int, ...], int]


@click.command("propagate", context_settings=CONTEXT)
@model_argument()
@input_options(several=True)
@model_options
@click.option("--cov", metavar="FILE", help="Covariance of the unknowns: (k, k) or (N, k, k).")
@click.option("--std", metavar="STD", help="Standard deviations: a number, a comma list (k "
              "values) or a file with (k,) or (N, k).")
@click.option("--method", type=click.Choice(["linear", "unscented", "monte_carlo"]),
              default="linear", show_default=True)
@click.option("--samples", type=click.IntRange(min=2), default=10_000, show_default=True,
              help="Samples per instance for monte_carlo.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of monte_carlo.")
@max_memory_option
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True,
              help="Directory for mean.npy (N, *output_shape) and cov.npy (N, m, m).")
@overwrite_option
@output_options
@guard("propagate", interrupted="earlier results are kept, nothing half-written: run the same "
                                "command again.")
def propagate(model: str, inputs: tuple[str, ...], known: str | None, wrt: str | None,
              wrt_input: int | None, backend: str | None, dtype: str | None, trust_model: bool,
              cov: str | None, std: str | None, method: Method, samples: int, seed: int,
              max_memory: str | None, output: str, overwrite: bool) -> None:
    """Propagate input uncertainty through MODEL: per-instance output mean and covariance.

    --inputs holds the unknowns' means. The results are written chunk by chunk into
    memory-mapped .npy files, so they may be larger than memory.
    """
    from .._propagate import propagate as run_propagate

    if (cov is None) == (std is None):
        raise click.UsageError("Give the input uncertainty as exactly one of `cov` (--cov FILE) and "
                               "`std` (--std STD); got " + ("both." if cov is not None else "neither."))
    directory = Path(output)
    final, partial = _paths(directory)
    resolve_output("--output", output, replaces=[*final, *partial])
    _refuse_directories(final)
    refuse_existing(final, option="--output directory", overwrite=overwrite)
    with Files() as files:
        args, columns = gather_inputs(files, inputs, known=known, wrt=wrt, wrt_input=wrt_input)
        uncertainty = {"cov": None if cov is None else files.array(cov, "--cov"),
                       "std": _std(files, std)}
        loaded = load_model(model, trust=trust_model)
        framework = backend_of(backend, loaded)
        shapes = _shapes(loaded.model, args, columns, dtype=dtype, backend=framework)
        mean_in, known_in = (args[0], args[1]) if len(args) == 2 else (args[0], None)

        def run(out: tuple[Any, Any]) -> None:
            run_propagate(loaded.model, mean_in, known_in, method=method, wrt=columns,
                          n_samples=samples, seed=seed, dtype=dtype, backend=framework,
                          max_memory=max_memory, out=out, **uncertainty)

        paths, first = _write(directory, shapes, run)
    n, out_shape, m = shapes
    click.echo(f"{method}: wrote {paths[0]} {(n, *out_shape)} and {paths[1]} {(n, m, m)}")
    if first is not None:
        import numpy as np

        click.echo(f"instance 0: output std {np.array2string(first, precision=4)}")


def _std(files: Files, text: str | None) -> Any:
    """--std: None, a number, a comma list, or a file (memory-mapped when it is a .npy)."""
    if text is None:
        return None
    import numpy as np

    numbers = parse_numbers(text)
    if numbers is not None:
        return numbers[0] if len(numbers) == 1 else np.array(numbers)
    require_file(text, "--std", "a number, a comma list (k values)")
    return files.array(text, "--std")


def _shapes(model: Any, args: tuple[Any, ...], columns: Any, *, dtype: str | None,
            backend: str | None) -> Shapes:
    """The result shapes, from the model's output shape on these inputs."""
    from .._evaluate import bind, output_size
    from .._validate import normalize

    spec = normalize(args, wrt=columns, dtype=dtype, nan_policy="raise")
    _, bound = bind(model, spec, backend, None)
    assert bound.output_shape is not None
    return spec.n, tuple(bound.output_shape), output_size(bound)


def _paths(directory: Path) -> tuple[tuple[Path, Path], tuple[Path, Path]]:
    """The results' paths in ``directory`` (mean.npy, cov.npy), and their temporary names."""
    final = (directory / "mean.npy", directory / "cov.npy")
    return final, (final[0].with_name(".mean.npy.partial"), final[1].with_name(".cov.npy.partial"))


def _refuse_directories(final: Sequence[Path]) -> None:
    """A directory where a result goes is never replaced, even with --overwrite (the rename at
    the end would fail, after the whole computation)."""
    from .._stores import StoreExistsError

    for path in final:
        if path.is_dir() and not path.is_symlink():
            raise StoreExistsError(f"{str(path)!r} is a directory, where propagate writes the file "
                                   f"{path.name}; batchjac never replaces a directory it did not "
                                   f"make. Remove it yourself, or choose another --output.")


def _write(directory: Path, shapes: Shapes, run: Callable[[tuple[Any, Any]], None]
           ) -> tuple[tuple[Path, Path], Any]:
    """``run((mean_out, cov_out))`` into memory maps under temporary names, renamed to
    mean.npy and cov.npy when it returns; the paths, and instance 0's output std (None if N=0).
    The temporaries are created new (``O_EXCL``), not through a link planted under their names."""
    import os

    import numpy as np

    from .._stores.durable import create_new

    n, out_shape, m = shapes
    final, partial = _paths(directory)
    try:
        with writing_output(f"-o {str(directory)!r}"):
            directory.mkdir(parents=True, exist_ok=True)
            for path in partial:  # a stale file or a planted link removed, the file made anew
                os.close(create_new(path))
            mean_out = np.lib.format.open_memmap(partial[0], mode="w+", dtype=np.float64,
                                                 shape=(n, *out_shape))
            cov_out = np.lib.format.open_memmap(partial[1], mode="w+", dtype=np.float64,
                                                shape=(n, m, m))
        run((mean_out, cov_out))
        first = np.sqrt(np.clip(np.diagonal(cov_out[0]), 0, None)) if n else None
        with writing_output(f"-o {str(directory)!r}"):
            mean_out.flush()
            cov_out.flush()
            del mean_out, cov_out  # closed before the rename
            for part, path in zip(partial, final):
                part.replace(path)
    finally:
        for part in partial:
            part.unlink(missing_ok=True)
    return final, first


command = propagate
