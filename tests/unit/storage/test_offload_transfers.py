"""Bytes an offloaded step moves to the device: each active expert once per step, in the compute dtype, while the
device budget (the plan's window of layers) holds the step's active experts; fetched again for its backward only
when the window is smaller than the model."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TrainConfig
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step

CPU = torch.device("cpu")


def train(tmp_path, precision: str, prefetch_depth: int, steps: int = 3) -> tuple[list[dict], int]:
    """Per-step offload metrics of a 2-MoE-layer model with experts on SSD, and one expert's slot elements."""
    cfg = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
                                         ffn_hidden_size=64, max_seq_len=32),
                       storage=StorageConfig(offload="ssd", cpu_cache_experts=8, prefetch_depth=prefetch_depth),
                       train=TrainConfig(seq_len=16, micro_batch_size=2, precision=precision, run_dir=str(tmp_path)))
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, CPU)
    metrics = []
    for step in range(steps):
        forward_backward(c, cfg, groups, step, CPU)
        optimizer_step(c, cfg, groups, step)
        metrics.append(c.offload.step_metrics())
    numel = c.offload.specs[0].layout.numel
    c.offload.close()
    return metrics, numel


@pytest.mark.parametrize("precision,width", [("bf16", 2), ("fp32", 4)])
def test_each_active_expert_goes_to_the_device_once_a_step_in_the_compute_dtype(tmp_path, precision, width):
    metrics, numel = train(tmp_path, precision, prefetch_depth=1)  # a window of 2 layers: the whole model
    for m in metrics:
        assert m["offload/experts_active"] == 8
        assert m["offload/device_in_bytes"] == m["offload/experts_active"] * numel * width
        assert m["offload/copied_bytes"] == m["offload/device_in_bytes"]  # no gradient copy without a GPU


def test_a_window_smaller_than_the_model_fetches_the_evicted_layer_again_for_its_backward(tmp_path):
    metrics, numel = train(tmp_path, "bf16", prefetch_depth=0)  # a window of 1 layer: layer 0 is evicted
    for m in metrics:
        one_layer = 4 * numel * 2
        assert m["offload/device_in_bytes"] == 3 * one_layer  # layer 0 twice, layer 1 once
        assert m["offload/device_peak_bytes"] == one_layer
