"""train.recompute: the same gradients as keeping every activation (the same operators on the same inputs, again),
resident and offloaded; and the memory a step allocates falls by what the plan says it saves (measured by torch's
profiler on the allocator, within 20%)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.moe.activations import activation_pool
from runtime.parallel.groups import build_groups
from runtime.plan.step_memory import activation_bytes
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step

CPU = torch.device("cpu")
GPT = dict(expert_type="gelu", norm="layernorm", position="learned", bias=True)
MIXTRAL = dict(expert_type="swiglu", norm="rmsnorm", position="rope", bias=False)


def config(recompute: str, offload: str = "none", run_dir=None, **model) -> MoesysConfig:
    m = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64, num_experts=4, top_k=2,
                    max_seq_len=32, router_jitter=0.1, **model)
    return MoesysConfig(model=m, topology=TopologyConfig(nproc_per_node=1, expert_parallel=1),
                        storage=StorageConfig(offload=offload),
                        train=TrainConfig(seq_len=16, micro_batch_size=4, recompute=recompute,
                                          run_dir=str(run_dir) if run_dir else None))


def gradients(cfg: MoesysConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two steps' losses and the second step's gradients (router jitter on: the recomputation must replay the
    random numbers of the forward it repeats)."""
    groups = build_groups(1, 0, 1, 1)
    torch.manual_seed(7)
    c = build_components(cfg, groups, CPU)
    losses = []
    for step in range(2):
        loss, _ = forward_backward(c, cfg, groups, step, CPU)
        losses.append(float(loss))
        grads = {n: p.grad.clone() for n, p in c.model.named_parameters() if p.grad is not None}
        optimizer_step(c, cfg, groups, step)
    for part in c.parts:
        part.close()
    return losses, grads


@pytest.mark.parametrize("family", [GPT, MIXTRAL], ids=["gpt", "mixtral"])
@pytest.mark.parametrize("recompute", ["moe", "block"])
def test_recomputation_gives_the_same_gradients(family, recompute):
    ref_losses, ref = gradients(config("none", **family))
    losses, got = gradients(config(recompute, **family))
    assert losses == ref_losses
    assert set(got) == set(ref)
    for name, grad in ref.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_offloaded_experts_recompute_their_ffn_with_the_same_numbers(tmp_path):
    ref_losses, ref = gradients(config("none", "cpu", tmp_path / "a", **MIXTRAL))
    losses, got = gradients(config("moe", "cpu", tmp_path / "b", **MIXTRAL))
    assert losses == ref_losses
    for name, grad in ref.items():  # the resident part's gradients (the experts' live on the host)
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def measured_peak(cfg: MoesysConfig) -> int:
    """Peak bytes the allocator held during a first forward and backward (buffer pools empty, so their buffers
    count when made), from the profiler's per-operator allocations and frees in time order."""
    c = build_components(cfg, build_groups(1, 0, 1, 1), CPU)
    activation_pool.clear()  # its free buffers count when a step takes them again
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = c.model(tokens[:, :-1])
        F.cross_entropy(out.logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("recompute", ["moe", "block"])
def test_the_activation_peak_falls_by_what_the_plan_says(recompute):
    model = ModelConfig(hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=512, num_experts=4, top_k=2,
                        max_seq_len=256, vocab_size=256)
    base = MoesysConfig(model=model, topology=TopologyConfig(nproc_per_node=1, expert_parallel=1),
                        train=TrainConfig(micro_batch_size=8, seq_len=256))
    other = dataclasses.replace(base, train=dataclasses.replace(base.train, recompute=recompute))
    planned = activation_bytes(base) - activation_bytes(other)
    measured = measured_peak(base) - measured_peak(other)
    assert planned > 0.3 * activation_bytes(base)
    assert measured == pytest.approx(planned, rel=0.2)
