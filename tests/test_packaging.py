"""The wheel, as a user installs it: built offline from the source files, it holds every module of runtime and
moesys_cli (subpackages are found, not listed) and the CLI's conf/ and recipes/; installed into a fresh virtual
environment, every module imports and `moesys` finds its configuration from any directory."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "runtime", "moesys_cli", "conf", "recipes")
"""What the build reads: copied, so that its build/ and egg-info folders stay out of the checkout."""

IMPORT_ALL = """
import importlib, json, pkgutil

def reraise(name):
    raise

found = {}
for top in ("runtime", "moesys_cli"):
    package = importlib.import_module(top)
    found[top] = package.__file__
    for module in pkgutil.walk_packages(package.__path__, top + ".", onerror=reraise):
        if not module.name.endswith(".__main__"):  # `python -m moesys_cli` runs the CLI
            found[module.name] = importlib.import_module(module.name).__file__
print(json.dumps(found))
"""


def run(argv: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, argv))}:\n{done.stdout}\n{done.stderr}"
    return done


def expected_files(source: Path) -> set[str]:
    """The wheel's paths of every module and data file of the source tree."""
    modules = {p.relative_to(source).as_posix() for top in ("runtime", "moesys_cli")
               for p in (source / top).rglob("*.py") if "__pycache__" not in p.parts}
    config = {f"moesys_cli/{p.relative_to(source).as_posix()}"
              for p in [*(source / "conf").rglob("*.yaml"), *(source / "recipes").glob("*.yaml")]}
    corpus = {p.relative_to(source).as_posix() for p in (source / "runtime/data/corpus").glob("*.txt")}
    return modules | config | corpus


def test_the_wheel_holds_every_module_and_installs_a_cli_that_finds_its_config_anywhere(tmp_path):
    pytest.importorskip("setuptools", minversion="70.1", reason="the offline build uses this environment's "
                        "setuptools (pip install '.[test]')")
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--wheel-dir", tmp_path / "dist", source], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("moesys-*.whl")
    missing = sorted(expected_files(source) - set(zipfile.ZipFile(wheel).namelist()))
    assert not missing, f"the wheel lacks {missing} (a folder of modules needs an __init__.py to be found)"

    venv = tmp_path / "venv"  # torch and the other dependencies come from this environment
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], cwd=tmp_path)
    python, moesys = venv / "bin" / "python", venv / "bin" / "moesys"
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
    # Where this interpreter is itself a virtual environment, its packages are not the "system" ones: listed after
    # the new environment's own, with no .pth of theirs run (an editable moesys there stays out).
    (Path(purelib.stdout.strip()) / "this-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "--quiet", wheel],
        cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    found = json.loads(run([python, "-c", IMPORT_ALL], cwd=elsewhere, timeout=300).stdout)
    outside = {name: file for name, file in found.items() if not file.startswith(str(venv))}
    assert not outside, f"imported from outside the installed wheel: {outside}"
    sources = {p.relative_to(source).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
               for top in ("runtime", "moesys_cli") for p in (source / top).rglob("*.py")
               if "__pycache__" not in p.parts and p.name != "__main__.py"}
    assert set(found) == sources

    plan = json.loads(run([moesys, "plan", "recipe=tiny", "--json"], cwd=elsewhere).stdout)
    assert plan["recipe"] == "tiny" and plan["budget"]["ok"]
    keys = run([moesys, "config", "--keys"], cwd=elsewhere).stdout
    assert "model.hidden_size" in keys and "train.max_steps" in keys
