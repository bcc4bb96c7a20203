"""Causal grouped-query self-attention with RoPE (HF Llama/Mixtral rotate_half convention) and a static KV cache
that prefill fills and a decode step writes by a position held on the device (gpt-fast's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig
from runtime.model import cpu_gemv
from runtime.model.norms import HeadRMSNorm, qk_norms


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [..., head_dim] in fp32 for integer `positions` [...] ([S], or [B, S] for rows whose
    positions restart; frequencies repeated twice, as HF)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for a decode step's rows: one row through `cpu_gemv` (aten's numbers, faster on a CPU)."""
    return cpu_gemv.linear(x, layer.weight, layer.bias)


def decode_rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos and signed sin [S, head_dim] in `dtype` for `rotate`: sin with its first half negated, so that
    rotate_half(x) * sin == x.roll(half) * signed sin (negation rounds symmetrically: equal bit for bit)."""
    cos, sin = rope_cos_sin(positions, head_dim, theta)
    half = head_dim // 2
    return cos.to(dtype), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """apply_rope in four operators, with cos and signed sin from `decode_rope` already in x's dtype."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, S, hd] by position; cos/sin [S, hd] (or [B, 1, S, hd]) are cast to x's dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class StaticKVCache(nn.Module):
    """Keys and values of every attention layer in buffers [B, KV, capacity, hd] allocated once (module buffers:
    CUDA graphs see fixed addresses).

    Prefill writes positions 0..S-1 through `update`. A decode step writes its position by index (`write`, the
    position a device tensor) and attends to the whole buffer under `mask`: its shapes never change and nothing is
    read on the host, so one compiled step serves every position.
    """

    slots: torch.Tensor
    cos: torch.Tensor | None
    signed_sin: torch.Tensor | None

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, rope_theta: float | None = None):
        """rope_theta: also keep `decode_rope`'s table of every slot (RoPE models), so a step looks its position up."""
        super().__init__()
        shape = (batch, kv_heads, capacity, head_dim)
        self.num_layers, self.capacity = num_layers, capacity
        for layer in range(num_layers):
            self.register_buffer(f"k{layer}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v{layer}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("slots", torch.arange(capacity, device=device), persistent=False)
        cos, signed_sin = decode_rope(self.slots, head_dim, rope_theta, dtype) if rope_theta else (None, None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("signed_sin", signed_sin, persistent=False)

    @property
    def keys(self) -> list[torch.Tensor]:
        return [getattr(self, f"k{layer}") for layer in range(self.num_layers)]

    @property
    def values(self) -> list[torch.Tensor]:
        return [getattr(self, f"v{layer}") for layer in range(self.num_layers)]

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, KV, S, hd] at start_pos.. and return keys/values up to start_pos + S."""
        end = start_pos + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"positions up to {end} exceed the static KV cache's {self.capacity}")
        buf_k, buf_v = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        buf_k[:, :, start_pos:end] = k
        buf_v[:, :, start_pos:end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def write(self, layer: int, pos_S: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store k, v [B, KV, S, hd] at positions pos_S (a device tensor): the same S positions in every row, or, for
        one new position per row (S = 1, pos_B of B entries; or rows 0..B-1 of a larger batch's cache), row b's at
        pos_B[b]. The whole buffers, for `mask`."""
        buf_k, buf_v = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        if pos_S.numel() != k.shape[2] or buf_k.shape[0] != k.shape[0]:  # a position per row: continuous batching
            rows_B = torch.arange(k.shape[0], device=k.device)
            buf_k[rows_B, :, pos_S] = k[:, :, 0]
            buf_v[rows_B, :, pos_S] = v[:, :, 0]
            return buf_k, buf_v
        buf_k.index_copy_(2, pos_S, k)
        buf_v.index_copy_(2, pos_S, v)
        return buf_k, buf_v

    def rope(self, pos_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [S, hd] of positions pos_S, for `rotate`."""
        if self.cos is None or self.signed_sin is None:
            raise RuntimeError("this cache keeps no rotary tables: it was made without rope_theta")
        return self.cos.index_select(0, pos_S), self.signed_sin.index_select(0, pos_S)

    def mask(self, pos_S: torch.Tensor) -> torch.Tensor:
        """[S, capacity] bool: the query at position p sees slots 0..p (later slots hold stale or no keys)."""
        return self.slots <= pos_S[:, None]


def segment_mask(segments_BS: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i attends to key j when j <= i and both lie in the same segment (sample) of their
    row: causal attention that does not cross the samples packed into a row (a block-diagonal mask)."""
    S = segments_BS.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=segments_BS.device).tril()
    return ((segments_BS[:, :, None] == segments_BS[:, None, :]) & causal)[:, None]


class Attention(nn.Module):
    """wq [H*hd, D], wk/wv [KV*hd, D], wo [D, H*hd] (biases as cfg.qkv_bias and cfg.out_bias); queries and keys
    normalised after their projection when cfg.qk_norm asks; KV heads repeated for H query heads."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_width
        if cfg.num_heads % cfg.kv_heads:
            raise ValueError(f"model.num_kv_heads={cfg.kv_heads} must divide model.num_heads={cfg.num_heads}")
        self.rope = cfg.position == "rope"
        D, H, KV, hd = cfg.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.wq = nn.Linear(D, H * hd, bias=cfg.qkv_bias)
        self.wk = nn.Linear(D, KV * hd, bias=cfg.qkv_bias)
        self.wv = nn.Linear(D, KV * hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(H * hd, D, bias=cfg.out_bias)
        self.q_norm: HeadRMSNorm | None
        self.k_norm: HeadRMSNorm | None
        self.q_norm, self.k_norm = qk_norms(cfg)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected queries [..., H*hd] and keys [..., KV*hd] through the q/k norms (as they are without them)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: StaticKVCache | None = None,
        start_pos: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, S, D] at positions start_pos..start_pos+S-1 -> [B, S, D]; attends to cached positions too. `mask`
        [B, 1, S, S] bool (True: attend), without a cache: replaces the causal mask (packed samples')."""
        B, S, _ = x.shape
        q, k = self.norm_qk(self.wq(x), self.wk(x))
        q = q.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            assert rope is not None, "rotary attention is given its (cos, sin)"
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_index, start_pos, k, v)
        if self.num_kv_heads != self.num_heads:
            repeat = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        past = k.shape[2] - S
        if mask is not None and past == 0:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1)
        else:
            # query i sits at position past + i and sees keys 0..past + i
            q_pos = torch.arange(past, past + S, device=x.device)
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))

    def decode(self, x_B1D: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache: StaticKVCache,
               pos_1: torch.Tensor, mask_1L: torch.Tensor) -> torch.Tensor:
        """One new position per row: x [B, 1, D] at position pos_1 (a device tensor) -> [B, 1, D], against the
        static cache's whole buffers. rope is (cos, signed sin) from `decode_rope`. A KV head's query heads are its
        query rows, so grouped-query attention reads the cache without repeating it."""
        B = x_B1D.shape[0]
        KV, hd = self.num_kv_heads, self.head_dim
        group = self.num_heads // KV
        q, k = self.norm_qk(_linear(self.wq, x_B1D), _linear(self.wk, x_B1D))
        q = q.view(B, KV, group, hd)  # [B, 1, H*hd] holds heads in order h = kv * group + g
        k = k.view(B, KV, 1, hd)
        v = _linear(self.wv, x_B1D).view(B, KV, 1, hd)
        if self.rope:
            assert rope is not None, "rotary attention is given its (cos, signed sin)"
            q, k = rotate(torch.cat((q, k), dim=2), *rope).split((group, 1), dim=2)
        keys, values = cache.write(self.layer_index, pos_1, k, v)
        keys, values = keys[:B], values[:B]  # rows 0..B-1 of a larger batch's cache (continuous batching)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_1L)
        return _linear(self.wo, out.reshape(B, 1, self.num_heads * hd))
