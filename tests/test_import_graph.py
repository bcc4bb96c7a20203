"""The import graph of runtime/ and moesys_cli/ has no circle between files (module-level imports: what runs when a
module is imported), and runtime/'s root holds no module beside the packages but errors.py."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOT_MODULES = {"__init__.py", "errors.py"}
"""What may sit at runtime/'s root: every other module belongs in the package of its subject."""


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("runtime", "moesys_cli"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(source: str, known: set[str]) -> set[str]:
    """The modules of `known` that `source` imports at module level (`from a.b import c` names a.b.c when that is
    a module, else a.b)."""
    out = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                    for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out & known


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_files():
    modules = _modules()
    graph = {name: imports(path.read_text(), set(modules)) - {name} for name, path in modules.items()}
    assert circles(graph) == []


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert imports("from runtime.storage import optim\nimport runtime.errors\ndef f():\n    import runtime.model\n",
                   {"runtime.storage", "runtime.storage.optim", "runtime.errors", "runtime.model"}) == \
        {"runtime.storage.optim", "runtime.errors"}


def test_runtime_root_holds_only_packages_and_errors():
    loose = sorted(p.name for p in (ROOT / "runtime").glob("*.py") if p.name not in ROOT_MODULES)
    assert loose == [], f"move these into the package of their subject: {loose}"
