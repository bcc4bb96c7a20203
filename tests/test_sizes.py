"""The code stays readable in pieces: no module of runtime/ or moesys_cli/ over 500 lines, no function over 80 (a
longer one is split along its ideas, not granted an exception)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "moesys_cli")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT), path.read_text()


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Each function or method of `source` longer than `limit` lines (def line to last line, docstring included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{node.name} (line {node.lineno}): {lines} lines")
    return found


def test_no_module_is_over_500_lines():
    long = [f"{path}: {len(text.splitlines())} lines" for path, text in _modules()
            if len(text.splitlines()) > MAX_FILE_LINES]
    assert not long, "split these modules along their ideas:\n" + "\n".join(long)


def test_no_function_is_over_80_lines():
    long = [f"{path}: {f}" for path, text in _modules() for f in long_functions(text)]
    assert not long, "split these functions:\n" + "\n".join(long)


def test_the_function_check_sees_methods_and_nested_functions():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    source = f"class A:\n    def m(self):\n{body.replace('    ', '        ')}\n\n" \
             f"def outer():\n    def inner():\n{body.replace('    ', '        ')}\n"
    assert sorted(f.split(" ")[0] for f in long_functions(source)) == ["inner", "m", "outer"]
    assert long_functions("def short():\n" + "\n".join(f"    x{i} = {i}" for i in range(79))) == []
