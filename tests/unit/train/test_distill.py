"""moesys distill's pieces in one process: the KD loss against a hand computation, expert usage and selection, the
student's step-0 checkpoint built from the teacher's most used experts, and a student run that resumes from its
own checkpoint exactly as if uninterrupted (never from the teacher again)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from runtime.files.checkpoint_format import CheckpointReader, latest_checkpoint
from runtime.config import ModelConfig, MoesysConfig, TopologyConfig, TrainConfig, config_from_dict
from runtime.inference.load import load_model
from runtime.moe.layer import MoELayer
from runtime.parallel.groups import build_groups
from runtime.files.run_dir import read_metrics
from runtime.train.distill import Distillation, heldout_windows, kd_loss, split_heldout
from runtime.train.loop import train
from runtime.train.student_config import find_teacher, recorded_teacher, student_recipe
from runtime.files.paths import SELECTION
from runtime.train.student_init import expert_usage, most_used, start_student

CPU = torch.device("cpu")
ONE = build_groups(1, 0, 1, 1)


def test_kd_loss_is_t_squared_kl_of_the_soft_targets_and_reaches_only_the_student():
    student = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]], requires_grad=True)  # [B=1, S=2, V=3]
    teacher = torch.tensor([[[2.0, 1.0, 0.0], [1.0, 1.0, 1.0]]], requires_grad=True)
    t = 2.0

    def softmax(row):
        e = [math.exp(x / t) for x in row]
        return [x / sum(e) for x in e]

    expected = 0.0
    for s_row, t_row in zip(student[0].tolist(), teacher[0].tolist()):
        p, q = softmax(t_row), softmax(s_row)
        expected += sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))
    expected = expected / 2 * t * t  # mean over the 2 tokens, times T^2
    loss = kd_loss(student, teacher, t)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0
    assert kd_loss(teacher.detach(), teacher.detach(), t).item() == pytest.approx(0.0, abs=1e-7)


def test_most_used_keeps_the_largest_counts_ties_to_the_lower_index():
    assert most_used(torch.tensor([5, 9, 1, 9, 0, 7]), 3) == [1, 3, 5]
    assert most_used(torch.tensor([2, 2, 2, 2]), 2) == [0, 1]


def teacher_config(run_dir) -> MoesysConfig:
    return MoesysConfig(
        model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64, num_experts=4, top_k=2,
                          max_seq_len=32),
        topology=TopologyConfig(nproc_per_node=1, expert_parallel=1),
        train=TrainConfig(seq_len=16, micro_batch_size=4, max_steps=6, warmup_steps=1, lr=3e-3, checkpoint_every=0,
                          run_dir=str(run_dir)))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("teacher")
    train(teacher_config(run_dir), run_dir, ONE, CPU)
    return run_dir


def student_config(teacher_dir, run_dir, steps: int, experts: int = 2) -> MoesysConfig:
    data = student_recipe(find_teacher(teacher_dir), experts)
    data["train"].update(run_dir=str(run_dir), max_steps=steps, checkpoint_every=2)
    data["distill"].update(heldout_windows=8)
    return config_from_dict(data)


def test_usage_counts_every_top_k_choice_of_the_routers(teacher):
    cfg = student_config(teacher, teacher.parent / "unused", 1)
    windows = heldout_windows(split_heldout(cfg).heldout, 16, 8)
    model = load_model(find_teacher(teacher).step_dir).model
    usage = expert_usage(model, windows, batch_size=3)
    assert len(usage) == 2 and all(int(u.sum()) == 8 * 16 * 2 for u in usage)  # windows x tokens x top_k
    with torch.no_grad():  # the routers' own per-expert shares of the same forward
        stats = model(windows[:, :-1]).moe_stats
    for u, s in zip(usage, stats):
        assert torch.equal(u, torch.round(s.metrics["expert_fraction"] * 8 * 16 * 2).long())


def test_student_starts_from_the_teachers_most_used_experts_and_router_rows(teacher, tmp_path):
    cfg = student_config(teacher, tmp_path, 1)
    record = start_student(cfg, tmp_path)
    assert json.loads((tmp_path / SELECTION).read_text()) == record
    assert record["teacher_experts"] == 4 and record["heldout"]["windows"] == 8
    step0 = latest_checkpoint(tmp_path)
    assert step0.name == "step_00000000" and recorded_teacher(tmp_path) == str(find_teacher(teacher).step_dir)
    t, s = CheckpointReader(find_teacher(teacher).step_dir), CheckpointReader(step0)
    for layer in record["layers"]:
        kept, name = layer["kept"], layer["layer"]
        assert kept == most_used(torch.tensor(layer["usage"]), 2)
        gate = f"model.{name}.router.gate.weight"
        assert torch.equal(s.get(gate), t.get(gate)[kept])
        for j, g in enumerate(kept):
            for w in ("w1", "w2", "b1", "b2"):
                assert torch.equal(s.get(f"model.{name}.experts.{w}.{j}"), t.get(f"model.{name}.experts.{w}.{g}"))
    for key in ("model.tok_embeddings.weight", "model.layers.1.attention_norm.weight", "model.norm.bias"):
        assert torch.equal(s.get(key), t.get(key))
    assert float(s.get("step.tok_embeddings.weight")) == 0 and not s.get("exp_avg.tok_embeddings.weight").any()
    student = load_model(step0).model
    assert all(m.router.gate.weight.shape[0] == 2 for m in student.modules() if isinstance(m, MoELayer))


def test_a_student_run_resumes_from_its_checkpoint_like_an_uninterrupted_run(teacher, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    for run_dir, stops in ((whole, [4]), (split, [2, 4])):
        for steps in stops:
            cfg = student_config(teacher, run_dir, steps)
            started = start_student(cfg, run_dir)
            assert (started is None) == (steps != stops[0])  # the second launch resumes: no new selection
            train(cfg, run_dir, ONE, CPU)
    a, b = read_metrics(whole), read_metrics(split)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert [m["loss"] for m in a] == [m["loss"] for m in b] and [m["kd_loss"] for m in a] == [m["kd_loss"] for m in b]
    assert all(m["kd_loss"] > 0 for m in a)


def test_the_teacher_stays_frozen_while_the_student_learns(teacher, tmp_path):
    from runtime.train.build import build_components

    cfg = student_config(teacher, tmp_path, 1)
    start_student(cfg, tmp_path)
    c = build_components(cfg, ONE, CPU)
    assert isinstance(c.objective, Distillation)
    before = [p.clone() for p in c.objective.teacher.parameters()]
    c.objective.forward_backward(c.model, 0, CPU, torch.autocast("cpu", enabled=False))
    assert all(p.grad is None for p in c.objective.teacher.parameters())
    assert all(p.grad is not None for p in c.model.parameters() if p.requires_grad)
    assert all(torch.equal(a, b) for a, b in zip(before, c.objective.teacher.parameters()))


def test_the_plan_counts_the_whole_teacher_on_every_rank(tmp_path):
    """Each worker holds the frozen teacher (fp32, every expert): a plan that left it out let a distillation pass
    the RAM check and meet the OOM killer."""
    from runtime.config import config_to_dict
    from runtime.errors import UserError
    from runtime.launch.command import check_host_memory
    from runtime.plan.params import count_parameters
    from runtime.plan.planner import plan_placement

    teacher_cfg = MoesysConfig(model=ModelConfig(hidden_size=256, num_layers=4, num_heads=4, vocab_size=256,
                                                 ffn_hidden_size=1024, num_experts=32, max_seq_len=128))
    step = tmp_path / "teacher" / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 10, "config": config_to_dict(teacher_cfg)}))
    student = MoesysConfig(model=ModelConfig(hidden_size=256, num_layers=4, num_heads=4, vocab_size=256,
                                             ffn_hidden_size=1024, num_experts=4, max_seq_len=128))
    alone = plan_placement(student)
    student.distill.teacher = str(step)
    with_teacher = plan_placement(student)
    teacher_bytes = 4 * count_parameters(teacher_cfg.model).total
    assert with_teacher.per_rank.device["teacher_weights"] == teacher_bytes
    assert with_teacher.process_host_bytes - alone.process_host_bytes == teacher_bytes
    room = 2 * alone.process_host_bytes + int(0.32 * 2**30) + teacher_bytes  # 2 processes: fits without, not with
    check_host_memory(MoesysConfig(model=student.model), room)
    with pytest.raises(UserError, match="CPU processes need about"):
        check_host_memory(student, room)
