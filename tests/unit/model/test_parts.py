"""The parts released families add, each against a plain reference written here: q/k norms (per head and over all
heads), an explicit head width, attention biases apart from the FFN's, dense blocks of their own width, a listed
MoE/dense pattern, shared experts with and without a sigmoid gate, and the router's score bias. The defaults keep
a model's parameters as they were."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from runtime.config import ModelConfig, MoesysConfig, validate
from runtime.config.checks import ConfigError
from runtime.model.attention import Attention, rope_cos_sin
from runtime.model.transformer import Transformer
from runtime.moe.experts import reference_moe_forward
from runtime.moe.layer import MoELayer

BASE = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, ffn_hidden_size=48,
            num_experts=4, top_k=2, max_seq_len=32, position="rope", norm="rmsnorm", bias=False,
            expert_type="swiglu", tie_embeddings=False)


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter drawn at random (norm weights around 1), so a part left out or misplaced shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return module


def ref_rms(x, weight, eps):
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_attention(att: Attention, cfg: ModelConfig, x):
    """Causal grouped-query attention written out: projections, the q/k norm cfg names, RoPE, softmax."""
    B, S, _ = x.shape
    H, KV, hd = cfg.num_heads, cfg.kv_heads, cfg.head_width
    q, k, v = F.linear(x, att.wq.weight, att.wq.bias), F.linear(x, att.wk.weight, att.wk.bias), \
        F.linear(x, att.wv.weight, att.wv.bias)
    if cfg.qk_norm == "full":
        q, k = ref_rms(q, att.q_norm.weight, cfg.norm_eps), ref_rms(k, att.k_norm.weight, cfg.norm_eps)
    q, k, v = q.view(B, S, H, hd), k.view(B, S, KV, hd), v.view(B, S, KV, hd)
    if cfg.qk_norm == "head":
        q, k = ref_rms(q, att.q_norm.weight, cfg.norm_eps), ref_rms(k, att.k_norm.weight, cfg.norm_eps)
    cos, sin = rope_cos_sin(torch.arange(S), hd, cfg.rope_theta)

    def rot(t):  # t [B, S, heads, hd]
        t1, t2 = t[..., :hd // 2], t[..., hd // 2:]
        return t * cos[:, None] + torch.cat((-t2, t1), -1) * sin[:, None]

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, S, H * hd)
    return F.linear(out, att.wo.weight, att.wo.bias)


@pytest.mark.parametrize("parts", [
    dict(qk_norm="head", head_dim=16),  # Qwen3-MoE: per-head norms, a head width apart from hidden / heads
    dict(qk_norm="full"),  # OLMoE: one norm over all heads' values
    dict(attention_bias="qkv"),  # Qwen2-MoE: query/key/value biases, none on the output
    dict(attention_bias="all", qk_norm="head"),
], ids=["qk-head-hd16", "qk-full", "qkv-bias", "all-bias-qk-head"])
def test_attention_parts_equal_the_written_out_attention(parts):
    cfg = ModelConfig(**{**BASE, **parts})
    att = randomized(Attention(cfg, 0))
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    rope = rope_cos_sin(torch.arange(7), cfg.head_width, cfg.rope_theta)
    torch.testing.assert_close(att(x, rope), ref_attention(att, cfg, x), rtol=1e-5, atol=1e-5)
    assert (att.wq.bias is not None) == (cfg.attention_bias in ("qkv", "all"))
    assert (att.wo.bias is not None) == (cfg.attention_bias == "all")
    assert att.wq.weight.shape == (cfg.num_heads * cfg.head_width, cfg.hidden_size)


def ref_swiglu(x, w1, w2, w3):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts_add_their_ffn_to_the_routed_experts(gate):
    cfg = ModelConfig(**BASE, shared_expert_hidden_size=40, shared_expert_gate=gate)
    layer = randomized(MoELayer(cfg))
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    y, _ = layer(x)
    r = layer.router(x)
    e = layer.experts
    routed = reference_moe_forward(x, r.expert_ids_TK, r.weights_TK, e.w1, e.w2, e.w3, kind="swiglu")
    s = layer.shared_experts
    shared = ref_swiglu(x, s.w1.weight, s.w2.weight, s.w3.weight)
    if gate:
        shared = torch.sigmoid(x @ s.gate.weight.t()) * shared
    torch.testing.assert_close(y, routed + shared, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(layer.eval().decode(x[:1]), y[:1], rtol=1e-5, atol=1e-5)
    assert s.w1.weight.shape == (40, cfg.hidden_size) and (s.gate is not None) == gate


def test_router_score_bias_moves_the_choice_but_not_the_weights():
    cfg = ModelConfig(**{**BASE, "num_experts": 6, "top_k": 2}, router_score_bias=True, normalize_top_k=True)
    layer = randomized(MoELayer(cfg))
    assert not layer.router.score_bias.requires_grad
    with torch.no_grad():
        layer.router.score_bias.copy_(torch.tensor([0.0, 0.5, 0.0, -0.5, 0.3, 0.0]))
    x = torch.randn(50, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    routing = layer.router(x)
    probs = torch.softmax(x @ layer.router.gate.weight.t(), dim=-1)
    chosen = torch.topk(probs + layer.router.score_bias, 2, dim=-1).indices
    weights = probs.gather(1, chosen)
    assert torch.equal(routing.expert_ids_TK, chosen)
    torch.testing.assert_close(routing.weights_TK, weights / weights.sum(-1, keepdim=True))
    assert not torch.equal(chosen, torch.topk(probs, 2, dim=-1).indices)  # the bias did move some choices


def test_listed_moe_layers_and_the_dense_width():
    cfg = ModelConfig(**{**BASE, "num_layers": 4}, moe_layers=[1, 2], dense_ffn_hidden_size=24)
    model = Transformer(cfg)
    assert [b.is_moe for b in model.layers] == [False, True, True, False]
    assert model.layers[0].ffn.w1.weight.shape == (24, cfg.hidden_size)
    assert model.layers[1].ffn.experts.w1.shape == (4, 48, cfg.hidden_size)
    assert cfg.num_moe_layers == 2


def test_defaults_keep_the_parameters_of_a_model_as_they_were():
    model = Transformer(ModelConfig(**BASE))
    names = {n for n, _ in model.named_parameters()}
    assert not any("norm" in n and "attention." in n for n in names)  # no q/k norms
    assert not any("shared" in n or "score_bias" in n for n in names)
    assert "layers.0.attention.wq.bias" not in names


@pytest.mark.parametrize("parts,message", [
    (dict(moe_layers=[0, 5]), "model.moe_layers names block 5, outside 0..1"),
    (dict(moe_layers=[1], moe_layer_freq=2), "model.moe_layers and model.moe_layer_freq=2 both choose"),
    (dict(shared_expert_gate=True), "model.shared_expert_gate=true needs a shared expert"),
    (dict(router_score_bias=True, router_gumbel=True), "model.router_score_bias=true and model.router_gumbel=true"),
    (dict(qk_norm="rms"), "model.qk_norm='rms' is not one of none, head, full"),
    (dict(attention_bias="qk"), "model.attention_bias='qk' is not one of none, qkv, all, null"),
    (dict(family="llama"), "model.family='llama' is not one of mixtral, qwen2_moe"),
])
def test_validation_names_the_key(parts, message):
    cfg = MoesysConfig(model=ModelConfig(**BASE, **parts))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, packages=False)
