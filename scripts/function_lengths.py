"""Lines of every function (methods and nested functions too) of the given Python files, docstrings
excluded, longest first (``--top=N`` of them, 15 by default):
``python scripts/function_lengths.py src/batchjac/_stores/*.py``."""

from __future__ import annotations

import ast
import sys


def lengths(path: str) -> list[tuple[int, str]]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            size = node.end_lineno - first + 1
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                assert body[0].end_lineno is not None
                size -= body[0].end_lineno - body[0].lineno + 1
            found.append((size, f"{path}:{node.lineno} {node.name}"))
    return found


def main() -> None:
    paths = [a for a in sys.argv[1:] if not a.startswith("--top=")]
    top = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--top=")), 15))
    for size, where in sorted((row for path in paths for row in lengths(path)), reverse=True)[:top]:
        print(f"{size:4d}  {where}")


if __name__ == "__main__":
    main()
