"""`moesys train` on a multi-task recipe end to end: change the allocation of a running job (checkpoint, restart
with another allocation and expert-parallel size, resume) without losing anything trained, and
`moesys rebalance --from-run` on the finished run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cli.conftest import run_moesys

RECIPE = """# @package _global_
defaults:
  - override /model: tiny
  - override /topology: single
  - _self_
recipe: {name}
model: {{aux_loss_weight: 0.0}}
topology: {{nproc_per_node: 4, expert_parallel: {ep}}}
train: {{seq_len: 32, max_steps: 4, checkpoint_every: 2, warmup_steps: 2}}
tasks:
  heavy: {{batch_size: 6, gpus: {heavy}}}
  light: {{batch_size: 2, gpus: {light}}}
"""


def recipe(tmp_path: Path, name: str, ep: int, heavy: int, light: int) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(RECIPE.format(name=name, ep=ep, heavy=heavy, light=light))
    return path


def step_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m for m in lines if "loss" in m]


@pytest.mark.extended
def test_resume_with_another_allocation_continues_the_same_training(tmp_path):
    run_a = tmp_path / "a"
    out = run_moesys("train", f"recipe={recipe(tmp_path, 'alloc-a', 1, 2, 2)}", f"train.run_dir={run_a}", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["steps"] == 4 and summary["final_loss"] < summary["initial_loss"]
    a_lines = step_lines(run_a)
    assert set(a_lines[-1]["task_loss"]) == {"heavy", "light"}
    rank_lines = [json.loads(x) for x in (run_a / "metrics.jsonl").read_text().splitlines() if '"rank"' in x]
    assert {(m["rank"], m["task"]) for m in rank_lines} == {(0, "heavy"), (1, "heavy"), (2, "light"), (3, "light")}

    # The same job stopped at its step-2 checkpoint, restarted with 3/1 ranks and experts split in 4 (were replicated).
    run_b = tmp_path / "b"
    shutil.copytree(run_a, run_b)
    shutil.rmtree(run_b / "checkpoints" / "step_00000004")
    (run_b / "checkpoints" / "latest").write_text("step_00000002\n")
    out = run_moesys("train", f"recipe={recipe(tmp_path, 'alloc-b', 4, 3, 1)}", f"train.run_dir={run_b}", "--json")
    assert out.returncode == 0, out.stderr
    b_lines = step_lines(run_b)
    assert [m["step"] for m in b_lines] == [1, 2, 3, 4]
    layout = json.loads((run_b / "checkpoints" / "step_00000004" / "tasks.json").read_text())
    assert layout["ranks"] == {"heavy": [0, 1, 2], "light": [3]} and layout["batch"]["heavy"] == [2, 2, 2]
    # The objective does not depend on the allocation: resumed steps equal the uninterrupted run's.
    for a, b in zip(a_lines[2:], b_lines[2:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        for task in ("heavy", "light"):
            assert b["task_loss"][task] == pytest.approx(a["task_loss"][task], rel=1e-4)

    # The finished multi-task run's measured speeds feed `moesys rebalance --from-run`.
    out = run_moesys("rebalance", f"recipe={recipe(tmp_path, 'alloc-a', 1, 2, 2)}", "--from-run", str(run_a),
                     "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["source"] == str(run_a) and set(data["allocation"]) == {"heavy", "light"}
    assert min(w["cost_per_sample"] for w in data["workload"].values()) == 1.0
