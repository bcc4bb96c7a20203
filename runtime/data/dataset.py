"""Training data: a token stream (a text source tokenized, or a memory-mapped token file) cut into fixed windows,
sharded deterministically by rank.

The global batch of step s is a pure function of (seed, step), and rank r of W takes its contiguous slice, so
one process with micro batch W x mbs sees exactly what W ranks see together, and resuming needs only the step: a
resumed run reads the very tokens the uninterrupted one would have. A rank reads only its own windows' ids.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from runtime.config import MoesysConfig
from runtime.data.pretokenize import read_tokens, run_cache_dir
from runtime.data.text import DataError, check_token_count, source_name
from runtime.data.tokenizer import Tokenizer, byte_tokenizer


class EpochOrder:
    """The run's order of `count` items (windows, packed rows): epoch by epoch, each a permutation seeded by (seed,
    epoch); sample number n of the whole run is item perm[epoch][n % count]. The last few epochs' permutations are
    kept."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        """torch's randperm, held as numpy: a batch is put together on the host without reading a tensor back."""
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
            perm = torch.randperm(self.count, generator=gen).numpy()
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def item(self, n: int) -> int:
        epoch, pos = divmod(n, self.count)
        return int(self._perm(epoch)[pos])


def shard_first(step: int, rank: int, world_size: int, micro_batch_size: int, name: str) -> int:
    """The run's number of rank `rank`'s first sample of `step`: its contiguous slice [rank * mbs, (rank + 1) * mbs)
    of the step's global batch."""
    if not 0 <= rank < world_size or micro_batch_size <= 0 or step < 0:
        raise DataError(f"{name}: bad shard rank={rank} world_size={world_size} micro_batch_size={micro_batch_size} "
                        f"step={step}")
    return step * world_size * micro_batch_size + rank * micro_batch_size


class TokenDataset:
    """A flat token stream cut into windows of seq_len + 1 tokens (input and target shifted by one).

    Window i starts at token i * seq_len. Samples are drawn epoch by epoch from a permutation of the windows
    seeded by (seed, epoch); sample number n of the whole run is window perm[epoch][n % num_windows].
    `tokens` may be a memory map: only the windows asked for are read. With `vocab_size`, a window holding an id
    the model has no row for is a DataError.
    """

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int, seed: int = 0, name: str = "data",
                 vocab_size: int | None = None):
        if seq_len <= 0:
            raise DataError(f"{name}: seq_len must be positive (got {seq_len})")
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        tokens = tokens.reshape(-1)
        check_token_count(tokens.size, seq_len, name)
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.name = name
        self.vocab_size = vocab_size
        self.num_windows = (tokens.size - 1) // seq_len
        self.order = EpochOrder(self.num_windows, seed)

    @classmethod
    def from_path(cls, path: str | Path | None, seq_len: int, seed: int = 0,
                  tokenizer: Tokenizer | None = None, key: str = "train.data", text_key: str = "text",
                  cache_dir: Path | None = None, vocab_size: int | None = None,
                  errors: str = "strict") -> TokenDataset:
        """A text file, a directory of *.txt files, a .jsonl file, a token file (.bin, .npy) or (path None) the
        shipped corpus; text is read from the run's token cache when `cache_dir` holds it. The tokenizer defaults to
        the byte tokenizer of `vocab_size` rows."""
        tokenizer = tokenizer or byte_tokenizer(vocab_size)
        tokens = read_tokens(path, tokenizer, key, text_key, cache_dir, errors)
        return cls(tokens, seq_len, seed, source_name(path, key), vocab_size)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    def window_at(self, index: int) -> np.ndarray:
        """Window `index` in file order: tokens [index * seq_len, (index + 1) * seq_len + 1)."""
        start = index * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def stack(self, rows: list[np.ndarray]) -> torch.Tensor:
        """Windows as one [count, seq_len + 1] int64 tensor, checked against the vocabulary."""
        ids = np.stack(rows).astype(np.int64)
        if self.vocab_size is not None and ids.size and int(ids.max()) >= self.vocab_size:
            raise DataError(f"{self.name} holds token id {int(ids.max())}, not below model.vocab_size="
                            f"{self.vocab_size}; tokenize it with the run's train.tokenizer (moesys tokenize)")
        return torch.from_numpy(ids)

    def windows(self, first_sample: int, count: int) -> torch.Tensor:
        """Samples first_sample .. first_sample + count - 1 of the run, as [count, seq_len + 1] int64."""
        return self.stack([self.window_at(self.order.item(n)) for n in range(first_sample, first_sample + count)])

    def rank_batch(self, step: int, rank: int, world_size: int,
                   micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s contiguous slice [rank * mbs, (rank + 1) * mbs) of the global batch of `step`."""
        seqs = self.windows(shard_first(step, rank, world_size, micro_batch_size, self.name), micro_batch_size)
        return seqs[:, :-1], seqs[:, 1:]


def open_dataset(cfg: MoesysConfig, tokenizer: Tokenizer, key: str = "train.data", path: str | None = None,
                 seed: int | None = None) -> TokenDataset:
    """The dataset of one of the run's sources (`key`, at `path`), with the run's window, text key and cache."""
    tr = cfg.train
    return TokenDataset.from_path(path, tr.seq_len, tr.seed if seed is None else seed, tokenizer, key,
                                  tr.data_text_key, run_cache_dir(cfg), cfg.model.vocab_size, tr.data_errors)


def task_seed(seed: int, task: str) -> int:
    """A per-task data seed derived from the run seed and the task name (stable across processes)."""
    return (seed * 1_000_003 + zlib.crc32(task.encode("utf-8"))) % (2**63)


def build_task_datasets(task_data: Mapping[str, str | None], seq_len: int, seed: int,
                        cfg: MoesysConfig | None = None,
                        tokenizer: Tokenizer | None = None) -> dict[str, TokenDataset]:
    """One dataset per task, each from its own path (None: the shipped corpus), each with its own order."""
    if cfg is None:
        return {name: TokenDataset.from_path(path, seq_len, task_seed(seed, name), key=f"tasks.{name}.data")
                for name, path in task_data.items()}
    tokenizer = tokenizer or byte_tokenizer(cfg.model.vocab_size)
    return {name: open_dataset(cfg, tokenizer, f"tasks.{name}.data", path, task_seed(seed, name))
            for name, path in task_data.items()}
