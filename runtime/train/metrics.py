"""Per-step metrics: one all-reduce of the loss, router losses and per-layer expert load; JSON lines on rank 0."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from runtime.files.paths import METRICS
from runtime.files.run_dir import read_metrics
from runtime.host.io import atomic_write_text
from runtime.parallel.groups import ParallelGroups


def memory_bytes(device: torch.device) -> int:
    """Peak device memory on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(psutil.Process(os.getpid()).memory_info().rss)


def step_stats(lm_loss: torch.Tensor, out, groups: ParallelGroups, memory: int,
               per_rank: dict[str, int] | None = None) -> dict:
    """Global means over ranks of the losses and of every gate metric per MoE layer; memory per rank, and each of
    `per_rank` (this rank's value of each) as a list with one entry per rank. One all-reduce for all of it.

    Gate metrics (runtime.moe.metrics) come out as one list per metric with one entry per MoE layer, e.g.
    "gate_entropy": [2.01, 1.97], "expert_load": [[0.12, ...], ...] (fraction routed to each expert after capacity).
    """
    stats = out.moe_stats
    loss_names = sorted(stats[0].losses) if stats else []
    metric_names = sorted(stats[0].metrics) if stats else []
    parts = [lm_loss.float().reshape(1), out.aux_loss.detach().float().reshape(1)]
    parts += [torch.stack([s.losses[n].float() for s in stats]).mean().reshape(1) for n in loss_names]
    parts += [s.metrics[n].float().reshape(-1) for n in metric_names for s in stats]
    ranked = {"memory_bytes_per_rank": memory, **(per_rank or {})}
    mem = torch.zeros(len(ranked), groups.world_size, dtype=torch.float64)  # exact for integers below 2**53
    mem[:, groups.rank] = torch.tensor([float(v) for v in ranked.values()], dtype=torch.float64)
    flat = torch.cat([p.detach().cpu() for p in parts]).double()
    if groups.world_size > 1:
        both = torch.cat([flat, mem.reshape(-1)])
        dist.all_reduce(both)
        flat, mem = both[:flat.numel()] / groups.world_size, both[flat.numel():].reshape(mem.shape)
    values = iter(flat.tolist())
    out_stats = {"loss": next(values), "aux_loss": next(values)}
    out_stats.update({f"{n}_loss": next(values) for n in loss_names})
    for name in metric_names:
        per_layer = []
        for s in stats:
            numel = s.metrics[name].numel()
            row = [round(next(values), 5) for _ in range(numel)]
            per_layer.append(row if s.metrics[name].dim() else row[0])
        out_stats["expert_load" if name == "expert_routed_fraction" else name] = per_layer
    loads = out_stats.get("expert_load", [])
    out_stats["expert_load_max_over_mean"] = (
        sum(max(layer) / (sum(layer) / len(layer)) for layer in loads) / len(loads) if loads else 1.0)
    out_stats.update({name: [int(m) for m in row] for name, row in zip(ranked, mem.tolist(), strict=True)})
    return out_stats


def start_marks(resumed_from: int) -> dict:
    """Fields of the first step line a worker writes: `resumed_from` (the checkpoint's step) and `restart` (torchrun's
    restarts of this launch's workers), so a reader sees where the run resumed or restarted; empty on a fresh start."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return {**({"resumed_from": resumed_from} if resumed_from > 0 else {}), **({"restart": restart} if restart else {})}


class MetricsWriter:
    """Appends one JSON object per step to run_dir/metrics.jsonl; on resume drops lines past the checkpoint and
    a line torn by a kill mid-write (read_metrics skips it)."""

    def __init__(self, run_dir: Path, resume_step: int):
        self.path = Path(run_dir) / METRICS
        if self.path.exists():
            kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.file = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def write_many(self, records: list[dict]) -> None:
        """Several lines in one write, so a reader never sees the first without the last."""
        self.file.write("".join(json.dumps(r) + "\n" for r in records))
        self.file.flush()
