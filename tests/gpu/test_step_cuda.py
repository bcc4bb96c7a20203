"""The training step on a GPU: micro-batches of offloaded experts equal the large batch and cross home once a step
(the CUDA path: device sums, pinned staging, the side stream), and the resident step between metrics lines makes no
synchronising call (torch.cuda's sync debug mode raises on one)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step, update
from runtime.train.meter import StepMeter

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def config(run_dir, micro: int, accum: int, offload: str, precision: str = "fp32") -> MoesysConfig:
    return MoesysConfig(model=ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_experts=4, top_k=2,
                                          max_seq_len=32, aux_loss_weight=0.0, bias=False),
                        topology=TopologyConfig(gpus_per_node=1, gpu_memory_gb=16, nproc_per_node=1),
                        storage=StorageConfig(offload=offload),
                        train=TrainConfig(seq_len=16, micro_batch_size=micro, grad_accum_steps=accum, lr=1e-3,
                                          precision=precision, run_dir=str(run_dir)))


def test_offloaded_micro_batches_on_cuda_equal_the_large_batch_and_go_home_once(tmp_path):
    runs = {}
    for name, micro, accum in (("large", 8, 1), ("accum", 2, 4)):
        cfg = config(tmp_path / name, micro, accum, "cpu")
        groups = build_groups(1, 0, 1, 1)
        c = build_components(cfg, groups, CUDA)
        losses = []
        for step in range(3):
            loss, _ = forward_backward(c, cfg, groups, step, CUDA)
            optimizer_step(c, cfg, groups, step)
            losses.append(float(loss))
        c.offload.wait_step()
        runs[name] = (losses, dict(c.offload.optimizer.calls), c.offload.transfers.grads_sent)
        c.offload.close()
    assert runs["accum"][0] == pytest.approx(runs["large"][0], rel=1e-5, abs=1e-6)
    assert runs["accum"][1] == {"take_in": 6, "submit": 3} and runs["accum"][2] == 6


def test_the_resident_step_between_metrics_lines_does_not_synchronise(tmp_path):
    cfg = config(tmp_path, 4, 2, "none", precision="bf16")
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, CUDA)
    meter = StepMeter()
    for step in range(2):  # kernels chosen, the optimizer's states made
        forward_backward(c, cfg, groups, step, CUDA)
        update(c, cfg, groups, step, check=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2, 5):
            loss, out = forward_backward(c, cfg, groups, step, CUDA)
            meter.add_step(step + 1, loss, out)
            meter.add_norm(step + 1, update(c, cfg, groups, step, check=False))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert meter.first_bad()[0] == 0 and meter.count == 3
