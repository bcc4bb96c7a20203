"""Causal grouped-query self-attention with RoPE (HF Llama/Mixtral rotate_half convention) and a KV cache."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [S, head_dim] in fp32 for integer `positions` [S] (frequencies repeated twice, as HF)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, S, hd] by position; cos/sin [S, hd] are cast to x's dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class KVCache:
    """Keys and values of past positions, one entry per attention layer, for incremental decoding.

    Buffers [B, KV, capacity, hd] are allocated on first use (dtype and device of the keys) and grow by doubling;
    `max_len` preallocates that many positions so generation never reallocates.
    """

    def __init__(self, num_layers: int, max_len: Optional[int] = None):
        self.max_len = max_len
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, KV, S, hd] at positions start_pos.. and return all keys/values up to start_pos + S."""
        end = start_pos + k.shape[2]
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None or buf_k.shape[2] < end or buf_k.shape[0] != k.shape[0]:
            capacity = max(end, self.max_len or 0, 2 * buf_k.shape[2] if buf_k is not None else 0)
            shape = (k.shape[0], k.shape[1], capacity, k.shape[3])
            new_k, new_v = k.new_zeros(shape), v.new_zeros(shape)
            if buf_k is not None and buf_k.shape[0] == k.shape[0]:
                new_k[:, :, : buf_k.shape[2]] = buf_k
                new_v[:, :, : buf_v.shape[2]] = buf_v
            self.keys[layer], self.values[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, start_pos:end] = k
        buf_v[:, :, start_pos:end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]


class Attention(nn.Module):
    """wq [H*hd, D], wk/wv [KV*hd, D], wo [D, H*hd]; biases iff cfg.bias; KV heads repeated for H query heads."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        if cfg.num_heads % cfg.kv_heads:
            raise ValueError(f"model.num_kv_heads={cfg.kv_heads} must divide model.num_heads={cfg.num_heads}")
        self.rope = cfg.position == "rope"
        D, H, KV, hd = cfg.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.wq = nn.Linear(D, H * hd, bias=cfg.bias)
        self.wk = nn.Linear(D, KV * hd, bias=cfg.bias)
        self.wv = nn.Linear(D, KV * hd, bias=cfg.bias)
        self.wo = nn.Linear(H * hd, D, bias=cfg.bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        cache: Optional[KVCache] = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        """x [B, S, D] at positions start_pos..start_pos+S-1 -> [B, S, D]; attends to cached positions too."""
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_index, start_pos, k, v)
        if self.num_kv_heads != self.num_heads:
            repeat = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        past = k.shape[2] - S
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1)
        else:
            # query i sits at position past + i and sees keys 0..past + i
            q_pos = torch.arange(past, past + S, device=x.device)
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))
