"""What a training step computes (`Objective`). The language model: next-token cross-entropy of this rank's
micro-batch plus the router losses; on chat data, of the assistant's tokens only; the multi-task objective (runtime/train/tasks.py) and distillation
(runtime/train/distill.py) are the others."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.data.chat_data import IGNORE, ChatDataset
from runtime.parallel.groups import ParallelGroups
from runtime.data.dataset import TokenDataset


class Objective(Protocol):
    """The loss of a step and what it reports. It owns the router losses: its backward includes the model output's
    aux_loss, so the loop only reads it back to check it is finite."""

    tokens_per_step: int
    """Tokens all ranks process in one step (the tokens/s the metrics report)."""

    def forward_backward(self, model: nn.Module, step: int, device: torch.device, autocast,
                         scaler=None) -> tuple[torch.Tensor, object]:
        """(this rank's loss without the router losses, detached; the model output) after backward of the loss plus
        the output's aux_loss (scaled by `scaler` with fp16)."""
        ...

    def records(self, step: int) -> tuple[dict, list[dict]]:
        """This objective's metrics for the step line, and extra lines (one per rank and task for multi-task);
        collective: every rank calls it."""
        ...


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


class ChatLanguageModel(LanguageModel):
    """Next-token cross-entropy of the assistant's tokens of packed chat rows (runtime/data/chat_data.py): this
    rank's summed loss over the tokens counted on every rank, times the world size, as the reducers average the
    gradients over ranks; so the step is the global batch's mean over its counted tokens, whatever each rank's
    share of them, and the loss reported (the mean over ranks) is that mean too."""

    data: ChatDataset

    def forward_backward(self, model: nn.Module, step: int, device: torch.device, autocast,
                         scaler=None) -> tuple[torch.Tensor, object]:
        g = self.groups
        batch = self.data.rank_batch(step, g.rank, g.world_size, self.micro_batch_size).to(device)
        counted = torch.tensor([float(batch.target_count)])
        if g.world_size > 1:
            dist.all_reduce(counted)
        with autocast:
            out = model(batch.inputs, positions=batch.positions, segments=batch.segments)
        total = F.cross_entropy(out.logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE,
                                reduction="sum")
        lm_loss = total * (g.world_size / max(float(counted), 1.0))
        loss = lm_loss + out.aux_loss.float()
        (scaler.scale(loss) if scaler else loss).backward()
        return lm_loss.detach(), out
