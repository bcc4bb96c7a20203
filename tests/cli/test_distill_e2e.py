"""`moesys distill` as a user runs it: an 8-expert teacher distilled into a 4-expert student by the default 2
processes (expert parallel 2), measured on held-out text that no run trains on. The student loads in `moesys infer`
and generates, and its held-out loss is below that of the same 4-expert model trained without the teacher for the
same steps on the same batches. The teacher and that baseline train in this process (world 1 with the 2 ranks'
global batch sees the same batches), to spend CI time only on the command under test."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moesys_cli.resolve import resolve_config
from runtime.config import config_from_dict
from runtime.inference.load import load_model
from runtime.parallel.groups import build_groups
from runtime.train.distill import heldout_loss, heldout_windows, split_heldout
from runtime.train.loop import train
from runtime.data.text import CORPUS_DIR
from tests.cli.conftest import FAST_TINY, run_moesys

TEACHER_STEPS, STEPS = 60, 40
ONE_PROCESS = ["topology.nproc_per_node=1", "topology.expert_parallel=1", "train.micro_batch_size=8"]


def metrics_records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_here(run_dir, *overrides: str) -> None:
    """`moesys train` in this process, one rank carrying the 2 ranks' global batch (2 x 4 sequences a step)."""
    cfg = resolve_config([*FAST_TINY, *ONE_PROCESS, f"train.run_dir={run_dir}", *overrides])
    train(cfg, run_dir, build_groups(1, 0, 1, 1), torch.device("cpu"))


@pytest.mark.extended
def test_distilled_student_generates_and_beats_the_same_model_trained_alone(tmp_path):
    data = tmp_path / "train_text"  # three of the corpus's four texts; the fourth is held out from every run
    data.mkdir()
    for name in ("history", "machines", "science"):
        shutil.copy(CORPUS_DIR / f"{name}.txt", data)
    heldout = CORPUS_DIR / "weather.txt"
    teacher, student, alone = tmp_path / "teacher", tmp_path / "student", tmp_path / "alone"
    train_here(teacher, f"train.max_steps={TEACHER_STEPS}", f"train.data={data}")

    distill = ["distill", f"checkpoint={teacher}", "student.num_experts=4", "topology.nproc_per_node=2",
               "topology.expert_parallel=2", "train.micro_batch_size=4", f"train.run_dir={student}",
               f"distill.heldout_data={heldout}", "distill.heldout_windows=24"]
    done = run_moesys(*distill, f"train.max_steps={STEPS // 2}", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["steps"] == STEPS // 2 and report["student_experts"] == 4 and report["teacher_experts"] == 8
    assert report["student_params"] < report["teacher_params"] and 0 < report["size_reduction"] < 1
    assert report["heldout"] == {"source": f"distill.heldout_data={heldout}", "windows": 24, "tokens": 24 * 64}
    assert report["kd_loss"] > 0 and report["teacher_heldout_loss"] > 0
    selection = (student / "distill.json").read_text()
    assert [len(layer["kept"]) for layer in json.loads(selection)["layers"]] == [4, 4, 4, 4]

    done = run_moesys(*distill, f"train.max_steps={STEPS}")  # a resume: from step 20, not from the teacher again
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from step 20" in done.stdout and "student experts:" not in done.stdout
    assert (student / "distill.json").read_text() == selection
    assert "held-out loss on 1536 tokens" in done.stdout and "smaller" in done.stdout
    meta = json.loads((student / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())
    assert (meta["world_size"], meta["expert_parallel"]) == (2, 2)
    assert [m["step"] for m in metrics_records(student)] == list(range(1, STEPS + 1))

    infer = run_moesys("infer", f"checkpoint={student}", "prompt=The ", "infer.max_new_tokens=8", "--json")
    assert infer.returncode == 0, infer.stderr
    assert len(json.loads(infer.stdout)["tokens"][0]) == 8

    train_here(alone, f"train.max_steps={STEPS}", f"train.data={data}", "model.num_experts=4")
    cfg = config_from_dict(meta["config"])
    windows = heldout_windows(split_heldout(cfg).heldout, cfg.train.seq_len, cfg.distill.heldout_windows)
    student_loss, alone_loss = (heldout_loss(load_model(run / "checkpoints" / f"step_{STEPS:08d}").model, windows)
                                for run in (student, alone))
    print(f"held-out loss: teacher {report['teacher_heldout_loss']:.4f}, distilled student {student_loss:.4f}, "
          f"the same student trained alone {alone_loss:.4f}")
    assert f"student {student_loss:.4f}" in done.stdout
    assert student_loss < alone_loss
