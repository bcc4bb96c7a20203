"""The same code on CUDA: MoE layer, training step with NCCL-free single rank, ring inference with a copy stream."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, config_from_dict
from runtime.inference.generate import generate
from runtime.inference.ring import make_offloader
from runtime.model.transformer import Transformer
from runtime.moe.layer import MoELayer
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_moe_layer_matches_cpu():
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2)
    layer = MoELayer(cfg)
    x = torch.randn(256, 64)
    y_cpu, _ = layer(x)
    y_gpu, _ = layer.to(CUDA)(x.to(CUDA))
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_step_on_cuda(precision):
    cfg = MoesysConfig()
    cfg.topology = dataclasses.replace(cfg.topology, nproc_per_node=1, expert_parallel=1)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=2, seq_len=32, precision=precision)
    cfg = config_from_dict(dataclasses.asdict(cfg))
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, CUDA)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    losses = []
    for step in range(3):
        loss, _ = forward_backward(c, cfg, groups, step, CUDA, scaler)
        optimizer_step(c, cfg, groups, step, scaler)
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert next(c.model.parameters()).dtype == torch.float32  # fp32 master weights


def test_ring_matches_resident_on_cuda(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=128, num_experts=4, top_k=2,
                      vocab_size=256, max_seq_len=64)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    tokens = {}
    for mode in ("none", "ondemand", "ring"):
        torch.manual_seed(0)
        model = Transformer(cfg).eval()
        offloader = make_offloader(model, mode, CUDA, ring_slots=2, cache_dir=tmp_path / mode)
        tokens[mode] = generate(model, prompts, 8, offloader=offloader).tokens
    assert tokens["ring"] == tokens["none"] == tokens["ondemand"]
