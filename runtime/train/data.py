"""Training data: a tokenised text corpus cut into fixed windows, sharded deterministically by rank.

The global batch of step s is a pure function of (seed, step), and rank r of W takes its contiguous slice, so
one process with micro batch W x mbs sees exactly what W ranks see together, and resuming needs only the step.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Mapping, Optional

import torch

from runtime.train.text import CORPUS_DIR, DOC_SEPARATOR, DataError, check_token_count, read_text_bytes  # noqa: F401
from runtime.train.tokenizer import ByteTokenizer

class TokenDataset:
    """A flat token stream cut into windows of seq_len + 1 tokens (input and target shifted by one).

    Window i starts at token i * seq_len. Samples are drawn epoch by epoch from a permutation of the windows
    seeded by (seed, epoch); sample number n of the whole run is window perm[epoch][n % num_windows].
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0, name: str = "data"):
        if seq_len <= 0:
            raise DataError(f"{name}: seq_len must be positive (got {seq_len})")
        tokens = tokens.reshape(-1)
        check_token_count(tokens.numel(), seq_len, name)
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.name = name
        self.num_windows = (tokens.numel() - 1) // seq_len
        self._perms: dict[int, torch.Tensor] = {}

    @classmethod
    def from_path(cls, path: Optional[str | Path], seq_len: int, seed: int = 0,
                  tokenizer: Optional[ByteTokenizer] = None, key: str = "train.data") -> "TokenDataset":
        """Tokenise a text file, a directory of *.txt files, or (path None) the shipped corpus."""
        tokenizer = tokenizer or ByteTokenizer()
        tokens = tokenizer.encode_bytes(read_text_bytes(path, key))
        name = "shipped corpus" if path is None else f"{key}={path}"
        return cls(tokens, seq_len, seed, name)

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def _perm(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
            perm = torch.randperm(self.num_windows, generator=gen)
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def windows(self, first_sample: int, count: int) -> torch.Tensor:
        """Samples first_sample .. first_sample + count - 1 of the run, as [count, seq_len + 1] int64."""
        rows = []
        for n in range(first_sample, first_sample + count):
            epoch, pos = divmod(n, self.num_windows)
            start = int(self._perm(epoch)[pos]) * self.seq_len
            rows.append(self.tokens[start:start + self.seq_len + 1])
        return torch.stack(rows).to(torch.int64)

    def global_batch(self, step: int, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [global_batch_size, seq_len], of `step` for all ranks together."""
        if step < 0 or global_batch_size <= 0:
            raise DataError(f"{self.name}: need step >= 0 and a positive batch (got {step}, {global_batch_size})")
        seqs = self.windows(step * global_batch_size, global_batch_size)
        return seqs[:, :-1], seqs[:, 1:]

    def rank_batch(self, step: int, rank: int, world_size: int,
                   micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s contiguous slice [rank * mbs, (rank + 1) * mbs) of the global batch of `step`."""
        if not 0 <= rank < world_size or micro_batch_size <= 0 or step < 0:
            raise DataError(f"{self.name}: bad shard rank={rank} world_size={world_size} "
                            f"micro_batch_size={micro_batch_size} step={step}")
        first = step * world_size * micro_batch_size + rank * micro_batch_size
        seqs = self.windows(first, micro_batch_size)
        return seqs[:, :-1], seqs[:, 1:]


def task_seed(seed: int, task: str) -> int:
    """A per-task data seed derived from the run seed and the task name (stable across processes)."""
    return (seed * 1_000_003 + zlib.crc32(task.encode("utf-8"))) % (2**63)


def build_task_datasets(task_data: Mapping[str, Optional[str]], seq_len: int,
                        seed: int) -> dict[str, TokenDataset]:
    """One dataset per task, each from its own path (None: the shipped corpus), each with its own order."""
    return {name: TokenDataset.from_path(path, seq_len, task_seed(seed, name), key=f"tasks.{name}.data")
            for name, path in task_data.items()}
