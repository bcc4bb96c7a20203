"""Plain reference implementations the tests compare production code against: each is the obvious way, kept out
of runtime/ because only the tests run it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from runtime.data.dataset import TokenDataset
from runtime.data.text import segments
from runtime.parallel.groups import ProcessGroup, group_size


def allreduce_grads(params: Iterable[torch.Tensor], group: ProcessGroup = None) -> None:
    """Average every gradient with one all-reduce per parameter (missing gradients count as zero): what the
    bucketed GradBucketReducer must equal."""
    world = group_size(group)
    if world == 1:
        return
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(world)


def global_batch(data: TokenDataset, step: int, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [global_batch_size, seq_len], of `step` for all ranks together: every rank's
    `rank_batch` is its slice of this."""
    seqs = data.windows(step * global_batch_size, global_batch_size)
    return seqs[:, :-1], seqs[:, 1:]


def read_text_bytes(path: Optional[str | Path] = None, key: str = "train.data", text_key: str = "text",
                    errors: str = "strict") -> bytes:
    """The whole text of a source as one byte string, as the byte tokenizer reads it."""
    return b"".join(segments(path, key, text_key, errors=errors))
