"""storage.offload=ssd and cpu on 2 gloo processes (expert parallel, and replicated experts) against offload=none on
the same world: identical losses (the paper's "Training Phase")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.files.run_dir import read_metrics, save_config
from runtime.files.paths import CONFIG
from tests.distributed.torchrun import REPO, torchrun

WORKER = REPO / "runtime" / "train" / "worker.py"


def run(tmp_path: Path, name: str, ep: int, offload: str) -> list[float]:
    cfg = MoesysConfig(
        model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64, num_experts=4, top_k=1,
                          max_seq_len=32),
        topology=TopologyConfig(nproc_per_node=2, expert_parallel=ep),
        storage=StorageConfig(offload=offload, ssd_path=str(tmp_path / f"ssd-{name}"), cpu_cache_experts=1),
        train=TrainConfig(seq_len=16, micro_batch_size=1, max_steps=4, warmup_steps=1, grad_clip=0.0))
    run_dir = tmp_path / name
    run_dir.mkdir()
    cfg.train = dataclasses.replace(cfg.train, run_dir=str(run_dir))
    save_config(cfg, run_dir / CONFIG)
    proc = torchrun(2, WORKER, str(run_dir), timeout=180)
    assert proc.returncode == 0, proc.stderr[-12000:]
    return [m["loss"] for m in read_metrics(run_dir)]


@pytest.mark.extended
@pytest.mark.parametrize("ep,offload", [(2, "ssd"), (1, "ssd"), (1, "cpu")])
def test_offload_matches_resident_on_two_processes(tmp_path, ep, offload):
    ref = run(tmp_path, "none", ep, "none")
    assert len(ref) == 4
    assert run(tmp_path, offload, ep, offload) == ref
