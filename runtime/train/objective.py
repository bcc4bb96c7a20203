"""What a training step computes. The language model: next-token cross-entropy of this rank's micro-batch plus the
router losses (the multi-task objective, runtime/train/tasks.py, has the same interface)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.parallel.groups import ParallelGroups
from runtime.data.dataset import TokenDataset


class LanguageModel:
    def __init__(self, data: TokenDataset, groups: ParallelGroups, micro_batch_size: int, seq_len: int):
        self.data, self.groups, self.micro_batch_size = data, groups, micro_batch_size
        self.tokens_per_step = groups.world_size * micro_batch_size * seq_len

    def forward_backward(self, model: nn.Module, step: int, device: torch.device, autocast,
                         scaler=None) -> tuple[torch.Tensor, object]:
        """(this rank's language-model loss, model output) after backward of loss + router losses."""
        inputs, targets = self.data.rank_batch(step, self.groups.rank, self.groups.world_size, self.micro_batch_size)
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast:
            out = model(inputs)
        lm_loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten())
        loss = lm_loss + out.aux_loss.float()
        (scaler.scale(loss) if scaler else loss).backward()
        return lm_loss.detach(), out

    def records(self, step: int) -> tuple[dict, list[dict]]:
        """Objective-specific metrics and extra metrics lines (none for the language model); collective."""
        return {}, []
