"""The dense feed-forward block: the same maths and shapes as one MoE expert (gelu for GPT, SwiGLU for Mixtral)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig


class DenseFFN(nn.Module):
    """gelu: w2(gelu(w1 x + b1)) + b2.  swiglu: w2(silu(w1 x) * w3 x) (+ biases iff cfg.bias), of width `width`
    (default: a dense block's, cfg.dense_ffn_size)."""

    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        if cfg.expert_type not in ("gelu", "swiglu"):
            raise ValueError(f"model.expert_type={cfg.expert_type!r} is not one of gelu, swiglu")
        self.swiglu = cfg.expert_type == "swiglu"
        D, Fh = cfg.hidden_size, width or cfg.dense_ffn_size
        self.w1 = nn.Linear(D, Fh, bias=cfg.bias)
        self.w2 = nn.Linear(Fh, D, bias=cfg.bias)
        self.w3 = nn.Linear(D, Fh, bias=cfg.bias) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:  # swiglu
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))
