"""Parameter counts from the config equal sum(p.numel()) of the instantiated model; GPT-MoE matches Table 1."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from runtime.config import ModelConfig
from runtime.hf.checkpoint import read_hf_config
from runtime.plan.params import count_parameters
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param

BASE = ModelConfig(hidden_size=32, num_layers=3, num_heads=4, vocab_size=97, num_experts=4, top_k=2, max_seq_len=16)
CASES = {
    "gpt": {},
    "gqa_swiglu_rmsnorm_nobias_untied": dict(num_kv_heads=2, expert_type="swiglu", norm="rmsnorm", bias=False,
                                             position="rope", tie_embeddings=False),
    "every_other_moe": dict(moe_layer_freq=2, ffn_hidden_size=40),
    "swiglu_with_bias": dict(expert_type="swiglu", num_kv_heads=1),
    "layernorm_no_bias": dict(bias=False),
    "qwen3_parts": dict(expert_type="swiglu", norm="rmsnorm", bias=False, position="rope", qk_norm="head",
                        head_dim=16, num_kv_heads=2, moe_layers=[0, 2], dense_ffn_hidden_size=24),
    "olmoe_parts": dict(expert_type="swiglu", norm="rmsnorm", bias=False, position="rope", qk_norm="full",
                        attention_bias="all"),
    "qwen2_parts": dict(expert_type="swiglu", norm="rmsnorm", bias=False, position="rope", attention_bias="qkv",
                        shared_expert_hidden_size=56, shared_expert_gate=True, moe_layer_freq=2),
    "ernie_parts": dict(expert_type="swiglu", norm="rmsnorm", bias=False, position="rope", router_score_bias=True,
                        shared_expert_hidden_size=80, moe_layers=[1, 2]),
}


@pytest.mark.parametrize("case", CASES)
def test_counts_equal_instantiated_model(case):
    cfg = dataclasses.replace(BASE, **CASES[case])
    model = Transformer(cfg)
    counts = count_parameters(cfg)
    named = dict(model.named_parameters())
    assert counts.total == sum(p.numel() for p in named.values())
    assert counts.sparse == sum(p.numel() for n, p in named.items() if is_expert_param(n))
    assert counts.dense == counts.total - counts.sparse
    tok = model.tok_embeddings.weight.numel()
    pos = model.pos_embeddings.weight.numel() if model.pos_embeddings is not None else 0
    head = model.output.weight.numel() if model.output is not None else 0
    assert counts.embedding == tok + pos + head
    assert counts.active == counts.dense + counts.moe_layers * cfg.top_k * counts.per_expert


@pytest.mark.parametrize("experts,billions", [(8, 13.9), (16, 26.8), (32, 52.6), (64, 104.1), (128, 207.2)])
def test_gpt_moe_family_reproduces_table_1(experts, billions):
    cfg = ModelConfig(hidden_size=4096, num_layers=12, num_heads=64, vocab_size=50304, num_experts=experts, top_k=1,
                      max_seq_len=1024)
    assert round(count_parameters(cfg).total / 1e9, 1) == billions


HF_CONFIGS = Path(__file__).parents[2] / "data" / "hf_configs"


@pytest.mark.parametrize("name,billions", [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5)])
def test_counts_from_a_released_config_json_equal_transformers_meta_model(name, billions):
    """The plan's counts from config.json alone (no weights) are transformers' count of the model it builds on the
    meta device; the active count is about the published one (Mixtral 12.9B, Qwen3-30B-A3B 3.3B)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg, _, _ = read_hf_config(HF_CONFIGS / name)
    with torch.device("meta"):
        hf_config = transformers.AutoConfig.from_pretrained(HF_CONFIGS / name)
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    counts = count_parameters(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert round(counts.total / 1e9, 1) == billions
    assert abs(counts.active / 1e9 - {"mixtral-8x7b": 12.9, "qwen3-30b-a3b": 3.3}[name]) < 0.1
