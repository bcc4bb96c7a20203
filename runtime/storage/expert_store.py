"""The SSD tier: every expert's fp32 master weights and AdamW moments on disk (seed 004 section 3.2.1, Eq. 1's 12S).

One safetensors file per (MoE layer, global expert) under `root/live/`: an eviction writes back exactly one expert
(a per-layer file would rewrite the whole layer for every eviction) and a file is replaced by rename, so a reader
sees the old or the new states, never a mix. A file is written with one gather write and read with one scatter
read (runtime/storage/live_files.py).

The store is working memory, not a checkpoint: a checkpoint copies every expert's states into its own directory
(see OffloadManager.save) and a resume rebuilds `live/` from it. So live files are not fsynced (the kernel writes
them back while training goes on); `durable=True` fsyncs each file and the directory, for a store that must
survive a crash of the machine. A store belongs to one run: `root/OWNER` names
the run directory that created it, and another run is refused instead of silently sharing (and overwriting) it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime.errors import UserError
from runtime.io import atomic_write_text
from runtime.storage.live_files import read_file, write_file

ExpertKey = tuple[int, int]
"""(MoE layer index, global expert index)."""
ExpertState = dict[str, torch.Tensor]
"""param.NAME, exp_avg.NAME, exp_avg_sq.NAME for NAME in w1, w2, (w3, b1, b2, b3), and step (a 0-d float32)."""

LIVE = "live"
OWNER = "OWNER"


class StoreError(UserError):
    """The store lacks an expert the caller asked for, or belongs to another run."""


def new_state(params: dict[str, torch.Tensor]) -> ExpertState:
    """fp32 master copies of one expert's parameters with zero moments and step 0 (AdamW before its first step)."""
    state: ExpertState = {}
    for name, t in params.items():
        master = t.detach().to(torch.float32).clone().contiguous()
        state[f"param.{name}"] = master
        state[f"exp_avg.{name}"] = torch.zeros_like(master)
        state[f"exp_avg_sq.{name}"] = torch.zeros_like(master)
    state["step"] = torch.zeros((), dtype=torch.float32)
    return state


def state_bytes(state: ExpertState) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class ExpertStore:
    """Reads and writes expert states under `root`; counts the bytes it moves."""

    def __init__(self, root: str | Path, durable: bool = False, owner: str | None = None):
        self.root = Path(root)
        self.live = self.root / LIVE
        if owner is not None:
            claim_store(self.root, owner)
        self.live.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self.bytes_read = 0
        self.bytes_written = 0
        self._sizes: dict[ExpertKey, int] = {}

    def path(self, key: ExpertKey) -> Path:
        layer, expert = key
        return self.live / f"L{layer:04d}-E{expert:06d}.safetensors"

    def __contains__(self, key: ExpertKey) -> bool:
        return self.path(key).exists()

    def write(self, key: ExpertKey, state: ExpertState) -> None:
        """Replace the expert's file by rename (temp written first; fsynced with the directory when durable)."""
        size = write_file(self.path(key), state, self.durable)
        self._sizes[key] = size
        self.bytes_written += size

    def read(self, key: ExpertKey) -> ExpertState:
        """The expert's states as fresh tensors, read from its file in one scatter read."""
        try:
            state = read_file(self.path(key))
        except FileNotFoundError:
            raise StoreError(f"expert store {self.root} has no states for layer {key[0]} expert {key[1]}") from None
        self.bytes_read += state_bytes(state)
        return state

    def will_need(self, keys: list[ExpertKey]) -> None:
        """Start reading these experts' files into the page cache without waiting (posix_fadvise WILLNEED), so
        the disk has several requests in flight while the reader copies one."""
        for key in keys:
            try:
                fd = os.open(self.path(key), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def disk_bytes(self) -> int:
        """Bytes of the files this store has written (kept as it writes: no directory scan every step)."""
        return sum(self._sizes.values())


def check_owner(root: Path, owner: str) -> bool:
    """True when the store at `root` is `owner`'s (a run directory), False when it has no owner yet; StoreError when
    another run owns it: two runs sharing one store would overwrite each other's expert states without a sign."""
    marker = Path(root) / OWNER
    if not marker.exists():
        return False
    holder = marker.read_text().strip()
    if holder != owner:
        raise StoreError(f"storage.ssd_path {Path(root).parent} holds the expert store of another run ({holder}); "
                         "give this run its own storage.ssd_path (or leave it empty: the run directory)")
    return True


def claim_store(root: Path, owner: str) -> None:
    """Make `owner` the owner of the store at `root` (check_owner's refusal when another run owns it)."""
    if check_owner(root, owner):
        return
    try:
        atomic_write_text(Path(root) / OWNER, owner + "\n")
    except OSError as exc:
        raise StoreError(f"cannot write the expert store at {root}: {exc.strerror or exc}; set storage.ssd_path "
                         "to a directory you can write") from None
