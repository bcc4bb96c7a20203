"""Dynamic loss scaling: the scale follows torch.amp.GradScaler's (the reference) through overflows and growth,
and an overflow in any part's gradients, offloaded experts on the CPU included, skips the whole step."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TrainConfig
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step
from runtime.train.loss_scale import DynamicLossScale

CPU = torch.device("cpu")


def test_the_scale_follows_torch_grad_scaler():
    ours = DynamicLossScale(init=1024.0, interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    for overflow in [False, False, True, False, False, False, False, True, True, False]:
        theirs.scale(torch.ones(()))
        param.grad = torch.tensor([math.inf if overflow else 1.0])
        theirs.step(optimizer)
        theirs.update()
        applied = ours.update(math.inf if overflow else 1.0)
        assert applied != overflow
        assert ours.value == theirs.get_scale()


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_an_overflow_skips_the_step_on_every_part_and_halves_the_scale(tmp_path, offload):
    cfg = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, max_seq_len=32),
                       storage=StorageConfig(offload=offload),
                       train=TrainConfig(seq_len=16, micro_batch_size=2, precision="fp16", run_dir=str(tmp_path)))
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, CPU)
    before = {n: p.detach().clone() for n, p in c.model.named_parameters()}
    scaler = DynamicLossScale(init=2.0 ** 100)  # every fp16 gradient overflows
    forward_backward(c, cfg, groups, 0, CPU, scaler)
    norm = optimizer_step(c, cfg, groups, 0, scaler)
    assert not math.isfinite(norm) and scaler.value == 2.0 ** 99
    assert all(torch.equal(p, before[n]) for n, p in c.model.named_parameters())  # nothing applied
    if c.offload is not None:
        c.offload.drain()
        slot = c.offload.home.checkpoint_slot((0, 0))
        assert float(slot.step) == 0 and not slot.exp_avg.any()  # the offloaded experts were not stepped either
    scaler.value = 2.0 ** 10
    forward_backward(c, cfg, groups, 1, CPU, scaler)
    assert math.isfinite(optimizer_step(c, cfg, groups, 1, scaler))
    assert any(not torch.equal(p, before[n]) for n, p in c.model.named_parameters())
    for part in c.parts:
        part.close()
