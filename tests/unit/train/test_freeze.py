"""train.freeze: the named parameter sets are disjoint and hold what their names say; a frozen parameter never
changes and has no optimizer state; frozen offloaded experts (cpu, ssd) train to the resident frozen model's losses
with no moments in their home, no gradient brought home and nothing written back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import runtime.train.loop as loop
from runtime.config import ConfigError, ModelConfig, MoesysConfig, StorageConfig, TrainConfig, validate
from runtime.files.run_dir import read_metrics
from runtime.model.transformer import Transformer
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.freeze import PATTERNS, parameter_set

CPU = torch.device("cpu")
GROUPS = build_groups(1, 0, 1, 1)
EVERY_PART = ModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=16,
                         dense_ffn_hidden_size=24, num_experts=4, top_k=2, expert_type="swiglu", norm="rmsnorm",
                         qk_norm="head", bias=False, attention_bias="qkv", position="rope", tie_embeddings=False,
                         moe_layers=[1, 2], shared_expert_hidden_size=16, shared_expert_gate=True, max_seq_len=32)
GPT_STYLE = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2, max_seq_len=32)


def names(cfg: ModelConfig) -> list[str]:
    with torch.device("meta"):
        return [n for n, _ in Transformer(cfg).named_parameters()]


def test_each_set_holds_what_its_name_says():
    sets = {n: parameter_set(n) for n in names(EVERY_PART) + names(GPT_STYLE)}
    by_set = {s: sorted({n for n, got in sets.items() if got == s}) for s in PATTERNS}
    assert by_set["embeddings"] == ["output.weight", "pos_embeddings.weight", "tok_embeddings.weight"]
    assert "layers.1.attention.q_norm.weight" in by_set["norms"] and "norm.weight" in by_set["norms"]
    assert "layers.0.attention_norm.bias" in by_set["norms"]  # LayerNorm's bias is a norm's
    assert "layers.0.attention.wq.bias" in by_set["attention"] and "layers.1.attention.wo.weight" in by_set["attention"]
    assert by_set["router"] == ["layers.0.ffn.router.gate.weight", "layers.1.ffn.router.gate.weight",
                                "layers.2.ffn.router.gate.weight"]
    assert "layers.1.ffn.experts.w3" in by_set["experts"] and "layers.0.ffn.experts.b1" in by_set["experts"]
    assert "layers.2.ffn.shared_experts.gate.weight" in by_set["shared_experts"]
    assert {n for n, got in sets.items() if got is None} == {"layers.0.ffn.w1.weight", "layers.0.ffn.w2.weight",
                                                            "layers.0.ffn.w3.weight"}  # the dense block's FFN


def step_once(c, cfg, step: int) -> None:
    loop.forward_backward(c, cfg, GROUPS, step, CPU)
    loop.optimizer_step(c, cfg, GROUPS, step)


def test_frozen_parameters_do_not_move_and_have_no_optimizer_state():
    freeze = ["router", "attention", "norms", "embeddings"]
    cfg = MoesysConfig(model=EVERY_PART, train=TrainConfig(seq_len=16, micro_batch_size=2, freeze=freeze,
                                                           warmup_steps=0))
    c = build_components(cfg, GROUPS, CPU)
    before = {n: p.detach().clone() for n, p in c.model.named_parameters()}
    for step in range(3):
        step_once(c, cfg, step)
    stateful = {id(p) for p in c.optimizer.state}
    for name, param in c.model.named_parameters():
        frozen = parameter_set(name) in freeze
        assert torch.equal(param, before[name]) == frozen, name
        assert (id(param) in stateful) == (not frozen), name
    trained = sum(p.numel() for p in c.model.parameters() if p.requires_grad)
    moments = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in c.optimizer.state.values())
    assert moments == 2 * trained < 2 * sum(p.numel() for p in c.model.parameters())


def offload_config(tmp_path, offload: str, freeze: list[str]) -> MoesysConfig:
    return MoesysConfig(
        model=dataclasses.replace(EVERY_PART, moe_layers=None, dense_ffn_hidden_size=None, num_layers=2),
        storage=StorageConfig(offload=offload, ssd_path=str(tmp_path / f"ssd-{offload}-{len(freeze)}"),
                              cpu_cache_experts=3),
        train=TrainConfig(seq_len=16, micro_batch_size=2, max_steps=4, warmup_steps=1, grad_clip=0.0,
                          checkpoint_every=0, freeze=freeze))


def run(tmp_path, offload: str, freeze: list[str]) -> list[dict]:
    run_dir = tmp_path / f"{offload}-{'-'.join(freeze) or 'none'}"
    run_dir.mkdir()
    loop.train(offload_config(tmp_path, offload, freeze), run_dir, GROUPS, CPU)
    return read_metrics(run_dir)


@pytest.mark.parametrize("offload", ["cpu", "ssd"])
def test_frozen_offloaded_experts_keep_no_moments_and_move_no_gradients(tmp_path, offload):
    resident = run(tmp_path, "none", ["experts"])
    frozen = run(tmp_path, offload, ["experts"])
    trained = run(tmp_path, offload, [])
    assert [m["loss"] for m in frozen] == [m["loss"] for m in resident]
    assert [m["loss"] for m in trained] != [m["loss"] for m in frozen]
    assert all(m["offload/grad_home_bytes"] == 0 for m in frozen) and all(m["offload/grad_home_bytes"] > 0 for m in trained)
    assert all(m["offload/catch_up_steps"] == 0 for m in frozen)
    if offload == "ssd":  # unchanged experts are never written back; their files hold weights and a step only
        assert sum(m["offload/ssd_write_bytes"] for m in frozen) == 0
        assert sum(m["offload/ssd_write_bytes"] for m in trained[1:]) > 0
        assert frozen[-1]["offload/ssd_used_bytes"] * 3 == pytest.approx(trained[-1]["offload/ssd_used_bytes"],
                                                                         rel=0.01)
    else:  # host memory: 4 bytes per expert parameter instead of 12
        assert frozen[-1]["offload/host_used_bytes"] * 3 == pytest.approx(trained[-1]["offload/host_used_bytes"],
                                                                          rel=0.01)


@pytest.mark.parametrize("edit,says", [
    (dict(train=TrainConfig(freeze=["experts", "routers"])), "'routers' is not one of router, attention"),
    (dict(train=TrainConfig(freeze=["norms", "norms"])), "names a set twice"),
])
def test_bad_freeze_lists_are_refused_naming_the_key(edit, says):
    with pytest.raises(ConfigError, match=says):
        validate(MoesysConfig(**edit))
