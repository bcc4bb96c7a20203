"""The bytes a run writes to disk, and the check that the filesystems they go to have them free.

A training run writes the SSD expert store (storage.offload=ssd: each rank's experts' fp32 weights and AdamW
moments, 12 bytes a parameter, one file an expert in whole I/O blocks) under storage.ssd_path or RUN_DIR/expert_store,
and checkpoints (every parameter's weights and moments, 12 bytes a parameter, and each tensor's step count and header
entry) under RUN_DIR/checkpoints; `moesys export` writes the model's weights in
export.dtype to out=. The planner's part is pure (counted from the config); `check_free` measures.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from runtime.config import ModelConfig, MoesysConfig
from runtime.errors import UserError
from runtime.plan.budget import GB
from runtime.plan.modes import OffloadMode
from runtime.plan.params import ParamCounts

CHECKPOINT_BYTES = 12
"""A parameter in a checkpoint: fp32 weight, exp_avg and exp_avg_sq."""
IO_BLOCK = 4096
"""The SSD store's I/O block (runtime/storage/expert_slots.py): a live file's header and its data are whole blocks."""
ENTRY_BYTES = 4 * 192 + 4
"""A checkpoint tensor's bytes beyond its data, at most: the header entries of its weight, two moments and step
count (a key of up to about 120 characters, dtype, shape, offsets), and the step count's 4 bytes. Each expert's slice
of a stacked tensor is a tensor of its own."""
FIXED_CHECKPOINT_BYTES = 1 << 20
"""A checkpoint's meta.json (the whole config), RNG states and file headers' fixed parts, at most."""
KEEP_CHECKPOINTS = 2
"""Complete checkpoints a run keeps (runtime/train/checkpoint.py removes older ones once a new one is complete), so
while the next is written there are KEEP_CHECKPOINTS + 1 on disk."""


def kept_checkpoints(cfg: MoesysConfig) -> int:
    """Complete checkpoints kept: train.keep_checkpoints (its default is KEEP_CHECKPOINTS)."""
    return cfg.train.keep_checkpoints


def checkpoints_written(cfg: MoesysConfig, first_step: int = 0) -> int:
    """Checkpoints a run writes from `first_step` to train.max_steps: every train.checkpoint_every steps, and at the
    end when train.final_checkpoint (once, if the last step is also a checkpoint_every step)."""
    tr = cfg.train
    steps = range(first_step + 1, tr.max_steps + 1)
    every = sum(1 for s in steps if tr.checkpoint_every and s % tr.checkpoint_every == 0)
    last = tr.max_steps > first_step and tr.final_checkpoint and not (
        tr.checkpoint_every and tr.max_steps % tr.checkpoint_every == 0)
    return every + int(last)


def checkpoints_on_disk(cfg: MoesysConfig, existing: int = 0, first_step: int = 0) -> int:
    """Most checkpoints on disk at once, with `existing` complete ones there already: the kept ones and the one being
    written, or fewer when the run writes fewer."""
    return min(existing + checkpoints_written(cfg, first_step), kept_checkpoints(cfg) + 1)


@dataclass(frozen=True)
class DiskPlan:
    """Bytes a training run writes, per node (the store of each of the node's ranks) and in its run directory."""

    store_bytes: int
    """The node's SSD expert stores (storage.offload=ssd), at storage.ssd_path or RUN_DIR/expert_store."""
    checkpoint_bytes: int
    """One checkpoint, in RUN_DIR/checkpoints."""
    checkpoints: int
    """Most checkpoints on disk at once."""

    @property
    def checkpoints_bytes(self) -> int:
        return self.checkpoints * self.checkpoint_bytes

    @property
    def total_bytes(self) -> int:
        return self.store_bytes + self.checkpoints_bytes

    def describe(self, checkpoints: int | None = None) -> str:
        """"expert store X GB + N checkpoints of Y GB" (the parts that are not zero)."""
        n = self.checkpoints if checkpoints is None else checkpoints
        parts = [f"expert store {self.store_bytes / GB:.2f} GB"] if self.store_bytes else []
        if n:
            parts.append(f"{n} checkpoint{'s' if n > 1 else ''} of {self.checkpoint_bytes / GB:.2f} GB")
        return " + ".join(parts) or "nothing"


def store_file_bytes(expert_params: int) -> int:
    """One expert's live file in the SSD store: a header block, then its slot (fp32 weights, two moments and the
    4-byte step) padded to whole blocks (runtime/storage/live_files.py's direct layout, the larger of its two)."""
    return IO_BLOCK + -(-(CHECKPOINT_BYTES * expert_params + 4) // IO_BLOCK) * IO_BLOCK


def checkpoint_tensors(m: ModelConfig, p: ParamCounts) -> int:
    """Tensors in a checkpoint, at most: each block's attention (4 projections, their biases, 2 q/k norms), its 2 norms
    with biases, a dense FFN or a router with its score bias and a shared expert with its gate (3 projections, biases,
    gate), the embeddings, final norm and head; and every expert's slice of each stacked expert tensor."""
    per_expert = (3 if m.expert_type == "swiglu" else 2) * (2 if m.bias else 1)
    return 29 * m.num_layers + 5 + per_expert * m.num_experts * p.moe_layers


def checkpoint_bytes(m: ModelConfig, p: ParamCounts) -> int:
    """One checkpoint on disk, at most: 12 bytes a parameter, each tensor's ENTRY_BYTES and the fixed part."""
    return CHECKPOINT_BYTES * p.total + ENTRY_BYTES * checkpoint_tensors(m, p) + FIXED_CHECKPOINT_BYTES


def disk_plan(cfg: MoesysConfig, p: ParamCounts, mode: OffloadMode, store_bytes_per_rank: int) -> DiskPlan:
    """What a fresh run of `cfg` writes with expert states placed by `mode` (storage.offload=cpu keeps them in host
    RAM and writes no store; ssd writes `store_bytes_per_rank` for each rank of a node)."""
    store = store_bytes_per_rank * cfg.topology.processes_per_node if mode is OffloadMode.SSD else 0
    return DiskPlan(store_bytes=store, checkpoint_bytes=checkpoint_bytes(cfg.model, p),
                    checkpoints=checkpoints_on_disk(cfg))


def disk_problem(cfg: MoesysConfig, disk: DiskPlan) -> str | None:
    """The store and the checkpoints together against topology.ssd_gb on one node (the store alone is the plan's
    per-node check; with several nodes the run directory is shared storage, which the launch checks)."""
    t = cfg.topology
    room = t.ssd_gb * GB
    if t.nodes > 1 or disk.store_bytes > room or disk.total_bytes <= room:
        return None
    return f"disk per node {disk.total_bytes / GB:.2f} GB ({disk.describe()}) > topology.ssd_gb={t.ssd_gb:g} GB"


def fewer_checkpoints(cfg: MoesysConfig, disk: DiskPlan) -> tuple[MoesysConfig, str]:
    """(cfg writing fewer checkpoints, its overrides) for a disk_problem, whose store fits alone: only the final
    checkpoint when the store and one checkpoint fit, else none."""
    one = disk.store_bytes + disk.checkpoint_bytes <= cfg.topology.ssd_gb * GB and disk.checkpoints > 1
    train = dataclasses.replace(cfg.train, checkpoint_every=0, final_checkpoint=one)
    overrides = "train.checkpoint_every=0" + ("" if one else " train.final_checkpoint=false")
    return dataclasses.replace(cfg, train=train), overrides


def size(n: float) -> str:
    """Bytes for a message: GB to two places, or MB, KB, B when smaller."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale / 100 if unit == "GB" else n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a directory to be made will live)."""
    path = Path(path).expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def bytes_under(path: Path) -> int:
    """Bytes the files under `path` take on disk (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def check_free(writes: list[tuple[Path, int, str]], fix: str) -> None:
    """`writes` are (directory, bytes to be written there, what they are). Those on one filesystem are added up and
    compared with its free space; a UserError of one line names the bytes needed, the bytes free, the path and
    `fix` (what to change) when they do not fit."""
    by_fs: dict[int, list[tuple[Path, int, str]]] = {}
    for path, nbytes, what in writes:
        if nbytes > 0:
            by_fs.setdefault(os.stat(existing_parent(path)).st_dev, []).append((path, nbytes, what))
    for entries in by_fs.values():
        need = sum(n for _, n, _ in entries)
        free = shutil.disk_usage(existing_parent(entries[0][0])).free
        if need > free:
            where = " and ".join(str(p) for p, _, _ in entries)
            what = " + ".join(w for _, _, w in entries)
            raise UserError(f"not enough disk: {size(need)} to write to {where} ({what}) but its filesystem "
                            f"has {size(free)} free; {fix}")
