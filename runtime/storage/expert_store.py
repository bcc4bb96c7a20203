"""The SSD tier: every expert's fp32 master weights and AdamW moments on disk (the paper's "Hierarchical Storage",
Eq. 1's 12S).

One safetensors file per (MoE layer, global expert) under `root/live/`, holding the expert's slot (flat master,
moments and step; runtime/storage/expert_slots.py): an eviction writes back exactly one expert
(a per-layer file would rewrite the whole layer for every eviction). A file is written with one gather write (in
place once it exists; a reader of a key waits for its queued writes) and read with one scatter read
(runtime/storage/live_files.py).

The store is working memory, not a checkpoint: a checkpoint copies every expert's states into its own directory
(see OffloadEngine.save) and a resume rebuilds `live/` from it. So live files are not fsynced (the kernel writes
them back while training goes on) nor checksummed; `durable=True` checksums each file, replaces it by rename and
fsyncs it and the directory, for a store that must survive a crash of the machine. A store belongs to one run:
`root/OWNER` names the run directory that created it, and another run is refused instead of silently sharing (and
overwriting) it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime.errors import UserError
from runtime.files.paths import LIVE, OWNER, live_expert_file
from runtime.host.io import atomic_write_text
from runtime.storage.expert_slots import ExpertSlot
from runtime.storage.live_files import direct_io_supported, read_file, write_file

ExpertKey = tuple[int, int]
"""(MoE layer index, global expert index)."""



class StoreError(UserError):
    """The store lacks an expert the caller asked for, or belongs to another run."""


class ExpertStore:
    """Reads and writes expert states under `root`; counts the bytes it moves."""

    def __init__(self, root: str | Path, durable: bool = False, owner: str | None = None, direct: bool = True):
        self.root = Path(root)
        self.live = self.root / LIVE
        if owner is not None:
            claim_store(self.root, owner)
        self.live.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self.direct = direct and not durable and direct_io_supported(self.live)
        """Files of aligned slots (`io_slot`) move with direct I/O, past the page cache (`direct` asks for it
        where the filesystem allows)."""
        self.bytes_read = 0
        self.bytes_written = 0
        self._sizes: dict[ExpertKey, int] = {}

    def path(self, key: ExpertKey) -> Path:
        layer, expert = key
        return self.live / live_expert_file(layer, expert)

    def __contains__(self, key: ExpertKey) -> bool:
        return self.path(key).exists()

    def write(self, key: ExpertKey, slot: ExpertSlot) -> None:
        """Write the expert's file (live_files.write_file: in place once it exists, renamed and fsynced when
        durable)."""
        size = write_file(self.path(key), slot.state_tensors(), self.durable, self.direct)
        self._sizes[key] = size
        self.bytes_written += size

    def read_into(self, key: ExpertKey, slot: ExpertSlot) -> ExpertSlot:
        """Fill `slot` (master, moments, step) from the expert's file in one scatter read; the caller refreshes
        its stage."""
        tensors = slot.state_tensors()
        self._read(key, tensors)
        self.bytes_read += _state_bytes(tensors)
        return slot

    def read(self, key: ExpertKey) -> dict[str, torch.Tensor]:
        """The expert's stored tensors (master, exp_avg, exp_avg_sq, step) in fresh memory."""
        tensors = self._read(key, None)
        self.bytes_read += _state_bytes(tensors)
        return tensors

    def _read(self, key: ExpertKey, into: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        try:
            return read_file(self.path(key), into, self.direct)
        except FileNotFoundError:
            raise StoreError(f"expert store {self.root} has no states for layer {key[0]} expert {key[1]}") from None

    def will_need(self, keys: list[ExpertKey]) -> None:
        """Start reading these experts' files into the page cache without waiting (posix_fadvise WILLNEED), so
        the disk has several requests in flight while the reader copies one. Not with direct reads, which would
        read each file twice."""
        if self.direct:
            return
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


def _state_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of an expert's states (its file's padding to whole I/O blocks not counted)."""
    return sum(t.nbytes for name, t in tensors.items() if name != "pad")


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
