"""What `--help`, the plan's table and the user guide tell a user: one line per verb, the overrides each verb really
takes, the device named as it is, an example of every verb in the README, and papers cited by title and section,
never by a file number of this repository's sources."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from moesys_cli.app import SHORT, app
from tests.cli.conftest import run_moesys

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""The user guide: the README and every page of docs/."""


def test_the_verb_list_gives_each_verb_one_whole_sentence():
    out = run_moesys("--help")
    assert out.returncode == 0, out.stderr
    box = out.stdout.split("Commands")[1].split("╰")[0]
    rows = [line.strip("│ ").rstrip() for line in box.splitlines()[1:] if line.strip("│ ").strip()]
    assert len(rows) == 13, rows  # a docstring's line breaks made a verb's text run over several rows
    for row in rows:
        name, text = row.split(None, 1)
        assert text.endswith("."), row


def _flat(text: str) -> str:
    """Help text without its box drawing and line wrapping."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_bench_and_rebalance_help_show_the_overrides_they_take():
    bench = _flat(run_moesys("bench", "--help").stdout)
    assert "moe-layer, offload, embedding, beyond-memory, serve: none" in bench
    assert "ring: only infer.ring_slots=N; infer: only infer.ring_slots=N, infer.compile=true|false" in bench and "model.num_experts=16" not in bench
    rebalance = _flat(run_moesys("rebalance", "--help").stdout)
    assert "recipe=ufo-multitask" in rebalance and "gpt-moe-13b model.num_experts" not in rebalance


def test_the_plan_names_the_device_it_plans_for(tmp_path):
    cpu = run_moesys("plan", "recipe=tiny", cwd=tmp_path)
    assert cpu.returncode == 0, cpu.stderr
    assert "on CPU (no GPU) with storage.offload=none: dense in the device pool (RAM)" in cpu.stdout
    assert "GPU," not in cpu.stdout
    assert json.loads(run_moesys("plan", "recipe=tiny", "--json", cwd=tmp_path).stdout)["placement"]["device"] == "cpu"
    gpu = run_moesys("plan", "recipe=gpt-moe-13b", "--json", cwd=tmp_path)
    assert json.loads(gpu.stdout)["placement"]["device"] == "gpu"


def test_help_keys_and_docs_cite_papers_by_name_not_by_source_file_number():
    seed = re.compile(r"seed 0\d\d|seeds?/")
    runner = CliRunner()  # the installed app, in this process: 14 help texts without 14 interpreter start-ups
    texts = [runner.invoke(app, [verb, "--help"]).output for verb in
             ("plan", "train", "infer", "export", "distill", "serve", "report", "rebalance", "bench", "config",
              "tokenize", "eval", "tokenizer")]
    texts.append(runner.invoke(app, ["config", "--keys"]).output)
    assert all("Usage" in text or "model." in text for text in texts)
    assert len(DOCS) > 10, DOCS  # the README and the pages of docs/
    texts += [path.read_text() for path in DOCS]
    assert not [m.group() for text in texts for m in seed.finditer(text)]


def test_the_readme_shows_every_verb_and_links_the_docs():
    readme = DOCS[0].read_text()
    assert [verb for verb in SHORT if f"\nmoesys {verb} " not in readme] == []  # one example per verb
    assert [p.name for p in DOCS[1:] if f"docs/{p.name}" not in readme and p.name != "README.md"] == []


def test_code_and_tests_cite_what_they_mean_not_source_files_issue_numbers_or_design_notes():
    """Docstrings and comments say the paper's section or the behaviour; a seed file, an issue or the design notes
    outside the repository mean nothing to a reader of the code."""
    reference = re.compile(r"seed 0\d\d|seeds?/|DESIGN\.md|\b[Ii]ssue \d+|\b[Ii]ssue's")
    found = [f"{path.relative_to(ROOT)}:{number}: {m.group()}"
             for top in ("runtime", "moesys_cli", "tests") for path in sorted((ROOT / top).rglob("*"))
             if path.suffix in (".py", ".sh", ".md", ".yaml") and "__pycache__" not in path.parts
             for number, line in enumerate(path.read_text().splitlines(), 1) for m in reference.finditer(line)]
    assert not found, found
