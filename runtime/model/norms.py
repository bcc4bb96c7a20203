"""Normalisation layers: LayerNorm (GPT family) and RMSNorm (Mixtral/Llama family, computed in fp32 like HF)."""

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


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The norm cfg.norm names: LayerNorm (bias iff cfg.bias) or RMSNorm (weight only), eps = cfg.norm_eps."""
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    raise ValueError(f"model.norm={cfg.norm!r} is not one of layernorm, rmsnorm")
