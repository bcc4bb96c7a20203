"""Shared experts: an FFN every token of an MoE block passes through beside its routed experts, its output added to
theirs (DeepSpeed-MoE's residual MoE, section 4.1; DeepSeekMoE's shared expert isolation), optionally scaled per
token by a sigmoid gate (Qwen2-MoE). Dense parameters: replicated, never dispatched, offloaded or expert-parallel.

Legend: T tokens, D model dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from runtime.config import ModelConfig
from runtime.model.ffn import DenseFFN


class SharedExperts(DenseFFN):
    """DenseFFN of width cfg.shared_expert_hidden_size; with cfg.shared_expert_gate, its output times
    sigmoid(gate x), gate [1, D] without bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.shared_expert_hidden_size)
        self.gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


def shared_experts(cfg: ModelConfig) -> SharedExperts | None:
    """The shared experts of an MoE block, or None when cfg has none."""
    return SharedExperts(cfg) if cfg.shared_expert_hidden_size > 0 else None
