"""One `moesys train` plans once: the CLI's own code path, in-process, with the torchrun launch replaced by a command
that exits at once, calls plan_placement a single time, and every check and plan.json read that one plan."""

from __future__ import annotations

import json
import sys
import types

import typer
from typer.testing import CliRunner

import moesys_cli.train as cli_train
import runtime.launch.job as job_api
from runtime.files.paths import PLAN
from runtime.launch.command import LaunchSpec
from runtime.plan import planner


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("train")(cli_train.train)
    app.callback()(lambda: None)
    return app


def count_plans(monkeypatch) -> list:
    """Wrap plan_placement wherever a loaded module holds it (modules import it by name), counting the calls."""
    calls, original = [], planner.plan_placement

    def counted(cfg):
        calls.append(cfg)
        return original(cfg)

    for module in list(sys.modules.values()):
        if isinstance(module, types.ModuleType) and getattr(module, "plan_placement", None) is original:
            monkeypatch.setattr(module, "plan_placement", counted)
    return calls


def test_one_train_launch_calls_plan_placement_once(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    calls = count_plans(monkeypatch)
    monkeypatch.setattr(job_api, "build_launch", lambda cfg, path, module: LaunchSpec(argv=[sys.executable, "-c",
                                                                                             "pass"]))
    result = CliRunner().invoke(_app(), ["train", "recipe=tiny", "storage.offload=auto", "train.max_steps=1",
                                         f"train.run_dir={run_dir}", "--json"])
    assert result.exit_code == 0, result.output
    assert len(calls) == 1
    recorded = json.loads((run_dir / PLAN).read_text())
    assert recorded["placement"]["offload"] == recorded["plan"]["placement"]["offload"] in ("none", "cpu", "ssd")
