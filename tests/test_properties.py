"""Property-based tests (hypothesis) where inputs have structure: ``wrt`` normalisation, the
CLI's column selections, chunk bounds and padding, byte sizes. Each property is checked
against an independent statement of what it must be (a numpy selection, a sum of parts,
an arithmetic formula), over inputs hypothesis draws and shrinks."""

from __future__ import annotations

import math

import click
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import batchjac
from batchjac._config import _UNITS, parse_bytes
from batchjac._runner import chunk_bounds, chunks, pad
from batchjac._validate import _columns, normalize
from batchjac.cli.options import parse_wrt

FAST = settings(max_examples=60, deadline=None)


# -- wrt normalisation ---------------------------------------------------------------------------
@st.composite
def selections(draw: st.DrawFn) -> tuple[int, list[int]]:
    width = draw(st.integers(1, 12))
    cols = draw(st.lists(st.integers(0, width - 1), min_size=1, max_size=width, unique=True))
    # each column as given, or as its negative index from the end
    signed = [c - width if draw(st.booleans()) else c for c in cols]
    return width, signed


@FAST
@given(selections())
def test_wrt_indices_normalise_to_the_columns_numpy_selects(sel: tuple[int, list[int]]) -> None:
    width, signed = sel
    expect = tuple(np.arange(width)[signed])
    got = _columns(signed, width, "x")
    assert got == (None if expect == tuple(range(width)) else expect)
    # a boolean mask selects the same columns, in column order
    mask = np.zeros(width, bool)
    mask[signed] = True
    by_mask = _columns(mask, width, "x")
    ordered = tuple(sorted(expect))
    assert by_mask == (None if ordered == tuple(range(width)) else ordered)


@FAST
@given(st.integers(1, 12), st.integers(-14, 14), st.integers(-14, 14), st.sampled_from([None, 1, 2, -1, 3]))
def test_wrt_slices_select_what_the_slice_selects(width: int, start: int, stop: int,
                                                  step: int | None) -> None:
    s = slice(start, stop, step)
    expect = tuple(range(width)[s])
    if not expect:
        with pytest.raises(batchjac.InputError, match=r"selects no column of `x`, which has"):
            _columns(s, width, "x")
        return
    assert _columns(s, width, "x") == (None if expect == tuple(range(width)) else expect)


@FAST
@given(st.integers(1, 10), st.data())
def test_out_of_range_and_repeated_columns_are_refused(width: int, data: st.DataObject) -> None:
    col = data.draw(st.one_of(st.integers(width, width + 20), st.integers(-width - 20, -width - 1)))
    with pytest.raises(batchjac.InputError, match=rf"`wrt` column {col} is out of range: `x` has {width}"):
        _columns([col], width, "x")
    c = data.draw(st.integers(0, width - 1))
    with pytest.raises(batchjac.InputError, match=rf"names column\(s\) \[{c}\] more than once"):
        _columns([c, c - width], width, "x")


@settings(max_examples=25, deadline=None)
@given(selections(), st.integers(1, 6))
def test_normalised_spec_puts_the_selected_columns_first(sel: tuple[int, list[int]], n: int) -> None:
    """The batch spec's unknowns are exactly x[:, wrt] (in the order given), the known part the
    rest: assembled back, the rows are the input's."""
    width, signed = sel
    x = np.random.default_rng(width * 100 + n).normal(size=(n, width)).astype(np.float32)
    spec = normalize((x,), wrt=signed, dtype=None, nan_policy="raise")
    u, _ctx = spec.chunk(0, n)
    np.testing.assert_array_equal(u, x[:, signed])


# -- the CLI's --wrt ------------------------------------------------------------------------------
@st.composite
def wrt_texts(draw: st.DrawFn) -> tuple[str, list[int | str]]:
    """A --wrt text and the columns it means, built item by item."""
    parts, expect = [], []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["index", "range", "inclusive", "name"]))
        a = draw(st.integers(0, 30))
        b = draw(st.integers(0, 30))
        if kind == "index":
            parts.append(str(a))
            expect.append(a)
        elif kind == "range":
            start = draw(st.sampled_from(["", str(a)]))
            parts.append(f"{start}:{b}")
            expect.extend(range(int(start or 0), b))
        elif kind == "inclusive":
            parts.append(f"{a}-{b}")
            expect.extend(range(a, b + 1))
        else:
            name = "c" + draw(st.text(alphabet="ab_019-:", max_size=5))  # never all digits
            parts.append(name)
            expect.append(name)
    spaces = draw(st.sampled_from([",", ", ", " ,"]))
    return spaces.join(parts), expect


@FAST
@given(wrt_texts())
def test_cli_wrt_text_means_its_items_in_order(case: tuple[str, list[int | str]]) -> None:
    text, expect = case
    assert parse_wrt(text) == expect


@FAST
@given(wrt_texts(), st.sampled_from([",,", ", ,", "", ","]))
def test_cli_wrt_with_an_empty_item_is_a_usage_error(case: tuple[str, list[int | str]], gap: str) -> None:
    text = case[0]
    bad = {",,": text + ",," + "1", ", ,": "1, ," + text, "": "", ",": text + ","}[gap]
    with pytest.raises(click.BadParameter, match="empty item in"):
        parse_wrt(bad)


# -- chunks and padding ---------------------------------------------------------------------------
@FAST
@given(st.integers(0, 5000), st.integers(1, 700))
def test_chunks_tile_the_rows_exactly_once(n: int, size: int) -> None:
    got = list(chunks(n, size))
    assert len(got) == math.ceil(n / size)
    covered = [r for c in got for r in range(c.lo, c.hi)]
    assert covered == list(range(n))  # every row once, in order
    assert [c.index for c in got] == list(range(len(got)))
    assert all(c.hi - c.lo == size for c in got[:-1])  # only the last may be short
    if got:
        assert 0 < got[-1].hi - got[-1].lo <= size
    # a resumed store's indices give the same bounds as the full pass
    some = got[::3]
    assert list(chunks(n, size, [c.index for c in some])) == some
    for c in got:
        assert chunk_bounds(c.index, size, n) == c


@FAST
@given(st.integers(1, 40), st.integers(0, 40), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_pad_repeats_the_last_row(rows: int, extra: int, width: int, seed: int) -> None:
    a = np.random.default_rng(seed).normal(size=(rows, width))
    padded = pad(a, rows + extra)
    assert padded.shape == (rows + extra, width)
    np.testing.assert_array_equal(padded[:rows], a)
    np.testing.assert_array_equal(padded[rows:], np.broadcast_to(a[-1], (extra, width)))
    if extra == 0:
        assert padded is a  # no copy when nothing is padded


# -- byte sizes ------------------------------------------------------------------------------------
UNITS = [u for u in _UNITS if u]


@FAST
@given(st.integers(1, 10**6), st.sampled_from(UNITS), st.sampled_from(["", " "]), st.booleans())
def test_parse_bytes_of_whole_sizes(count: int, unit: str, space: str, lower: bool) -> None:
    text = f"{count}{space}{unit.lower() if lower else unit}"
    assert parse_bytes(text) == count * _UNITS[unit]


@FAST
@given(st.decimals(min_value="0.001", max_value="9999", places=3), st.sampled_from(UNITS))
def test_parse_bytes_of_fractional_sizes(value: object, unit: str) -> None:
    text = f"{value}{unit}"
    expect = int(float(str(value)) * _UNITS[unit])
    if expect <= 0:
        with pytest.raises(batchjac.InputError, match="less than one byte"):
            parse_bytes(text)
    else:
        assert parse_bytes(text) == expect


@FAST
@given(st.one_of(st.integers(max_value=0), st.floats(max_value=0.0, allow_nan=False),
                 st.just(float("nan")), st.just(float("inf")),
                 st.text(alphabet="xyz!?-", min_size=1, max_size=5)))
def test_parse_bytes_refuses_non_sizes_naming_the_option(value: object) -> None:
    with pytest.raises(batchjac.InputError, match=r"`budget` must be a number of bytes or a string such as"):
        parse_bytes(value, name="budget")  # type: ignore[arg-type]
