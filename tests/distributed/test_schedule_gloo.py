"""Gradient accumulation, recomputation and offloaded experts under expert parallelism (2 gloo processes) train as one
process does on the same global batch; the AlltoAll dispatch reads its split sizes on the host once a MoE layer and
forward (again when recompute=block runs the forward again), nothing else."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from runtime.config import MoesysConfig, config_from_dict
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step
from tests.distributed.torchrun import torchrun

WORKER = Path(__file__).with_name("_worker_schedule.py")


def config(world: int, ep: int, micro: int, accum: int, recompute: str, offload: str,
           partition: bool = False) -> MoesysConfig:
    cfg = MoesysConfig()
    cfg.model = dataclasses.replace(cfg.model, hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64,
                                    num_experts=4, top_k=2, max_seq_len=32, aux_loss_weight=0.0, bias=False,
                                    embedding_partition=partition)
    cfg.topology = dataclasses.replace(cfg.topology, nproc_per_node=world, expert_parallel=ep)
    cfg.storage = dataclasses.replace(cfg.storage, offload=offload)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=micro, grad_accum_steps=accum, recompute=recompute,
                                    seq_len=16, lr=1e-3)
    return config_from_dict(dataclasses.asdict(cfg))


def single_process(cfg: MoesysConfig, tmp_path) -> list[float]:
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(tmp_path / "single")))
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, torch.device("cpu"))
    losses = []
    for step in range(3):
        loss, _ = forward_backward(c, cfg, groups, step, torch.device("cpu"))
        optimizer_step(c, cfg, groups, step)
        losses.append(float(loss))
    for part in c.parts:
        part.close()
    return losses


@pytest.mark.parametrize("accum,recompute,offload,partition", [
    (2, "none", "none", False), (2, "moe", "cpu", False), (2, "block", "none", False), (2, "none", "ssd", False),
    (2, "moe", "none", True)])
def test_expert_parallel_with_the_split_matches_one_process(tmp_path, accum, recompute, offload, partition):
    dist_cfg = config(2, 2, 2, accum, recompute, offload, partition)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(dataclasses.asdict(dist_cfg)))
    proc = torchrun(2, WORKER, str(cfg_file), str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ref = single_process(config(1, 1, 2 * 2 * accum, 1, "none", "none"), tmp_path)
    dist = [(a + b) / 2 for a, b in zip(reports[0]["loss"], reports[1]["loss"])]
    assert dist == pytest.approx(ref, rel=1e-5, abs=1e-6)
    forwards = accum * (2 if recompute == "block" else 1)
    for r in reports:
        assert r["reads"] == [dist_cfg.model.num_moe_layers * forwards] * 3
        if offload != "none":
            assert r["calls"] == {"take_in": 3 * dist_cfg.model.num_moe_layers, "submit": 3}
