"""The SSD tier: every expert's fp32 master weights and AdamW moments on disk (seed 004 section 3.2.1, Eq. 1's 12S).

One safetensors file per (MoE layer, global expert) under `root/live/`: an eviction writes back exactly one expert
(a per-layer file would rewrite the whole layer for every eviction) and a file is replaced atomically (temp + fsync
+ rename), so a reader sees the old or the new states, never a mix. Files are read memory-mapped.

Consistency with checkpoints: the store is versioned by step. `snapshot(step)` hard-links every live file into
`root/v{step}/` (cheap: later write-backs replace live files by new inodes, so the snapshot keeps the old data),
published by renaming a temporary directory; a checkpoint of step N refers to version N. `restore(N)` rebuilds
`live/` from that version, so a killed run resumes with exactly the expert states of its last checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from runtime.io import atomic_write_bytes, fsync_dir

ExpertKey = tuple[int, int]
"""(MoE layer index, global expert index)."""
ExpertState = dict[str, torch.Tensor]
"""param.NAME, exp_avg.NAME, exp_avg_sq.NAME for NAME in w1, w2, (w3, b1, b2, b3), and step (a 0-d float32)."""

STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")
LIVE = "live"


class StoreError(RuntimeError):
    """The store lacks an expert or a version the caller asked for."""


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


def version_name(version: int) -> str:
    return f"v{version:08d}"


class ExpertStore:
    """Reads and writes expert states under `root`; counts the bytes it moves."""

    def __init__(self, root: str | Path, durable: bool = True):
        self.root = Path(root)
        self.live = self.root / LIVE
        self.live.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self.bytes_read = 0
        self.bytes_written = 0

    def path(self, key: ExpertKey) -> Path:
        layer, expert = key
        return self.live / f"L{layer:04d}-E{expert:06d}.safetensors"

    def __contains__(self, key: ExpertKey) -> bool:
        return self.path(key).exists()

    def write(self, key: ExpertKey, state: ExpertState) -> None:
        """Atomically replace the expert's file (temp + fsync + rename + fsync of the directory)."""
        data = save({k: v.detach().contiguous().cpu() for k, v in state.items()})
        if self.durable:
            atomic_write_bytes(self.path(key), data)
        else:
            tmp = self.path(key).with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self.path(key))
        self.bytes_written += len(data)

    def read(self, key: ExpertKey) -> ExpertState:
        """The expert's states as fresh tensors, read from the memory-mapped file."""
        path = self.path(key)
        if not path.exists():
            raise StoreError(f"expert store {self.root} has no states for layer {key[0]} expert {key[1]}")
        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
        self.bytes_read += state_bytes(state)
        return state

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.live.glob("*.safetensors"))

    # ---- versions (checkpoint consistency) ----

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.is_dir() and p.name[1:].isdigit())

    def snapshot(self, version: int) -> Path:
        """Publish the live files as version `version` (hard links; copies where links are unsupported)."""
        final = self.root / version_name(version)
        tmp = self.root / f".tmp-{version_name(version)}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for src in self.live.glob("*.safetensors"):
            _link_or_copy(src, tmp / src.name, self.durable)
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fsync_dir(self.root)
        return final

    def restore(self, version: int) -> None:
        """Make `live/` equal to version `version`."""
        source = self.root / version_name(version)
        if not source.is_dir():
            raise StoreError(f"expert store {self.root} has no version {version} (has {self.versions()}); "
                             "was storage.ssd_path changed or cleaned since the checkpoint was written?")
        tmp = self.root / ".tmp-live"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for src in source.glob("*.safetensors"):
            _link_or_copy(src, tmp / src.name, False)
        old = self.root / ".old-live"
        shutil.rmtree(old, ignore_errors=True)
        if self.live.exists():
            self.live.rename(old)
        tmp.rename(self.live)
        fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)

    def prune(self, keep: int) -> None:
        """Delete all but the newest `keep` versions."""
        for version in self.versions()[:-keep] if keep > 0 else self.versions():
            shutil.rmtree(self.root / version_name(version), ignore_errors=True)


def _link_or_copy(src: Path, dst: Path, sync: bool) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
        sync = True
    if sync:
        with open(dst, "rb") as f:
            os.fsync(f.fileno())
