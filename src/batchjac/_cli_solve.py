"""``batchjac solve``: find the unknowns for every row of a targets file.

Heavy imports (numpy's friends, frameworks, the solver) happen inside the command, so
``batchjac --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


def load_model(ref: str) -> Any:
    """MODEL as ``batchjac compute`` takes it (:func:`batchjac._loaders.load_model`), e.g.
    ``file.py:model`` or ``batchjac.examples:seed_model()`` (``()`` calls a factory)."""
    from ._errors import InputError
    from ._loaders import load_model as load

    if ":" not in ref and not Path(ref).exists():
        raise InputError(f"MODEL must be 'module:attribute' or 'file.py:attribute', or a model file; "
                         f"got {ref!r}.")
    return load(ref, trust=True).model


def _array(value: str | None, what: str) -> Any:
    """A number, or an ``.npy`` file (memory-mapped)."""
    if value is None:
        return None
    import numpy as np

    from ._errors import InputError

    try:
        return float(value)
    except ValueError:
        pass
    if not value.endswith(".npy"):
        raise InputError(f"{what}: give a number or an .npy file; got {value!r}. (Other formats "
                         f"and streaming come with the shared readers of `batchjac compute`.)")
    try:
        return np.load(value, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise InputError(f"{what}: cannot read {value!r}: {e}") from e


@click.command()
@click.argument("model")
@click.option("--targets", required=True, help="Observed outputs, (N, *output_shape), .npy.")
@click.option("-k", "--known", help="Known inputs, (N, h), .npy; the model takes concat([x, known]).")
@click.option("--x0", help="Starting points, (N, k) or (k,), .npy.")
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False),
              help="Directory for the results (.npy files and summary.json).")
@click.option("--lower", help="Lower bounds: a number or an .npy file ((k,) or (N, k)).")
@click.option("--upper", help="Upper bounds: a number or an .npy file ((k,) or (N, k)).")
@click.option("--method", type=click.Choice(["lm", "gn"]), default="lm", show_default=True,
              help="Levenberg-Marquardt or Gauss-Newton with a line search.")
@click.option("--max-iter", type=click.IntRange(min=0), default=100, show_default=True)
@click.option("--xtol", type=float, help="Default: 1e-8 in float64, 1e-6 in float32.")
@click.option("--ftol", type=float)
@click.option("--gtol", type=float)
@click.option("--weights", help="Per-output weights: a number or .npy (output shape or (N, ...)).")
@click.option("--sigma", help="Per-output standard deviations instead of weights.")
@click.option("--n-starts", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seed", type=int, help="Seed of the random starts.")
@click.option("--n-unknowns", type=click.IntRange(min=1),
              help="k, when neither --x0 nor bound files give it.")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), help="Compute dtype.")
@click.option("--backend", type=click.Choice(["tensorflow", "torch", "jax"]))
@click.option("--covariance", is_flag=True, help="Also write covariance.npy, (N, k, k).")
@click.option("--jacobian", is_flag=True, help="Also write jacobian.npy at the solutions.")
@click.option("--overwrite", is_flag=True, help="Replace existing result files in OUT.")
def solve(model: str, targets: str, known: str | None, x0: str | None, out: str, lower: str | None,
          upper: str | None, method: str, max_iter: int, xtol: float | None, ftol: float | None,
          gtol: float | None, weights: str | None, sigma: str | None, n_starts: int,
          seed: int | None, n_unknowns: int | None, dtype: str | None, backend: str | None,
          covariance: bool, jacobian: bool, overwrite: bool) -> None:
    """Solve MODEL(concat([x, known])) = targets for the unknowns x, row by row.

    MODEL is 'module:attr' or 'file.py:attr' (append '()' to call a factory). Writes x.npy,
    residual.npy, cost.npy, success.npy, status.npy, iterations.npy, rank.npy and start.npy to
    OUT, and summary.json with the status counts and codes.
    """
    import json
    import time
    from pathlib import Path

    import numpy as np

    from ._errors import BatchJacError
    from ._solve import Status, solve as run_solve

    try:
        out_dir = Path(out)
        names = ["x", "residual", "cost", "success", "status", "iterations", "rank", "start"]
        names += ["covariance"] * covariance + ["jacobian"] * jacobian
        clash = [n for n in [*names, "summary"] if (out_dir / f"{n}.npy").exists()
                 or (n == "summary" and (out_dir / "summary.json").exists())]
        if clash and not overwrite:
            raise click.ClickException(f"{out_dir} already holds results ({', '.join(clash)}); "
                                       f"pass --overwrite or choose another --out.")
        fitted = load_model(model)
        t_arr = _array(targets, "--targets")
        if isinstance(t_arr, float):
            raise click.ClickException("--targets must be an .npy file with one row per instance.")
        lo, hi = _array(lower, "--lower"), _array(upper, "--upper")
        start = time.perf_counter()
        res = run_solve(
            fitted, t_arr, _array(known, "--known"), x0=_array(x0, "--x0"),
            bounds=None if lo is None and hi is None else (lo, hi), method=method,  # type: ignore[arg-type]
            max_iter=max_iter, xtol=xtol, ftol=ftol, gtol=gtol, weights=_array(weights, "--weights"),
            sigma=_array(sigma, "--sigma"), n_starts=n_starts, seed=seed, n_unknowns=n_unknowns,
            dtype=dtype, backend=backend, return_covariance=covariance,  # type: ignore[arg-type]
            return_jacobian=jacobian)
        seconds = time.perf_counter() - start
    except BatchJacError as e:
        raise click.ClickException(str(e)) from None

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        np.save(out_dir / f"{name}.npy", getattr(res, name))
    summary = {
        "instances": len(res.x), "succeeded": int(res.success.sum()), "status_counts": res.summary(),
        "status_codes": {s.name.lower(): int(s.value) for s in Status},
        "seconds": seconds, "model": model, "targets": targets, "known": known,
        "options": {k: v for k, v in res.info.items() if k not in ("seconds",)},
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    counts = ", ".join(f"{k} {v}" for k, v in res.summary().items())
    click.echo(f"batchjac solve: {int(res.success.sum())}/{len(res.x)} instances converged "
               f"({counts}) in {seconds:.2f} s; results in {out_dir}/", err=True)


COMMANDS = [solve]
