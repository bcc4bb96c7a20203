"""Normalisation layers: LayerNorm (GPT family), RMSNorm (Mixtral/Llama family, computed in fp32 like HF) and the
query/key RMSNorms of Qwen3-MoE (per head) and OLMoE (over all heads at once)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight; the statistic is taken in fp32 and cast back (HF Mixtral semantics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            # one fused operator (a decode token runs two a layer), equal bit for bit to the expression below:
            # rms_norm upcasts to fp32 and casts back before the weight multiplies
            return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class HeadRMSNorm(RMSNorm):
    """RMSNorm of projected queries or keys x [..., heads * head_dim]: over each head's head_dim values with one
    weight [head_dim] shared by the heads (per_head, Qwen3-MoE), or over all heads * head_dim values at once with a
    weight of that width (OLMoE). Takes and returns the projection's flat layout, so every attention path (a
    sequence, a decode step, batched rows) applies it right after the projection."""

    def __init__(self, heads: int, head_dim: int, eps: float, per_head: bool):
        super().__init__(head_dim if per_head else heads * head_dim, eps)
        self.head_dim, self.per_head = head_dim, per_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.per_head:
            return super().forward(x)
        return super().forward(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)


def qk_norms(cfg: ModelConfig) -> tuple[HeadRMSNorm, HeadRMSNorm] | tuple[None, None]:
    """The (query, key) norms cfg.qk_norm asks for, eps = cfg.norm_eps; (None, None) for none."""
    if cfg.qk_norm == "none":
        return None, None
    if cfg.qk_norm not in ("head", "full"):
        raise ValueError(f"model.qk_norm={cfg.qk_norm!r} is not one of none, head, full")
    per_head, hd, eps = cfg.qk_norm == "head", cfg.head_width, cfg.norm_eps
    return HeadRMSNorm(cfg.num_heads, hd, eps, per_head), HeadRMSNorm(cfg.kv_heads, hd, eps, per_head)


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The norm cfg.norm names: LayerNorm (bias iff cfg.bias) or RMSNorm (weight only), eps = cfg.norm_eps."""
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    raise ValueError(f"model.norm={cfg.norm!r} is not one of layernorm, rmsnorm")
