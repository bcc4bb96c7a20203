"""A row of packed samples: with positions restarting in each sample and the segments numbering them, every
sample's logits are those it gets alone (attention does not cross samples: a block-diagonal causal mask), for RoPE
and learned positions; plain reference: each sample through the model by itself."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig
from runtime.model.attention import segment_mask
from runtime.model.transformer import Transformer

ROPE = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                   expert_type="swiglu", norm="rmsnorm", qk_norm="head", bias=False, position="rope",
                   tie_embeddings=False, max_seq_len=64)
LEARNED = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2, max_seq_len=64)


def test_segment_mask_is_block_diagonal_and_causal():
    mask = segment_mask(torch.tensor([[0, 0, 1, 1, 1, 2]]))[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


@pytest.mark.parametrize("cfg", [ROPE, LEARNED], ids=["rope", "learned"])
def test_each_packed_sample_gets_its_own_logits(cfg):
    model = Transformer(cfg, seed=3).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [(7, 9, 4), (20,), (3, 3, 3, 3, 3)]
    width = max(sum(row) for row in lengths) + 2
    tokens = torch.randint(0, cfg.vocab_size, (len(lengths), width), generator=gen)
    positions = torch.zeros_like(tokens)
    segments = torch.full_like(tokens, 99)
    for b, row in enumerate(lengths):
        at = 0
        for s, n in enumerate(row):
            positions[b, at:at + n] = torch.arange(n)
            segments[b, at:at + n] = s
            at += n
    with torch.no_grad():
        packed = model(tokens, positions=positions, segments=segments).logits
        for b, row in enumerate(lengths):
            at = 0
            for n in row:
                alone = model(tokens[b:b + 1, at:at + n]).logits[0]
                assert (packed[b, at:at + n] - alone).abs().max().item() <= 1e-5
                at += n
