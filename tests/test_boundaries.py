"""runtime/ is the library the workers import: it never imports the CLI stack (Hydra, OmegaConf, Typer, rich) and never
runs the CLI (`moesys ...`, `python -m moesys_cli`) as a subprocess; torchrun is started only by the job API
(runtime/launch/), so every training job is planned once and has its plan.json."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
FORBIDDEN = {"hydra", "omegaconf", "typer", "rich", "moesys_cli"}
CLI_COMMAND = "moesys"
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
"""What starts a torchrun job: only runtime/launch/ may name these in code."""


def _runtime_modules():
    for path in sorted(RUNTIME.rglob("*.py")):
        yield path.relative_to(RUNTIME.parent), ast.parse(path.read_text())


def _code_strings(tree: ast.AST):
    """The string constants of a module's code: not its docstrings (or attribute docstrings), which describe."""
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose]


PROCESS_CALLS = {"run", "Popen", "popen", "call", "check_call", "check_output", "system", "getoutput",
                 "getstatusoutput", "create_subprocess_exec", "create_subprocess_shell", "execv", "execvp", "execvpe",
                 "execl", "execlp", "spawnv", "spawnl"}
"""Calls that start a process from an argv or a command line."""


def _first_word(node: ast.AST) -> str | None:
    """The literal a list, command line or f-string starts with, else None."""
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
        return _first_word(node.elts[0])
    if isinstance(node, ast.JoinedStr) and node.values:
        return _first_word(node.values[0])
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _called(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def cli_runs(tree: ast.AST) -> list[str]:
    """Where a module runs the CLI: `moesys_cli` named in code (`python -m moesys_cli`, a runpy of it), an argv list
    starting with `moesys`, a process started from an argv or command line that starts with it, or a lookup of the
    `moesys` program (shutil.which, a path beside the interpreter)."""
    found = [f"line {s.lineno}: {s.value!r}" for s in _code_strings(tree) if "moesys_cli" in s.value]
    for node in ast.walk(tree):
        if isinstance(node, ast.List) and _first_word(node) == CLI_COMMAND:
            found.append(f"line {node.lineno}: an argv starting with {CLI_COMMAND!r}")
        if not isinstance(node, ast.Call):
            continue
        first = [(_first_word(a) or "").split(" ")[0] for a in node.args]
        if _called(node) in PROCESS_CALLS and CLI_COMMAND in first:
            found.append(f"line {node.lineno}: {_called(node)}() of a {CLI_COMMAND} command")
        if _called(node) in ("which", "with_name", "joinpath") and CLI_COMMAND in first:
            found.append(f"line {node.lineno}: {_called(node)}({CLI_COMMAND!r})")
    return found


def torchrun_starts(tree: ast.AST) -> list[str]:
    """Where a module starts torchrun itself: a launcher named in code, or the launch command built."""
    found = [f"line {s.lineno}: {s.value!r}" for s in _code_strings(tree) if s.value in LAUNCHERS]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called(node) in ("build_launch", "worker_command", "torchrun_prefix"):
            found.append(f"line {node.lineno}: {_called(node)}()")
    return found


def test_runtime_never_imports_the_cli_stack():
    offenders = []
    for path, tree in _runtime_modules():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders


def test_runtime_never_runs_the_cli():
    offenders = [f"{path}: {where}" for path, tree in _runtime_modules() for where in cli_runs(tree)]
    assert not offenders, offenders


def test_only_the_job_api_starts_torchrun():
    offenders = [f"{path}: {where}" for path, tree in _runtime_modules() if path.parts[1] != "launch"
                 for where in torchrun_starts(tree)]
    assert not offenders, offenders


def test_the_checks_see_each_way_of_running_the_cli_or_torchrun():
    runs = ['subprocess.run([sys.executable, "-m", "moesys_cli", "train", *overrides])',
            'subprocess.run(["moesys", "train", "recipe=tiny"])',
            'subprocess.Popen(("moesys", "serve", path))',
            'subprocess.run("moesys bench train --json", shell=True)',
            'os.system(f"moesys train train.run_dir={run_dir}")',
            'runpy.run_module("moesys_cli", run_name="__main__")',
            'subprocess.run([shutil.which("moesys"), "infer"])',
            'subprocess.run([str(Path(sys.executable).with_name("moesys")), "plan"])']
    for code in runs:
        assert cli_runs(ast.parse(code)), code
    quiet = ['"""Run it with `moesys train` or python -m moesys_cli."""',
             'raise UserError(f"launch training with moesys train ({path})")',
             'raise UserError(f"moesys bench alltoall: case {name} failed")',
             'FORMATS = ("moesys", "hf")', 'kind = "moesys" if found else "hf"']
    for code in quiet:
        assert not cli_runs(ast.parse(code)), code
    for code in ['subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "-m", "w"])',
                 'subprocess.run(["torchrun", "--nproc_per_node=2", "w.py"])',
                 'subprocess.run(build_launch(cfg, run_dir).argv)']:
        assert torchrun_starts(ast.parse(code)), code
    assert not torchrun_starts(ast.parse('"""Started by torchrun."""\nrun_job(cfg).or_raise()'))
