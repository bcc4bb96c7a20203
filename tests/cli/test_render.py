"""User text is data, never rich markup: paths and quoted logs with `[...]` print as written, in one line."""

from __future__ import annotations

import json
import subprocess
import sys

from moesys_cli.render import error
from tests.cli.conftest import run_moesys

GLOO = "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer"


def test_error_prints_a_quoted_gloo_message_literally(capsys):
    error(f"training failed with exit code 1: {GLOO} (logs in /tmp/run[/x]/logs)")
    err = capsys.readouterr().err
    assert err == f"error: training failed with exit code 1: {GLOO} (logs in /tmp/run[/x]/logs)\n"


def test_a_checkpoint_path_with_brackets_is_one_line_exit_2():
    out = run_moesys("infer", "checkpoint=/nonexistent/x[/y]", "prompt=hi")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "MarkupError" not in out.stderr
    assert out.stderr.strip().splitlines() == ["error: checkpoint=/nonexistent/x[/y]: no such directory"]


def test_rebalance_prints_a_run_directory_with_brackets(tmp_path):
    run = tmp_path / "run[/bold]"
    run.mkdir(parents=True)
    lines = [{"step": 1, "rank": r, "task": f"task{r + 1}", "samples_per_s": 10.0} for r in range(4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = run_moesys("rebalance", "recipe=ufo-multitask", "--from-run", str(run))
    assert out.returncode == 0, out.stderr
    assert "run[/bold]" in out.stdout.replace("\n", "").replace(" ", "")


def test_a_full_disk_met_where_no_verb_expected_it_is_one_line_exit_2():
    script = ("import errno, sys\nfrom moesys_cli import app as m\n"
              "@m.app.command('fill')\ndef fill():\n"
              "    raise RuntimeError('write failed') from OSError(errno.ENOSPC, 'No space left on device', '/d/[x]')\n"
              "sys.argv = ['moesys', 'fill']\nm.main()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr == "error: No space left on device: /d/[x]\n", done.stderr
