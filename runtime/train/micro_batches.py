"""Gradient accumulation (train.grad_accum_steps): a rank's share of an optimizer step run as several micro-batches
whose gradients add up. Every micro-batch but the last runs inside each part's `accumulating` context, so gradient
reductions and the offloaded experts' trip home happen once a step; the lr schedule, clipping, metrics and
checkpoints count optimizer steps."""

from __future__ import annotations

import contextlib

import torch

from runtime.model.transformer import ModelOutput
from runtime.train.meter import OutputSum


def run_micro_batches(c, step: int, device: torch.device, autocast, scaler=None) -> tuple[torch.Tensor, ModelOutput]:
    """(mean language-model loss, a model output of the mean router losses and gate metrics) of `step`'s
    micro-batches of the objective (`micro_batches`, 1 when it has none), after their backwards."""
    n = getattr(c.objective, "micro_batches", 1)
    if n == 1:
        return c.objective.forward_backward(c.model, step, device, autocast, scaler)
    total = OutputSum()
    for micro in range(n):
        with contextlib.ExitStack() as stack:
            if micro < n - 1:
                for part in c.parts:
                    stack.enter_context(part.accumulating())
            lm_loss, out = c.objective.forward_backward(c.model, step, device, autocast, scaler, micro=micro)
        total.add(lm_loss, out)
    return total.mean()
