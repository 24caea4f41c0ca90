"""The sensitivity report: a PNG heatmap (outputs x inputs), one bar chart per output and a
short Markdown file that embeds them. Needs matplotlib (``pip install batchjac[plot]``); it is
used through its object API and the Agg canvas, so no GUI backend or global state is touched.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import BackendNotAvailableError, InputError
from ._sensitivity import _DESCRIBE, Measure, Sensitivity

#: cells annotated with their value when the heatmap has at most this many
_ANNOTATE_CELLS = 400


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise BackendNotAvailableError(
            f"The sensitivity report draws its charts with matplotlib: `pip install "
            f"batchjac[plot]` (import failed: {e})."
        ) from None
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:40] or "output"


def heatmap(sens: Sensitivity, path: str | Path, *, by: Measure | None = None,
            max_inputs: int = 60, max_outputs: int = 60) -> Path:
    """Outputs (rows) x inputs (columns). Colour: each value over its output's largest, so
    every row shows its own ranking; cells carry the values themselves when there is room.
    Inputs beyond ``max_inputs`` (the least influential overall) are left out."""
    fig, _ = _heatmap_figure(sens, by=by, max_inputs=max_inputs, max_outputs=max_outputs)
    path = Path(path)
    fig.savefig(path)
    return path


def _heatmap_figure(sens: Sensitivity, *, by: Measure | None = None, max_inputs: int = 60,
                    max_outputs: int = 60) -> tuple[Any, dict[str, Any]]:
    """The heatmap figure, and what it shows: ``share`` (the colours), ``values``, and the
    ``rows``/``cols`` (output and input indices) drawn."""
    by = by or sens.by  # type: ignore[assignment]
    values = sens.measure(by)
    m, k = values.shape
    rows = np.arange(min(m, max_outputs))
    with np.errstate(divide="ignore", invalid="ignore"):
        clean = np.where(np.isnan(values), 0.0, values)
        row_max = clean.max(axis=1, keepdims=True) if k else np.zeros((m, 1))
        share_all = np.where(row_max > 0, clean / row_max, 0.0)
    cols = np.sort(np.argsort(-share_all.sum(axis=0), kind="stable")[:max_inputs])
    v = values[np.ix_(rows, cols)]
    share = share_all[np.ix_(rows, cols)]
    fig = _figure(min(3.0 + 0.55 * len(cols), 22), min(2.2 + 0.4 * len(rows), 22))
    ax = fig.add_subplot()
    im = ax.imshow(share, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(cols)), [sens.input_names[j] for j in cols], rotation=45,
                  ha="right")
    ax.set_yticks(range(len(rows)), [sens.output_names[o] for o in rows])
    ax.set_xlabel("input")
    ax.set_ylabel("output")
    ax.set_title(f"Sensitivity: {_DESCRIBE[by or sens.by]}")
    fig.colorbar(im, ax=ax, label="share of the output's largest value")
    if share.size <= _ANNOTATE_CELLS:
        for (i, j), val in np.ndenumerate(v):
            ax.text(j, i, "n/a" if np.isnan(val) else f"{val:.3g}", ha="center", va="center",
                    fontsize=8, color="black" if share[i, j] > 0.6 else "white")
    return fig, {"ax": ax, "share": share, "values": v, "rows": rows, "cols": cols}


def bar_chart(sens: Sensitivity, output: int, path: str | Path, *, by: Measure | None = None,
              top: int = 15) -> Path:
    """The ``top`` inputs of one output, largest at the top."""
    ranked = sens.ranking(output, by)[:top]
    names = [n for n, _ in ranked][::-1]
    vals = [0.0 if np.isnan(v) else v for _, v in ranked][::-1]
    fig = _figure(6.0, 1.2 + 0.32 * len(names))
    ax = fig.add_subplot()
    ax.barh(range(len(names)), vals, color="#3b6ea8")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel(_DESCRIBE[by or sens.by])
    ax.set_title(f"{sens.output_names[output]}: inputs by influence")
    path = Path(path)
    fig.savefig(path)
    return path


def write_report(sens: Sensitivity, directory: str | Path, *, by: Measure | None = None,
                 top: int = 10, max_bar_charts: int = 20,
                 title: str = "batchjac sensitivity report") -> Path:
    """Write ``sensitivity_heatmap.png``, ``sensitivity_<output>.png`` (bar charts of the first
    ``max_bar_charts`` outputs) and ``report.md`` into ``directory``; return the Markdown path.

    >>> import numpy as np, batchjac, tempfile
    >>> jac = np.random.default_rng(0).normal(size=(50, 2, 3)) * [1.0, 10.0, 0.1]
    >>> s = batchjac.sensitivity(jac, input_names=["a", "b", "c"])
    >>> with tempfile.TemporaryDirectory() as d:
    ...     path = batchjac.write_report(s, d)
    ...     print(path.name, sorted(p.name for p in path.parent.glob("*.png")))
    report.md ['sensitivity_0_y0.png', 'sensitivity_1_y1.png', 'sensitivity_heatmap.png']
    """
    by = by or sens.by  # type: ignore[assignment]
    sens.measure(by)  # validates `by` before anything is written
    if top < 1:
        raise InputError(f"`top` must be at least 1; got {top!r}.")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise InputError(f"The report directory {str(out)!r} is a file; give a directory.")
    out.mkdir(parents=True, exist_ok=True)
    heat = heatmap(sens, out / "sensitivity_heatmap.png", by=by)
    m, k = len(sens.output_names), len(sens.input_names)
    lines = [
        f"# {title}", "",
        f"{sens.n} instances, {k} unknown input(s), {m} output(s). Inputs are ranked by "
        f"**{_DESCRIBE[by or sens.by]}**.",
        "",
        f"![Sensitivity heatmap]({heat.name})", "",
        "Each row of the heatmap is coloured relative to that output's most influential input; "
        "the numbers are the values themselves.", "",
    ]
    if sens.elasticity_undefined is not None and sens.elasticity_undefined.any():
        worst = int(np.argmax(sens.elasticity_undefined))
        lines += [f"Elasticities are undefined where an output is near 0: up to "
                  f"{int(sens.elasticity_undefined.max())} instance(s) left out "
                  f"(output {sens.output_names[worst]}).", ""]
    order = sens.order(by)
    for o, name in enumerate(sens.output_names):
        lines += [f"## {name}", ""]
        header = "| rank | input | mean abs dy/dx | mean dy/dx |"
        rule = "|---:|---|---:|---:|"
        if sens.elasticity is not None:
            header += " median elasticity |"
            rule += "---:|"
        if sens.scaled is not None:
            header += " standardised |"
            rule += "---:|"
        lines += [header, rule]
        for rank, j in enumerate(order[o][:top], start=1):
            row = (f"| {rank} | {sens.input_names[j]} | {sens.mean_abs[o, j]:.4g} | "
                   f"{sens.mean[o, j]:.4g} |")
            if sens.elasticity is not None:
                row += f" {sens.elasticity[o, j]:.4g} |"
            if sens.scaled is not None:
                row += f" {sens.scaled[o, j]:.4g} |"
            lines.append(row)
        lines.append("")
        if o < max_bar_charts:
            bars = bar_chart(sens, o, out / f"sensitivity_{o}_{_slug(name)}.png", by=by,
                             top=max(top, 15))
            lines += [f"![{name}]({bars.name})", ""]
    if m > max_bar_charts:
        lines += [f"Bar charts are drawn for the first {max_bar_charts} of {m} outputs.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
