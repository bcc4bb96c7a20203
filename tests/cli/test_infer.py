"""`moesys infer`: the JSON report, the offload modes agreeing, argument parsing, and bad input as one line + exit 2."""

import json
import subprocess
import sys

import pytest
import torch
import typer
from typer.testing import CliRunner

from moesys_cli.infer import infer, parse_infer_args
from runtime.errors import UserError
from tests.cli.conftest import fill, run_moesys, tmpfs
from tests.trained_run import train_run_dir

# the real app and main(); registers `infer` there unless the app already has it
MAIN = """
import sys
from moesys_cli import app as m
from moesys_cli.infer import infer
if not any(c.name == "infer" for c in m.app.registered_commands):
    m.app.command("infer")(infer)
sys.argv = ["moesys", *sys.argv[1:]]
m.main()
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_run_dir(tmp_path_factory.mktemp("run"))


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("infer")(infer)
    app.callback()(lambda: None)
    return app


def _json(args):
    result = CliRunner().invoke(_app(), ["infer", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_report_and_modes_agree(run_dir):
    common = [f"checkpoint={run_dir}", "prompt=the weather", "prompt=a machine", "infer.max_new_tokens=5"]
    ring = _json([*common, "infer.ring_slots=1", "--offload", "ring"])
    none = _json([*common, "--offload", "none"])
    ondemand = _json([*common, "--offload", "ondemand"])
    assert ring["tokens"] == none["tokens"] == ondemand["tokens"]
    assert len(ring["tokens"]) == 2 and all(len(t) == 5 for t in ring["tokens"])
    assert ring["text"] == [bytes(t).decode("utf-8", errors="replace") for t in ring["tokens"]]
    assert ring["offload"] == "ring" and ring["ring_slots"] == 1 and ring["moe_layers"] == 2
    assert ring["prefill_tokens_per_s"] > 0 and ring["decode_tokens_per_s"] > 0
    assert ring["peak_bytes"]["device"]["experts"] * 2 == none["peak_bytes"]["device"]["experts"]
    assert ring["peak_bytes"]["host"]["experts"] == none["peak_bytes"]["device"]["experts"]
    assert 0.0 <= ring["copy_hidden_share"] <= 1.0 and none["copy_hidden_share"] is None


def test_rich_output(run_dir):
    result = CliRunner().invoke(_app(), ["infer", f"checkpoint={run_dir}", "prompt_ids=[104,105]",
                                         "infer.max_new_tokens=3"])
    assert result.exit_code == 0, result.output
    assert "decode" in result.output and "copy time hidden" in result.output


def test_parse_infer_args():
    r = parse_infer_args(["checkpoint=/x", "prompt=123", "infer.temperature=0.5", "infer.prompt_ids=[1, 2]",
                          "prompt_ids=[3]", "infer.top_k=4"])
    assert r.checkpoint == "/x" and r.prompts == ["123"] and r.prompt_ids == [[1, 2], [3]]
    assert r.overrides == {"temperature": 0.5, "top_k": 4}
    for bad, message in [(["prompt=x"], "no checkpoint"), (["checkpoint=/x", "model.hidden_size=4"], "unknown"),
                         (["checkpoint=/x", "prompt_ids=abc"], "not a list of token ids"),
                         (["checkpoint=/x", "oops"], "not key=value"),
                         (["checkpoint=/x", "max_new_tokens=4"], "unknown argument 'max_new_tokens'; did you mean "
                                                                 "infer.max_new_tokens?"),
                         (["checkpoint=/x", "promt=a"], "unknown argument 'promt'; did you mean prompt, prompt_ids?")]:
        with pytest.raises(UserError, match=message):
            parse_infer_args(bad)


@pytest.mark.parametrize("args,message", [
    (["infer.ring_slots=3", "infer.offload=ring"], "infer.ring_slots=3 must be between 1 and the model's 2 MoE layers"),
    (["infer.max_new_tokens=60"], "exceeds model.max_seq_len=48"),
])
def test_bad_input_is_a_user_error(run_dir, args, message):
    result = CliRunner().invoke(_app(), ["infer", f"checkpoint={run_dir}", "prompt=hi", *args])
    assert isinstance(result.exception, UserError) and message in str(result.exception)


def test_main_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-c", MAIN, "infer", f"checkpoint={tmp_path / 'missing'}", "prompt=hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no such directory" in lines[0]


def test_generated_text_and_paths_print_literally(run_dir, capsys):
    from moesys_cli.infer import _render
    r = _json([f"checkpoint={run_dir}", "prompt=hi", "infer.max_new_tokens=2"])
    r["checkpoint"], r["text"] = "/data/run[/x]", ["[/bold] closing tag"]
    _render(r)
    out = capsys.readouterr().out
    assert "/data/run[/x]" in out and "[/bold] closing tag" in out


def test_infer_uses_every_usable_cpu_unless_omp_num_threads_is_set(run_dir, monkeypatch):
    from runtime.host import topology
    monkeypatch.setattr(topology, "usable_cpus", lambda: 3)  # the same on any machine
    before = torch.get_num_threads()
    args = [f"checkpoint={run_dir}", "prompt=hi", "infer.max_new_tokens=1", "--offload", "none"]
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(1)
        _json(args)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        _json(args)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.extended
def test_a_report_or_export_that_cannot_be_written_is_one_line_and_the_generated_text_is_printed_first(run_dir,
                                                                                                        tmp_path):
    with tmpfs(tmp_path / "full", "1m") as full, tmpfs(tmp_path / "ro", "1m", "ro") as read_only:
        fill(full)
        report = full / "r.html"
        infer = run_moesys("infer", f"checkpoint={run_dir}", "prompt=hi", "infer.max_new_tokens=2", "--report",
                           str(report))
        assert infer.returncode == 2 and "\n0: '" in infer.stdout  # the generated text: the work is not lost
        assert infer.stderr.strip().splitlines() == [f"error: --report {report}: cannot write it (No space left on "
                                                     f"device: {report}); the result is above"]
        export = run_moesys("export", f"checkpoint={run_dir}", f"out={read_only / 'x'}")
        assert export.returncode == 2 and export.stderr.strip().splitlines() == [
            f"error: cannot write out={read_only / 'x'} (Read-only file system); nothing was left there: make room, or "
            "choose another out="]
        export = run_moesys("export", f"checkpoint={run_dir}", f"out={full / 'x'}")  # refused before writing
        assert export.returncode == 2 and len(export.stderr.strip().splitlines()) == 1
        assert export.stderr.startswith("error: not enough disk: ") and "has 0 B free" in export.stderr
        assert [p.name for p in full.iterdir()] == ["filler"] and not list(read_only.iterdir())
