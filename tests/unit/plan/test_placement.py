"""The placement is decided once per launch and recorded in plan.json; workers read it; a resume keeps it unless the
config changed, and says so when it did."""

from __future__ import annotations

import json

import torch

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TaskConfig, TrainConfig
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.files.paths import PLAN
from runtime.plan.placement import decide, read, record


def config(tmp_path, **storage) -> MoesysConfig:
    cfg = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64, num_experts=4,
                                         max_seq_len=32),
                       storage=StorageConfig(**storage),
                       train=TrainConfig(seq_len=16, micro_batch_size=2, run_dir=str(tmp_path)))
    cfg.topology.nproc_per_node, cfg.topology.expert_parallel = 1, 1
    return cfg


def test_auto_is_resolved_and_recorded_with_the_full_plan(tmp_path):
    cfg = config(tmp_path, offload="auto")
    placement, note = record(tmp_path, cfg)
    assert note is None and placement.offload in ("none", "cpu", "ssd")
    data = json.loads((tmp_path / PLAN).read_text())
    assert data["placement"]["offload"] == placement.offload == data["plan"]["placement"]["offload"]
    assert read(tmp_path) == placement


def test_a_resume_keeps_the_record_unless_the_config_changed(tmp_path):
    placement, _ = record(tmp_path, config(tmp_path, offload="ssd", cpu_cache_experts=2))
    assert placement.cpu_cache_experts == 2
    assert record(tmp_path, config(tmp_path, offload="ssd", cpu_cache_experts=2)) == (placement, None)
    changed, note = record(tmp_path, config(tmp_path, offload="ssd", cpu_cache_experts=3))
    assert changed.cpu_cache_experts == 3 and note == ("the config changed since the recorded plan: re-planned "
                                                       "(cpu_cache_experts 2 -> 3)")
    assert read(tmp_path) == changed


def test_workers_build_the_recorded_placement(tmp_path):
    cfg = config(tmp_path, offload="ssd", cpu_cache_experts=2)
    recorded, _ = decide(cfg)
    c = build_components(cfg, build_groups(1, 0, 1, 1), torch.device("cpu"),
                         placement=type(recorded)(**{**recorded.__dict__, "cpu_cache_experts": 1}))
    assert c.offload.home.cache.capacity == 1  # the record wins over what cfg alone would give (2)
    c.offload.close()


def test_the_task_allocation_is_recorded_and_workers_lay_tasks_out_by_it(tmp_path):
    cfg = config(tmp_path)
    cfg.tasks = {"a": TaskConfig(batch_size=3), "b": TaskConfig(batch_size=1)}
    placement, _ = record(tmp_path, cfg)
    assert placement.task_gpus == {"a": 1, "b": 1}  # one rank: both tasks packed on it
    assert read(tmp_path).task_gpus == placement.task_gpus
    c = build_components(cfg, build_groups(1, 0, 1, 1), torch.device("cpu"), placement=read(tmp_path))
    assert c.tasks.layout.ranks == {"a": [0], "b": [0]}
