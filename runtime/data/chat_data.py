"""Chat samples as training rows (LlamaFactory's and torchtune's supervised fine-tuning): each conversation rendered
with the chat template and encoded, the assistant's tokens marked as the only targets the loss counts, then several
samples packed into each row of train.seq_len positions, attention kept within a sample and positions restarting in
each (train.pack), or one sample a row, padded. A sample of n tokens takes n - 1 positions (inputs and targets
shifted by one within the sample: no target crosses into the next); one longer than train.seq_len + 1 tokens is cut
to it or refused (train.long_samples).

Rows are packed in file order, next fit; the run draws them epoch by epoch in a seeded order (EpochOrder), rank r
taking its contiguous slice of each step's rows, so one process with the global batch sees what the ranks see.
Legend: B rows, S positions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.data.chat_records import Message, read_chat
from runtime.data.dataset import EpochOrder, shard_first
from runtime.data.text import DataError

IGNORE = -100
"""Target of a position the loss does not count (F.cross_entropy's ignore_index)."""
Render = Callable[[list[Message]], tuple[list[int], list[bool]]]
"""render(messages) -> (the conversation's token ids, per id whether the assistant wrote it)."""


@dataclass
class ChatSamples:
    """Every sample of a source, encoded: ids and assistant mask concatenated, sample i at offsets[i]:offsets[i+1]."""

    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    lines: np.ndarray
    """The source line of each sample."""
    cut: int = 0
    """Samples cut to train.seq_len + 1 tokens."""

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    def save(self, path: Path) -> None:
        import io

        from runtime.host.io import atomic_write_bytes

        buffer = io.BytesIO()
        np.savez(buffer, ids=self.ids, mask=self.mask, offsets=self.offsets, lines=self.lines, cut=np.array(self.cut))
        atomic_write_bytes(path, buffer.getvalue())

    @classmethod
    def load(cls, path: Path) -> ChatSamples:
        with np.load(path) as f:
            return cls(f["ids"], f["mask"], f["offsets"], f["lines"], int(f["cut"]))


def encode_samples(path: str | Path, render: Render, seq_len: int, long_samples: str = "cut",
                   key: str = "train.data") -> ChatSamples:
    """Render and encode every conversation of a .jsonl chat file; a sample longer than seq_len + 1 tokens is cut
    to it (long_samples=cut) or refused, with the count and the first such line (refuse)."""
    ids, mask, offsets, lines, cut, refused = [], [], [0], [], 0, []
    for record in read_chat(path, key):
        sample, assistant = render(record.messages)
        if len(sample) != len(assistant):
            raise ValueError(f"render gave {len(sample)} ids and {len(assistant)} mask entries")
        if len(sample) < 2:
            raise DataError(f"{key}={path}:{record.line}: renders to {len(sample)} token (a sample needs two)")
        if len(sample) > seq_len + 1:
            if long_samples == "refuse":
                refused.append((record.line, len(sample)))
                continue
            sample, assistant, cut = sample[:seq_len + 1], assistant[:seq_len + 1], cut + 1
        ids += sample
        mask += assistant
        offsets.append(len(ids))
        lines.append(record.line)
    if refused:
        line, length = refused[0]
        raise DataError(f"{key}={path}: {len(refused)} samples are longer than train.seq_len + 1 = {seq_len + 1} "
                        f"tokens (the first: line {line}, {length} tokens); raise train.seq_len, or set "
                        "train.long_samples=cut to cut them to it")
    return ChatSamples(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool), np.asarray(offsets, np.int64),
                       np.asarray(lines, np.int64), cut)


def pack_rows(lengths: np.ndarray, seq_len: int, pack: bool) -> list[list[int]]:
    """Sample indices of each row: consecutive samples while their positions (length - 1 each) fit in seq_len (next
    fit, file order), or one sample a row without `pack`."""
    rows: list[list[int]] = []
    used = seq_len
    for i, length in enumerate(lengths.tolist()):
        take = length - 1
        if not pack or used + take > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += take
    return rows


@dataclass
class ChatBatch:
    """Rows of packed samples: inputs, targets (IGNORE where the loss does not count), positions restarting in each
    sample and segments numbering the samples of a row (padding is a segment of its own); positions and segments
    are None for rows of one sample each (plain causal attention is exact there)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    segments: torch.Tensor | None = None

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ChatBatch:
        """This batch with `fn` applied to each of its tensors."""
        return ChatBatch(fn(self.inputs), fn(self.targets), None if self.positions is None else fn(self.positions),
                         None if self.segments is None else fn(self.segments))

    def to(self, device: torch.device) -> ChatBatch:
        return self._map(lambda t: t.to(device))

    def rows(self, rows: slice) -> ChatBatch:
        """The rows `rows` of this batch (a micro-batch of a rank's step)."""
        return self._map(lambda t: t[rows])

    @property
    def target_count(self) -> int:
        return int((self.targets != IGNORE).sum())


class ChatDataset:
    """A chat source as rows of train.seq_len positions, drawn by the run's EpochOrder."""

    def __init__(self, samples: ChatSamples, seq_len: int, seed: int = 0, pack: bool = True, pad_id: int = 0,
                 name: str = "data", vocab_size: int | None = None):
        if samples.count == 0:
            raise DataError(f"{name} holds no samples")
        if vocab_size is not None and samples.ids.size and int(samples.ids.max()) >= vocab_size:
            raise DataError(f"{name} holds token id {int(samples.ids.max())}, not below model.vocab_size={vocab_size}")
        self.samples, self.seq_len, self.pack, self.pad_id, self.name = samples, seq_len, pack, pad_id, name
        self.rows = pack_rows(np.diff(samples.offsets), seq_len, pack)
        self.order = EpochOrder(len(self.rows), seed)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def _row(self, samples: list[int]) -> tuple[np.ndarray, ...]:
        S, s = self.seq_len, self.samples
        inputs, targets = np.full(S, self.pad_id, np.int64), np.full(S, IGNORE, np.int64)
        positions, segments = np.zeros(S, np.int64), np.full(S, len(samples), np.int64)
        at = 0
        for segment, i in enumerate(samples):
            ids, mask = s.ids[s.offsets[i]:s.offsets[i + 1]], s.mask[s.offsets[i]:s.offsets[i + 1]]
            n = len(ids) - 1
            inputs[at:at + n] = ids[:-1]
            targets[at:at + n] = np.where(mask[1:], ids[1:], IGNORE)
            positions[at:at + n] = np.arange(n)
            segments[at:at + n] = segment
            at += n
        positions[at:] = np.arange(S - at)  # padding: a segment of its own
        return inputs, targets, positions, segments

    def batch(self, rows: list[int]) -> ChatBatch:
        """Rows `rows` (by index in file order) as one batch."""
        parts = [self._row(self.rows[r]) for r in rows]
        inputs, targets, positions, segments = (torch.from_numpy(np.stack(t)) for t in zip(*parts, strict=True))
        if not self.pack:  # one sample a row, padding after it: causal attention is exact for the sample
            return ChatBatch(inputs, targets)
        return ChatBatch(inputs, targets, positions, segments)

    def rank_batch(self, step: int, rank: int, world_size: int, micro_batch_size: int) -> ChatBatch:
        """Rank `rank`'s contiguous slice of the rows of `step` (runtime/data/dataset.py's sharding)."""
        first = shard_first(step, rank, world_size, micro_batch_size, self.name)
        return self.batch([self.order.item(n) for n in range(first, first + micro_batch_size)])


def samples_cache(cache_dir: Path, key: str, path: str | Path, digest: str) -> Path:
    """Where a chat source's encoded samples are kept: named after the key and a digest of the tokenizer, template,
    window and cut rule (`digest`) and the file's path, size and modification time."""
    stat = Path(path).stat()
    text = f"{digest}\0{Path(path).resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return Path(cache_dir) / f"{key}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.chat.npz"
