"""Multi-task training pieces: rank layouts from allocations, per-task data slices, the loss objective, heads
in checkpoints (one process; the multi-process versions are in tests/distributed/test_multitask_gloo.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from runtime.config import MoesysConfig, TaskConfig, config_from_dict
from runtime.elastic.allocation import AllocationError
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.checkpoint import load_checkpoint, save_checkpoint
from runtime.train.loop import forward_backward, optimizer_step
from runtime.train.tasks import layout_from_counts, new_head, task_layout


def small_config(world: int = 1, ep: int = 1, tasks: dict | None = None, **model) -> MoesysConfig:
    cfg = MoesysConfig()
    cfg.model = dataclasses.replace(cfg.model, hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64,
                                    num_experts=4, top_k=2, max_seq_len=32, aux_loss_weight=0.0, **model)
    cfg.topology = dataclasses.replace(cfg.topology, nproc_per_node=world, expert_parallel=ep)
    cfg.train = dataclasses.replace(cfg.train, seq_len=16, warmup_steps=1)
    cfg.tasks = tasks if tasks is not None else {"a": TaskConfig(batch_size=3, gpus=1),
                                                 "b": TaskConfig(batch_size=2, gpus=1)}
    return config_from_dict(dataclasses.asdict(cfg))


def test_table_3_layout_from_the_allocation():
    cfg = MoesysConfig(tasks={f"task{i + 1}": TaskConfig(batch_size=b) for i, b in enumerate([512, 256, 128, 128])})
    cfg.topology.nproc_per_node = cfg.topology.expert_parallel = 8
    layout = task_layout(cfg, 8)
    assert layout.ranks == {"task1": [0, 1, 2, 3], "task2": [4, 5], "task3": [6], "task4": [7]}
    assert layout.batch == {"task1": [128] * 4, "task2": [128] * 2, "task3": [128], "task4": [128]}
    assert [layout.rank_samples(r) for r in range(8)] == [128] * 8


def test_configured_gpus_win_and_light_tasks_pack_when_ranks_run_out():
    workload = {"t1": (512, 1.0), "t2": (256, 1.0), "t3": (128, 1.0), "t4": (128, 1.0)}
    layout = layout_from_counts(workload, {"t1": 2, "t2": 1, "t3": 1, "t4": 1}, 4)
    assert layout.ranks["t1"] == [0, 1]
    packed = {tuple(layout.tasks_of(r)) for r in (2, 3)}
    assert packed == {("t2",), ("t3", "t4")}  # heaviest first onto the least loaded rank
    assert layout.rank_samples(2) == layout.rank_samples(3) == 256


def test_spare_ranks_go_to_the_most_loaded_task():
    layout = layout_from_counts({"heavy": (24, 1.0), "light": (8, 1.0)}, {"heavy": 1, "light": 1}, 4)
    assert layout.ranks == {"heavy": [0, 1, 2], "light": [3]}
    assert layout.batch == {"heavy": [8, 8, 8], "light": [8]}


@pytest.mark.parametrize("counts,world", [({"a": 3, "b": 1}, 3), ({"a": 2, "b": 2}, 3), ({"a": 0, "b": 1}, 2)])
def test_impossible_counts_are_one_line_errors(counts, world):
    with pytest.raises(AllocationError) as err:
        layout_from_counts({"a": (4, 1.0), "b": (4, 1.0)}, counts, world)
    assert "\n" not in str(err.value)


def test_more_ranks_than_samples_is_an_error():
    with pytest.raises(AllocationError, match="samples per step"):
        layout_from_counts({"a": (1, 1.0), "b": (1, 1.0)}, {"a": 1, "b": 1}, 3)


@pytest.mark.parametrize("batch,k", [(7, 3), (8, 4), (5, 1)])
def test_rank_slices_tile_the_task_batch(batch, k):
    layout = layout_from_counts({"t": (batch, 1.0), "u": (2, 1.0)}, {"t": k, "u": 1}, k + 1)
    covered = []
    for r in layout.ranks["t"]:
        off, n = layout.offset("t", r), layout.samples("t", r)
        covered += list(range(off, off + n))
    assert covered == list(range(batch))


def test_heads_start_equal_per_task_and_differ_between_tasks():
    cfg = small_config()
    assert torch.equal(new_head(cfg, "a").weight, new_head(cfg, "a").weight)
    assert not torch.equal(new_head(cfg, "a").weight, new_head(cfg, "b").weight)


def test_one_rank_hosting_both_tasks_minimises_the_mean_loss_over_all_samples():
    cfg = small_config()
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, torch.device("cpu"))
    assert c.tasks.layout.ranks == {"a": [0], "b": [0]}
    assert "output.weight" not in dict(c.model.named_parameters())
    loss, _ = forward_backward(c, cfg, groups, 3, torch.device("cpu"))
    inputs, targets, rows = c.tasks.rank_batch(3)
    assert rows == [("a", 3), ("b", 2)]
    # Reference: the same samples, read straight from each task's data, through the model and each head.
    for task, n, first in (("a", 3, 0), ("b", 2, 3)):
        seqs = c.tasks.data[task].windows(3 * n, n)
        assert torch.equal(inputs[first:first + n], seqs[:, :-1])
    hidden = c.model(inputs).logits.detach()
    per_sample = torch.cat([F.cross_entropy(c.tasks.heads["a"](hidden[:3]).flatten(0, 1), targets[:3].flatten(),
                                            reduction="none"),
                            F.cross_entropy(c.tasks.heads["b"](hidden[3:]).flatten(0, 1), targets[3:].flatten(),
                                            reduction="none")])
    torch.testing.assert_close(loss, per_sample.mean())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in c.tasks.parameters())


def test_heads_and_their_adam_states_survive_a_checkpoint(tmp_path):
    cfg = small_config()
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, torch.device("cpu"))
    for step in range(2):
        forward_backward(c, cfg, groups, step, torch.device("cpu"))
        optimizer_step(c, cfg, groups, step)
    ckpt = save_checkpoint(tmp_path, 2, c.model, c.optimizer, groups, cfg, parts=c.parts)
    assert sorted(p.name for p in ckpt.glob("heads-*")) == ["heads-a.safetensors", "heads-b.safetensors"]
    fresh = build_components(cfg, groups, torch.device("cpu"))
    assert not torch.equal(fresh.tasks.heads["a"].weight, c.tasks.heads["a"].weight)
    load_checkpoint(ckpt, fresh.model, fresh.optimizer, groups)
    fresh.tasks.load(ckpt, fresh.optimizer)
    for task in ("a", "b"):
        old, new = c.tasks.heads[task].weight, fresh.tasks.heads[task].weight
        assert torch.equal(old, new)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(c.optimizer.state[old][key], fresh.optimizer.state[new][key])
    for (name, p), q in zip(c.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(p, q), name


def test_a_checkpoint_without_a_task_head_is_refused(tmp_path):
    cfg = small_config()
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, torch.device("cpu"))
    ckpt = save_checkpoint(tmp_path, 1, c.model, c.optimizer, groups, cfg, parts=c.parts)
    other = build_components(small_config(tasks={"a": TaskConfig(batch_size=3, gpus=1),
                                                 "z": TaskConfig(batch_size=2, gpus=1)}), groups,
                             torch.device("cpu"))
    with pytest.raises(Exception, match="no head for task 'z'"):
        other.tasks.load(ckpt, other.optimizer)
