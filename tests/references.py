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


class KVCache:
    """Keys and values of past positions, one entry per attention layer, for incremental decoding: the plain cache
    the model's forward must give the full forward's logits with (runtime/ runs the static one).

    Buffers [B, KV, capacity, hd] are allocated on first use (dtype and device of the keys) and grow by doubling;
    `max_len` preallocates that many positions so generation never reallocates.
    """

    def __init__(self, num_layers: int, max_len: Optional[int] = None):
        self.max_len = max_len
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, KV, S, hd] at positions start_pos.. and return all keys/values up to start_pos + S."""
        end = start_pos + k.shape[2]
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None or buf_k.shape[2] < end or buf_k.shape[0] != k.shape[0]:
            capacity = max(end, self.max_len or 0, 2 * buf_k.shape[2] if buf_k is not None else 0)
            shape = (k.shape[0], k.shape[1], capacity, k.shape[3])
            new_k, new_v = k.new_zeros(shape), v.new_zeros(shape)
            if buf_k is not None and buf_k.shape[0] == k.shape[0]:
                new_k[:, :, : buf_k.shape[2]] = buf_k
                new_v[:, :, : buf_v.shape[2]] = buf_v
            self.keys[layer], self.values[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, start_pos:end] = k
        buf_v[:, :, start_pos:end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]
