"""docs/thresholds.md is the one table of batchjac's measured thresholds: every row names a
threshold the code has, with the value the code has, and says where it was measured; every
upper-case number of the tuning modules is a row; and no comment or docstring outside
``_bench`` quotes a workload's timing (the comments point to the table instead)."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import operator
import re
import tokenize
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "batchjac"
TABLE = ROOT / "docs" / "thresholds.md"
HEADER = "| name | value | decides | where measured |"

#: files that still quote workload timings while they are being rewritten (issue 34). The list
#: must shrink to empty: a file leaves it once its figures are in docs/thresholds.md and its
#: comments point there, and the test fails for a file listed here that no longer quotes any
PENDING: set[str] = set()

#: a workload (W1-W9, W7H) and a figure of time or speed: a duration, a ratio ("0.8x",
#: "1.10x native"), a percentage
WORKLOAD = re.compile(r"\bW[1-9]H?\b")
FIGURE = re.compile(r"\d\s*(ms|s|us|µs|ns)\b|\b\d+(\.\d+)?x\b|x native|\d\s*%")

#: the modules whose upper-case numbers are thresholds: each of those is a row of the table
TUNING = ("_plan.py", "_chain.py", "_products.py", "_estimators.py", "_bind.py", "_config.py",
          "_probes.py", "_runner.py", "_sinks.py",
          "_tune/*.py", "_backends/_base.py", "_backends/*/builds.py", "_backends/*/second.py",
          "_backends/jax/executables.py")
#: modules under those patterns whose numbers are not speed or memory decisions: the tuning
#: cache's file format and its security limits (a version, a key length, the largest file read)
NOT_TUNING = ("_tune/cache.py", "_tune/files.py")

FRAMEWORKS = {"jax", "jaxlib", "torch", "tensorflow", "keras"}
_OPERATORS = {ast.LShift: operator.lshift, ast.Mult: operator.mul, ast.Pow: operator.pow,
              ast.Add: operator.add, ast.Sub: operator.sub, ast.Div: operator.truediv}


def _rows() -> list[tuple[str, str, str, str]]:
    lines = TABLE.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"a row of docs/thresholds.md has {len(cells)} cells: {line}"
        rows.append((cells[0].strip("`"), cells[1].strip("`"), cells[2], cells[3]))
    return rows


ROWS = _rows()


def _literal(text: str) -> Any:
    """The value of a number written as the code writes it (``64 << 20``, ``4e7``, ``(128,)``,
    ``True``): numbers, tuples and arithmetic only."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
            return node.value
        if isinstance(node, ast.Tuple):
            return tuple(value(e) for e in node.elts)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not a plain number: {text!r}")
    return value(ast.parse(text, mode="eval").body)


def _resolve(name: str) -> Any:
    """The code's value of ``name``: ``module.NAME``, ``module.Class.NAME`` or, for a default
    argument, ``module.function(parameter=)``."""
    default = re.fullmatch(r"(.+)\((\w+)=\)", name)
    parts = (default.group(1) if default else name).split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue  # a class or an attribute, not a module: look further left
            if e.name in FRAMEWORKS:
                pytest.skip(f"{name}: {e.name} is not installed")
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        if default:
            return inspect.signature(obj).parameters[default.group(2)].default
        return obj
    raise AssertionError(f"{name} names no module")


def test_the_table_has_rows_and_unique_names() -> None:
    names = [row[0] for row in ROWS]
    assert len(names) > 50
    assert len(set(names)) == len(names), "a threshold is listed twice"
    for name in names:
        assert re.fullmatch(r"batchjac(\.\w+)+(\(\w+=\))?", name), name


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_row_matches_the_code_and_names_its_measurement(row: tuple[str, str, str, str]) -> None:
    name, value, decides, measured = row
    assert decides, f"{name}: say what it decides"
    assert measured, f"{name}: say where it was measured, or 'Not measured'"
    try:
        code = _resolve(name)
    except AttributeError as e:
        pytest.fail(f"docs/thresholds.md lists {name}, which the code no longer has ({e}): "
                    f"update or remove its row")
    table = _literal(value)
    same = code is table if isinstance(code, bool) or isinstance(table, bool) else code == table
    assert same, (f"{name} is {code!r} in the code but {value} in docs/thresholds.md: update "
                  f"the row, with the measurement behind the new value")


def _constants(path: Path) -> set[str]:
    """The public upper-case names that the module or class bodies of ``path`` bind to numbers
    (or to another such name)."""
    module = "batchjac." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    module = module.removesuffix(".__init__")
    found = set()

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}.{node.name}")
                continue
            pairs: list[tuple[ast.expr, ast.expr | None]] = []
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += list(zip(target.elts, node.value.elts))
                    else:
                        pairs.append((target, node.value))
            elif isinstance(node, ast.AnnAssign):
                pairs.append((node.target, node.value))
            for target, value in pairs:
                if not isinstance(target, ast.Name) or value is None or \
                        not re.fullmatch(r"[A-Z][A-Z0-9_]*", target.id):
                    continue
                try:
                    number = _literal(ast.unparse(value))
                except (ValueError, SyntaxError):
                    if isinstance(value, ast.Attribute) and _is_number(f"{prefix}.{target.id}"):
                        found.add(f"{prefix}.{target.id}")  # another's value (chooser.MARGIN)
                    continue
                if not isinstance(number, bool):
                    found.add(f"{prefix}.{target.id}")

    visit(ast.parse(path.read_text(encoding="utf-8")).body, module)
    return found


def _is_number(name: str) -> bool:
    try:
        value = _resolve(name)
    except pytest.skip.Exception:  # (its framework is not installed)
        return False
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_every_number_of_the_tuning_modules_is_in_the_table() -> None:
    names: set[str] = set()
    for pattern in TUNING:
        for path in PACKAGE.glob(pattern):
            if path.relative_to(PACKAGE).as_posix() not in NOT_TUNING:
                names |= _constants(path)
    assert len(names) > 40
    missing = sorted(names - {row[0] for row in ROWS})
    assert not missing, (f"thresholds missing from docs/thresholds.md (add a row: the value, "
                         f"what it decides, where it was measured or 'Not measured'): {missing}")


def _quotes(path: Path) -> list[tuple[int, str]]:
    """Lines of the comments and docstrings of ``path`` that name a workload beside a figure of
    time or speed, on the line or with the next line of comment or docstring (a sentence a
    line's end breaks): a sentence approximated line by line."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    texts: dict[int, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for number in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                texts[number] = lines[number - 1]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            texts[token.start[0]] = token.string
    found = []
    for number, text in sorted(texts.items()):
        after = texts.get(number + 1, "")
        workload, figure = WORKLOAD.search(text), FIGURE.search(text)
        if (workload and figure) or (workload and FIGURE.search(after)) or \
                (figure and WORKLOAD.search(after)):
            found.append((number, text.strip()))
    return found


def test_no_comment_quotes_a_workload_timing() -> None:
    quoting = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if "_bench" not in path.relative_to(PACKAGE).parts and (lines := _quotes(path)):
            quoting[name] = lines
    new = {name: lines for name, lines in quoting.items() if name not in PENDING}
    assert not new, ("comments or docstrings quote workload timings: keep the reason, move the "
                     "figures to docs/thresholds.md and point there\n" + "\n".join(
                         f"  src/batchjac/{name}:{number}: {text}"
                         for name, lines in new.items() for number, text in lines))
    stale = sorted(PENDING - set(quoting))
    assert not stale, f"quote no timings any more: remove them from PENDING here: {stale}"


SAMPLE = '''"""W1 takes 80 ms
here."""
# W4 ran
# 0.88 against 0.48 s
# W2: 1.10x native
x = 1  # W3 has 4 outputs

# the quick build (W7H
# 30% slower)
y = "W2 300 ms"  # (a string in code, not a docstring)
'''


def test_the_quote_finder_finds_quotes(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(SAMPLE, encoding="utf-8")
    assert [number for number, _ in _quotes(sample)] == [1, 3, 4, 5, 8]
