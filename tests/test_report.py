"""The sensitivity report: files, Markdown, and a heatmap PNG whose colours, read back from the
file, rank the inputs as the numbers do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchjac

matplotlib = pytest.importorskip("matplotlib")

from batchjac._report import _heatmap_figure, bar_chart  # noqa: E402

W = np.array([[3.0, 0.1, 1.0, -0.5], [0.2, -2.0, 0.05, 1.2], [0.7, 0.3, 1.5, 0.01]])
NAMES = ["temp", "pressure", "flow", "speed"]


def summary(seed: int = 0) -> batchjac.Sensitivity:
    rng = np.random.default_rng(seed)
    jac = W[None] * (1 + 0.05 * rng.normal(size=(300, 3, 4)))
    x = rng.normal(size=(300, 4)) + 2.0
    return batchjac.sensitivity(jac, x, x @ W.T + 1.0, input_names=NAMES,
                                output_names=["yield", "cost", "purity"])


def test_report_files_and_markdown(tmp_path: Path) -> None:
    path = batchjac.write_report(summary(), tmp_path / "rep", top=3)
    assert path == tmp_path / "rep" / "report.md"
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["report.md", "sensitivity_0_yield.png", "sensitivity_1_cost.png",
                     "sensitivity_2_purity.png", "sensitivity_heatmap.png"]
    for png in path.parent.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = path.read_text()
    assert "![Sensitivity heatmap](sensitivity_heatmap.png)" in text
    assert "![cost](sensitivity_1_cost.png)" in text
    assert "300 instances, 4 unknown input(s), 3 output(s)" in text
    cost = text[text.index("## cost"):text.index("## purity")]
    ranks = [line.split("|")[2].strip() for line in cost.splitlines() if line.startswith("| ")
             and line.split("|")[1].strip().isdigit()]
    assert ranks == ["pressure", "speed", "temp"]  # top=3, by mean |dy/dx|


def test_heatmap_png_shows_the_ranking_of_the_numbers(tmp_path: Path) -> None:
    """Read the cells' colours back from the saved PNG, invert the colour map, and compare
    the ranking they show with the ranking of the numbers."""
    from matplotlib import colormaps
    from matplotlib.image import imread

    sens = summary()
    fig, drawn = _heatmap_figure(sens)
    path = tmp_path / "heat.png"
    fig.savefig(path)
    img = imread(path)[:, :, :3]
    height = img.shape[0]
    ax = drawn["ax"]
    lut = colormaps["viridis"](np.linspace(0, 1, 256))[:, :3]
    shown = np.zeros(drawn["share"].shape)
    for i, j in np.ndindex(*shown.shape):
        # a point off the cell's centre, clear of the number written there
        px, py = ax.transData.transform((j - 0.4, i - 0.4))
        color = img[round(height - py), round(px)]
        shown[i, j] = np.argmin(((lut - color) ** 2).sum(axis=1)) / 255
    np.testing.assert_allclose(shown, drawn["share"], atol=0.02)
    np.testing.assert_array_equal(np.argsort(-shown, axis=1, kind="stable"), sens.order())
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == NAMES
    assert [t.get_text() for t in ax.get_yticklabels()] == ["yield", "cost", "purity"]


def test_heatmap_keeps_the_most_influential_inputs() -> None:
    jac = np.ones((20, 2, 80)) * np.random.default_rng(1).permutation(np.linspace(0.01, 1, 80))
    top10 = np.sort(np.argsort(-jac[0, 0])[:10])
    _, drawn = _heatmap_figure(batchjac.sensitivity(jac), max_inputs=10)
    assert drawn["cols"].tolist() == top10.tolist()


def test_bar_chart_and_other_measures(tmp_path: Path) -> None:
    sens = summary()
    out = bar_chart(sens, 1, tmp_path / "bars.png", by="elasticity")
    assert out.exists()
    path = batchjac.write_report(sens, tmp_path / "e", by="scaled", max_bar_charts=1)
    text = path.read_text()
    assert "standardised" in text
    assert "Bar charts are drawn for the first 1 of 3" in text
    assert len(list(path.parent.glob("*.png"))) == 2


def test_bad_arguments(tmp_path: Path) -> None:
    sens = batchjac.sensitivity(np.ones((4, 2, 3)))
    with pytest.raises(batchjac.InputError, match="needs the inputs x and outputs y"):
        batchjac.write_report(sens, tmp_path, by="elasticity")
    with pytest.raises(batchjac.InputError, match="`top` must be at least 1"):
        batchjac.write_report(sens, tmp_path, top=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(batchjac.InputError, match="is a file"):
        batchjac.write_report(sens, tmp_path / "file")
    assert not list(tmp_path.glob("*.png"))  # nothing written before the checks


def test_undefined_elasticities_are_reported(tmp_path: Path) -> None:
    jac = np.ones((4, 1, 2))
    y = np.array([[2.0], [0.0], [4.0], [3.0]])
    sens = batchjac.sensitivity(jac, np.ones((4, 2)), y)
    text = batchjac.write_report(sens, tmp_path).read_text()
    assert "1 instance(s) left out" in text


def test_missing_matplotlib_says_how_to_install(monkeypatch: Any, tmp_path: Path) -> None:
    import builtins

    real = builtins.__import__

    def fake(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(batchjac.BackendNotAvailableError, match=r"batchjac\[plot\]"):
        batchjac.write_report(batchjac.sensitivity(np.ones((4, 2, 3))), tmp_path)
