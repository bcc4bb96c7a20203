"""`make_offloader`'s budget checks: auto (the default) takes any budget of at least one slot, keeping every layer
resident when it covers them all, and runs a model without MoE layers as none; ring and ondemand keep their
checks. Every placement gives the logits of the resident model."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.config import ModelConfig
from runtime.inference.errors import InferError
from runtime.inference.offloaders import make_offloader
from runtime.model.transformer import Transformer

CPU = torch.device("cpu")
ONE_MOE = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, vocab_size=64, ffn_hidden_size=64, num_experts=4,
                      top_k=2, max_seq_len=16, moe_layer_freq=2)
NO_MOE = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, vocab_size=64, ffn_hidden_size=64, num_experts=0,
                     max_seq_len=16)
IDS = torch.tensor([[1, 5, 9, 3, 7]])


def model(cfg: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def logits(m: Transformer) -> torch.Tensor:
    with torch.no_grad():
        return m(IDS).logits


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_auto_on_one_moe_layer_takes_any_budget_and_keeps_it_resident(slots):
    reference = model(ONE_MOE)
    placed = copy.deepcopy(reference)
    off = make_offloader(placed, "auto", CPU, slots)
    try:
        assert off.stats()["placement"] == ["resident"] and off.num_slots == 1
        torch.testing.assert_close(logits(placed), logits(reference))
    finally:
        off.close()


def test_auto_on_a_model_without_moe_layers_is_none():
    reference = model(NO_MOE)
    placed = copy.deepcopy(reference)
    off = make_offloader(placed, "auto", CPU, 2)
    try:
        assert off.mode == "none" and off.stats()["placement"] == []
        torch.testing.assert_close(logits(placed), logits(reference))
    finally:
        off.close()


@pytest.mark.parametrize("cfg,mode,slots,message", [
    (ONE_MOE, "auto", 0, "infer.ring_slots=0 must be at least 1"),
    (ONE_MOE, "ring", 2, "infer.ring_slots=2 must be between 1 and the model's 1 MoE layers"),
    (NO_MOE, "ring", 1, "the model has no MoE layers to offload; use --offload none"),
    (NO_MOE, "ondemand", 1, "the model has no MoE layers to offload; use --offload none"),
])
def test_ring_and_ondemand_keep_their_checks(cfg, mode, slots, message):
    with pytest.raises(InferError, match=message) as exc:
        make_offloader(model(cfg), mode, CPU, slots)
    assert "\n" not in str(exc.value)
