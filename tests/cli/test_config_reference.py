"""docs/config.md is `moesys config --keys --markdown` of the schema as it is: regenerated and compared, every key in it
with its type and docstring, and the flag's misuses refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config.keys import config_keys, value_text
from tests.cli.conftest import run_moesys

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_config_md_is_the_current_reference():
    out = run_moesys("config", "--keys", "--markdown")
    assert out.returncode == 0, out.stderr
    assert REFERENCE.read_text() == out.stdout, (
        "docs/config.md is not the schema's current reference: regenerate it with "
        "`moesys config --keys --markdown > docs/config.md` and commit it")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*")


def test_every_key_has_one_row_with_its_type_default_and_doc():
    out = run_moesys("config", "--keys", "--markdown")
    rows = [line for line in out.stdout.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [k.key for k in config_keys()]
    for key, row in zip(config_keys(), rows):
        assert key.doc, f"{key.key} has no docstring"
        assert row == f"| `{key.key}` | {_cell(key.type)} | `{_cell(value_text(key.default))}` | {_cell(key.doc)} |"
    sections = [line[3:] for line in out.stdout.splitlines() if line.startswith("## ")]
    assert sections[0] == "`model`" and sections[-1] == "Top level"


@pytest.mark.parametrize("args, says", [
    (["--markdown"], "--markdown goes with --keys"),
    (["--keys", "--markdown", "--json"], "--markdown and --json are two formats"),
    (["--keys", "--markdown", "recipe=tiny"], "drop recipe=tiny"),
])
def test_markdown_misuse_is_one_line_exit_2(args, says):
    out = run_moesys("config", *args)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr and out.stdout == ""
