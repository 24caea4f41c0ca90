"""The parsers of the CLI's shared options (:mod:`batchjac.cli.options`): ``--max-memory``
checked while the options are parsed, ``--wrt``'s usage errors, names (``a,b`` or ``@file``)
and numbers. Each against the values the text means, and each error by its whole message.
(``--wrt``'s columns are drawn by hypothesis in test_properties.py.)"""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from batchjac._errors import InputFileError
from batchjac.cli.options import max_memory_option, parse_names, parse_numbers, parse_wrt


@click.command()
@max_memory_option
def budget(max_memory: str | None) -> None:
    click.echo(f"budget={max_memory}")


@pytest.mark.parametrize("value", ["512MB", "2GB", "1000"])
def test_max_memory_option_passes_sizes_through(value: str) -> None:
    got = CliRunner().invoke(budget, ["--max-memory", value])
    assert got.exit_code == 0, got.output
    assert got.output == f"budget={value}\n"


@pytest.mark.parametrize("value", ["lots", "-5MB", "0"])
def test_max_memory_option_refuses_a_non_size_as_a_usage_error(value: str) -> None:
    got = CliRunner().invoke(budget, ["--max-memory", value])
    assert got.exit_code == 2
    # the option named once, by click, and parse_bytes' explanation after it
    assert ("Error: Invalid value for '--max-memory': must be a number of bytes or a string "
            "such as") in got.output
    assert "`--max-memory`" not in got.output
    assert "max_memory" not in got.output
    assert "budget=" not in got.output


@pytest.mark.parametrize("text", ["1,,2", "", "0:3,", " , 4"])
def test_wrt_with_an_empty_item_names_the_option(text: str) -> None:
    with pytest.raises(click.BadParameter) as got:
        parse_wrt(text)
    assert got.value.param_hint == "--wrt"
    assert got.value.format_message() == (
        f"Invalid value for --wrt: empty item in {text!r}; separate columns by commas.")


def test_names_from_text_or_a_file(tmp_path: Path) -> None:
    assert parse_names(None, option="--names") is None
    assert parse_names("a, b ,c", option="--names") == ["a", "b", "c"]
    assert parse_names("only", option="--names") == ["only"]
    listed = tmp_path / "names.txt"
    listed.write_text("alpha\n\n  beta \ngamma,delta\n")
    assert parse_names(f"@{listed}", option="--names") == ["alpha", "beta", "gamma,delta"]


def test_unreadable_names_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(InputFileError) as got:
        parse_names(f"@{missing}", option="--output-names")
    assert str(got.value) == (
        f"Cannot read the --output-names file {str(missing)!r} (No such file or directory); give a "
        f"readable file with one name per line, or a,b,c.")


def test_numbers_or_none_for_a_file_name() -> None:
    assert parse_numbers("0.25") == [0.25]
    assert parse_numbers("0.1, 2e-3,7") == [0.1, 2e-3, 7.0]
    assert parse_numbers("cov.npy") is None
    assert parse_numbers("0.1,x") is None
