"""Attention pieces: RoPE is relative, grouped-query attention equals an explicit reference."""

from __future__ import annotations

import math

import torch

from runtime.config import ModelConfig
from runtime.model.attention import Attention, apply_rope, rope_cos_sin


def test_rope_scores_depend_only_on_the_position_difference():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    cos, sin = rope_cos_sin(torch.arange(40), 16, 10000.0)

    def score(m, n):
        return (apply_rope(q, cos[m:m + 1], sin[m:m + 1]) * apply_rope(k, cos[n:n + 1], sin[n:n + 1])).sum()

    torch.testing.assert_close(score(5, 2), score(30, 27), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 3))
    torch.testing.assert_close(score(0, 0), (q * k).sum())


def test_grouped_query_attention_matches_an_explicit_reference():
    cfg = ModelConfig(hidden_size=32, num_heads=4, num_kv_heads=2, position="learned", bias=True)
    torch.manual_seed(0)
    attn = Attention(cfg, 0)
    x = torch.randn(2, 6, 32)
    B, S, H, KV, hd = 2, 6, 4, 2, 8
    q = attn.wq(x).view(B, S, H, hd)
    k = attn.wk(x).view(B, S, KV, hd)
    v = attn.wv(x).view(B, S, KV, hd)
    heads = []
    for h in range(H):
        kv = h // (H // KV)  # query head h reads kv head h // group (HF repeat_kv layout)
        s = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(hd)
        s = s.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), 1), float("-inf"))
        heads.append(s.softmax(-1) @ v[:, :, kv])
    ref = attn.wo(torch.stack(heads, dim=2).reshape(B, S, H * hd))
    torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-5)
