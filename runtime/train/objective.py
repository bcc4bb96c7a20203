"""What a training step computes (`Objective`). The language model: next-token cross-entropy of this rank's
micro-batch plus the router losses; on chat data, of the assistant's tokens only; the multi-task objective
(runtime/train/tasks.py) and distillation (runtime/train/distill.py) are the others."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.data.chat_data import IGNORE, ChatBatch, ChatDataset
from runtime.data.dataset import TokenDataset
from runtime.model.transformer import ModelOutput
from runtime.parallel.groups import ParallelGroups


class Objective(Protocol):
    """The loss of a step and what it reports. It owns the router losses: its backward includes the model output's
    aux_loss, so the loop only reads it back to check it is finite."""

    @property
    def tokens_per_step(self) -> int:
        """Tokens all ranks process in one step (the tokens/s the metrics report)."""
        ...

    def forward_backward(self, model: nn.Module, step: int, device: torch.device, autocast,
                         scaler=None) -> tuple[torch.Tensor, ModelOutput]:
        """(this rank's loss without the router losses, detached; the model output) after backward of the loss plus
        the output's aux_loss (scaled by `scaler` with fp16)."""
        ...

    def records(self, step: int) -> tuple[dict, list[dict]]:
        """This objective's metrics for the step line, and extra lines (one per rank and task for multi-task);
        collective: every rank calls it."""
        ...


class _RankShare:
    """A rank's share of a step is its contiguous slice of the step's global batch, micro_batch_size x micro_batches
    sequences, run as `micro_batches` micro-batches of micro_batch_size each (train.grad_accum_steps)."""

    def __init__(self, groups: ParallelGroups, micro_batch_size: int, seq_len: int, micro_batches: int = 1):
        self.groups, self.micro_batch_size = groups, micro_batch_size
        self.micro_batches = micro_batches
        """Micro-batches of a step: each one's loss counts 1/micro_batches, so their gradients sum to the step's."""
        self.tokens_per_step = groups.world_size * micro_batch_size * micro_batches * seq_len

    def records(self, step: int) -> tuple[dict, list[dict]]:
        """Objective-specific metrics and extra metrics lines (none for the language model); collective."""
        return {}, []


class LanguageModel(_RankShare):
    """Next-token cross-entropy of this rank's share of the step's token windows."""

    def __init__(self, data: TokenDataset, groups: ParallelGroups, micro_batch_size: int, seq_len: int,
                 micro_batches: int = 1):
        super().__init__(groups, micro_batch_size, seq_len, micro_batches)
        self.data = data
        self._batch: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def forward_backward(self, model: nn.Module, step: int, device: torch.device, autocast,
                         scaler=None, micro: int = 0) -> tuple[torch.Tensor, ModelOutput]:
        """(this rank's language-model loss of micro-batch `micro`, model output) after backward of its loss plus
        router losses, over the number of micro-batches (the router losses are each micro-batch's own, as
        Megatron computes them)."""
        inputs, targets = self._micro_batch(step, micro)
        copy = device.type == "cuda"  # the ids go to the device without the host waiting for the copy
        inputs, targets = inputs.to(device, non_blocking=copy), targets.to(device, non_blocking=copy)
        with autocast:
            out = model(inputs)
        lm_loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten())
        loss = lm_loss + out.aux_loss.float()
        if self.micro_batches > 1:
            loss = loss / self.micro_batches
        (scaler.scale(loss) if scaler else loss).backward()
        return lm_loss.detach(), out

    def _micro_batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows micro x micro_batch_size onward of this rank's batch of `step` (read once a step)."""
        if self._batch is None or self._batch[0] != step:
            g = self.groups
            self._batch = (step, *self.data.rank_batch(step, g.rank, g.world_size,
                                                       self.micro_batch_size * self.micro_batches))
        rows = slice(micro * self.micro_batch_size, (micro + 1) * self.micro_batch_size)
        return self._batch[1][rows], self._batch[2][rows]


class ChatLanguageModel(_RankShare):
    """Next-token cross-entropy of the assistant's tokens of packed chat rows (runtime/data/chat_data.py): this
    rank's summed loss over the tokens counted on every rank in the whole step (all its micro-batches), times the
    world size, as the reducers average the gradients over ranks; so the step is the global batch's mean over its
    counted tokens, whatever each rank's or micro-batch's share of them, and the loss reported (the mean over ranks
    and micro-batches) is that mean too."""

    def __init__(self, data: ChatDataset, groups: ParallelGroups, micro_batch_size: int, seq_len: int,
                 micro_batches: int = 1):
        super().__init__(groups, micro_batch_size, seq_len, micro_batches)
        self.data = data
        self._rows: tuple[int, ChatBatch, float] | None = None
        """The step whose rows are held, its rows and the tokens counted on every rank (read once a step)."""

    def forward_backward(self, model: nn.Module, step: int, device: torch.device, autocast,
                         scaler=None, micro: int = 0) -> tuple[torch.Tensor, ModelOutput]:
        g, n = self.groups, self.micro_batches
        if self._rows is None or self._rows[0] != step:  # the step's rows and its counted tokens, once a step
            batch = self.data.rank_batch(step, g.rank, g.world_size, self.micro_batch_size * n)
            counted_1 = torch.tensor([float(batch.target_count)])
            if g.world_size > 1:
                dist.all_reduce(counted_1)
            self._rows = (step, batch, max(float(counted_1), 1.0))
        _, batch, counted = self._rows
        rows = batch.rows(slice(micro * self.micro_batch_size, (micro + 1) * self.micro_batch_size)).to(device)
        with autocast:
            out = model(rows.inputs, positions=rows.positions, segments=rows.segments)
        total = F.cross_entropy(out.logits.float().flatten(0, 1), rows.targets.flatten(), ignore_index=IGNORE,
                                reduction="sum")
        share = total * (g.world_size / counted)  # this micro-batch's part of the step's loss
        loss = share + out.aux_loss.float() / n
        (scaler.scale(loss) if scaler else loss).backward()
        return (share * n).detach(), out
