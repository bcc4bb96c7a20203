"""The dense path captured by torch.export per (batch, sequence) bucket gives the eager model's logits exactly, for
both model families and for blocks with a dense FFN between MoE blocks; other shapes run the eager model."""

import pytest
import torch

from runtime.config import ModelConfig
from runtime.model.transformer import Transformer
from tests.static_graph import StaticDenseModel

GPT = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, ffn_hidden_size=128, num_experts=4, top_k=2,
                  vocab_size=256, max_seq_len=64)
MIXTRAL = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, num_experts=4,
                      top_k=2, vocab_size=256, max_seq_len=64, expert_type="swiglu", norm="rmsnorm", position="rope",
                      bias=False, moe_layer_freq=2, tie_embeddings=False)


@pytest.mark.parametrize("cfg", [GPT, MIXTRAL], ids=["gpt", "mixtral-with-dense-blocks"])
def test_captured_dense_path_equals_eager(cfg):
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    static = StaticDenseModel(model, [(1, 16), (2, 8)])
    assert static.buckets == [(1, 16), (2, 8)]
    for shape in [(1, 16), (2, 8), (3, 5)]:  # two buckets, then a shape that is none: eager
        tokens = torch.randint(0, cfg.vocab_size, shape)
        with torch.no_grad():
            assert torch.equal(static(tokens), model(tokens).logits), shape
    assert all(len(g.attention) == cfg.num_layers for g in static.graphs.values())


def test_a_training_mode_model_is_refused():
    with pytest.raises(ValueError, match="eval mode"):
        StaticDenseModel(Transformer(GPT), [(1, 4)])
