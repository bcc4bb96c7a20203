"""TensorBoard event files beside metrics.jsonl (train.tensorboard=true): the same values, one scalar per number of a
step line (per-layer and per-rank lists become one tag each), each MoE layer's expert load as a histogram over the
expert index, and each task's samples/s of a multi-task run. Rank 0 writes; torch's SummaryWriter is imported only
when the key is on (the tensorboard package is an optional extra, checked by config validation).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from runtime.config import MoesysConfig
from runtime.files.paths import TENSORBOARD
from runtime.files.run_dir import task_samples_per_s
from runtime.train.rank_memory import PER_RANK_KEYS

NOT_SCALARS = {"step", "max_steps", "resumed_from", "restart"}
"""Step-line fields that are no measurement: the step axis itself and the marks of a worker start."""

HISTOGRAMS = {"expert_load", "expert_fraction"}
"""Per-layer lists of per-expert shares (after and before capacity): histograms over the expert index."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _list_axis(key: str) -> str:
    """Per-rank lists name their entries rank<R>; every other flat list (gate metrics) has one entry per MoE layer."""
    return "rank" if key in PER_RANK_KEYS or key.endswith("_per_rank") else "layer"


def scalars(record: dict) -> dict[str, float]:
    """Every number of a step line as {tag: value}: `loss`, `offload/cache_hit_rate`, `task_loss/task1`,
    `gate_entropy/layer0`, `memory/peak_rss_anon/rank1` ... (nested per-expert lists are histograms instead)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_SCALARS or key in HISTOGRAMS:
            continue
        if _is_number(value):
            out[key] = float(value)
        elif isinstance(value, dict):
            out.update({f"{key}/{name}": float(v) for name, v in value.items() if _is_number(v)})
        elif isinstance(value, list) and value and all(_is_number(v) for v in value):
            axis = _list_axis(key)
            out.update({f"{key}/{axis}{i}": float(v) for i, v in enumerate(value)})
    return out


def histograms(record: dict) -> dict[str, list[float]]:
    """{`expert_load/layer<i>`: per-expert shares} for each per-layer, per-expert list of a step line."""
    out: dict[str, list[float]] = {}
    for key in HISTOGRAMS:
        for layer, shares in enumerate(record.get(key) or []):
            if isinstance(shares, list) and shares and all(_is_number(v) for v in shares):
                out[f"{key}/layer{layer}"] = [float(v) for v in shares]
    return out


class TensorBoardLog:
    """The run's event files; steps past `resumed_from` written by an earlier attempt are purged by TensorBoard's
    readers (SummaryWriter's purge_step), as metrics.jsonl drops its lines past the checkpoint. A restart before
    the first checkpoint (resumed_from 0) purges from step 1: nothing of an earlier attempt stays."""

    def __init__(self, run_dir: Path, resumed_from: int = 0):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD),
                                    purge_step=resumed_from + 1, flush_secs=10)

    def write(self, record: dict, rank_lines: Iterable[dict] = ()) -> None:
        step = record["step"]
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        for tag, value in task_samples_per_s(rank_lines).items():
            self.writer.add_scalar(f"task_samples_per_s/{tag}", value, step)
        for tag, shares in histograms(record).items():
            self._expert_histogram(tag, shares, step)

    def _expert_histogram(self, tag: str, shares: list[float], step: int) -> None:
        """One bucket per expert (bucket e covers (e - 0.5, e + 0.5]) whose count is the expert's share."""
        finite = [v if math.isfinite(v) else 0.0 for v in shares]
        self.writer.add_histogram_raw(
            tag, min=-0.5, max=len(finite) - 0.5, num=sum(finite),
            sum=sum(e * v for e, v in enumerate(finite)), sum_squares=sum(e * e * v for e, v in enumerate(finite)),
            bucket_limits=[e + 0.5 for e in range(len(finite))], bucket_counts=finite, global_step=step)

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(cfg: MoesysConfig, run_dir: Path, resumed_from: int) -> TensorBoardLog | None:
    """The event-file writer when train.tensorboard is on (call on rank 0 only), else None."""
    return TensorBoardLog(run_dir, resumed_from) if cfg.train.tensorboard else None
