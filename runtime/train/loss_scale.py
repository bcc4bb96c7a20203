"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training"; the paper trains
its GPT-MoE models this way), with torch.amp.GradScaler's numbers.

The overflow check is the global gradient norm: every part of the model adds its gradients to it, offloaded experts
on the CPU included, and the norm is all-reduced, so an overflow on any tier of any rank skips the step everywhere.
"""

from __future__ import annotations

import math

import torch


class DynamicLossScale:
    """Multiply the loss by `value`; halve it after a step whose gradients overflowed (that step is skipped),
    double it after `interval` good steps in a row."""

    def __init__(self, init: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5, interval: int = 2000):
        self.value, self.growth, self.backoff, self.interval = init, growth, backoff, interval
        self.good_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def update(self, norm_of_scaled: float) -> bool:
        """Record one step's gradient norm (of the scaled gradients); True when the step may be applied."""
        if not math.isfinite(norm_of_scaled):
            self.value *= self.backoff
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.interval:
            self.value *= self.growth
            self.good_steps = 0
        return True
