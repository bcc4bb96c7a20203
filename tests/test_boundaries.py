"""runtime/ is the library the workers import: it never imports the CLI stack (Hydra, OmegaConf, Typer, rich)."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
FORBIDDEN = {"hydra", "omegaconf", "typer", "rich", "moesys_cli"}


def test_runtime_never_imports_the_cli_stack():
    offenders = []
    for path in RUNTIME.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(RUNTIME.parent)}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders
