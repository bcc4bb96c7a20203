"""The plan against the run: per rank and tier, the bytes the recorded plan predicted beside the
peak each rank measured (runtime/train/rank_memory.py), and their ratio. What `moesys plan --compare RUN_DIR` prints.

Tiers: without a GPU the device pool and the host cache are one RAM pool, compared as "ram" (the plan's
process_host_bytes: states, activations, cache and the worker's runtime); with GPUs, "device" (CUDA max allocated)
and "host" (anonymous RSS and pinned host memory); "ssd" is the rank's expert store files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import UserError
from runtime.files.paths import CONFIG, PLAN
from runtime.files.run_dir import load_config, read_metrics, read_rank_memory
from runtime.plan.planner import plan_placement, plan_to_dict

TOLERANCE = 0.2
"""Measured within 20% of predicted is the plan's accuracy target."""

MEASURED_KEYS = {"ram": ("memory/peak_rss_anon",), "host": ("memory/peak_rss_anon", "memory/pinned_host"),
                 "device": ("memory/cuda_max_allocated",), "ssd": ("memory/ssd_bytes",)}
"""Per tier, the per-rank metrics whose sum is its measured bytes: with a GPU the host's pinned buffers (the stages
copies to the device read, the gradients' staging) are outside the anonymous RSS, and the host tier holds them."""


def tier_bytes(tier: str, record: dict) -> list[int]:
    """A metrics line's or memory file's per-rank bytes of `tier` ([] when it holds none): the sum of its keys, a
    key the record lacks (a run from before it was measured) counted as 0."""
    series = [record.get(key) or [] for key in MEASURED_KEYS[tier]]
    if not series[0]:
        return []
    return [sum(int(s[rank]) if rank < len(s) else 0 for s in series) for rank in range(len(series[0]))]


@dataclass(frozen=True)
class TierComparison:
    rank: int
    tier: str
    predicted_bytes: int
    measured_bytes: int | None
    """The run's peak on this rank; None when the rank recorded nothing."""

    @property
    def ratio(self) -> float | None:
        if self.measured_bytes is None or self.predicted_bytes <= 0:
            return None
        return self.measured_bytes / self.predicted_bytes

    @property
    def within(self) -> bool | None:
        """Within TOLERANCE of the prediction; None when there is nothing to compare (both zero counts as within)."""
        if self.measured_bytes is None:
            return None
        ratio = self.ratio
        if ratio is None:  # nothing predicted
            return self.measured_bytes == 0
        return abs(ratio - 1) <= TOLERANCE

    @property
    def ratio_text(self) -> str:
        """The ratio with as many digits as it takes for the printed figure to agree with `within` (decided on the
        unrounded ratio): 0.798 is off the plan, and "0.80" would read as within 20%; "-" without a ratio."""
        if self.ratio is None:
            return "-"
        return ratio_text(self.ratio, bool(self.within))


def ratio_text(ratio: float, within: bool) -> str:
    """`ratio` rounded to the fewest digits (two or more) whose value is on the same side of TOLERANCE as the
    unrounded ratio."""
    for digits in range(2, 10):
        text = f"{ratio:.{digits}f}"
        if (abs(float(text) - 1) <= TOLERANCE) == within:
            return text
    return repr(ratio)


def predicted_per_rank(plan: dict, gpus_per_node: int) -> dict[str, int]:
    """The plan's bytes per rank for each compared tier (`plan` as `moesys plan --json` prints it)."""
    r = plan["per_rank"]
    if gpus_per_node:
        return {"device": int(r["device_total"]), "host": int(r["process_host_bytes"]), "ssd": int(r["ssd"])}
    return {"ram": int(r["process_host_bytes"]), "ssd": int(r["ssd"])}


def measured_peaks(run_dir: Path) -> dict[str, dict[int, int]]:
    """{tier: {rank: peak}} over every step line of metrics.jsonl and the ranks' memory files."""
    peaks: dict[str, dict[int, int]] = {}

    def see(tier: str, rank: int, value: int) -> None:
        per_tier = peaks.setdefault(tier, {})
        per_tier[rank] = max(per_tier.get(rank, 0), value)

    for record in read_metrics(run_dir):
        for tier in MEASURED_KEYS:
            for rank, value in enumerate(tier_bytes(tier, record)):
                see(tier, rank, value)
    for record in read_rank_memory(run_dir):  # a rank's last word, written after its last step line
        if isinstance(record.get("rank"), int):
            one_rank = {key: [record[key]] for keys in MEASURED_KEYS.values() for key in keys if key in record}
            for tier in MEASURED_KEYS:
                for value in tier_bytes(tier, one_rank):
                    see(tier, record["rank"], value)
    return peaks


def recorded_plan(run_dir: Path) -> dict:
    """The plan the run was launched with (RUN_DIR/plan.json), else the plan of its config.yaml."""
    path = Path(run_dir) / PLAN
    if path.exists():
        return json.loads(path.read_text())["plan"]
    return plan_to_dict(plan_placement(load_config(run_dir)))


def compare_run(run_dir: Path) -> list[TierComparison]:
    """Every rank's tiers, predicted against measured. UserError when `run_dir` is no run or measured nothing."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG).exists():
        raise UserError(f"{run_dir} is not a run directory (no {CONFIG}); pass the train.run_dir of a moesys train run")
    cfg = load_config(run_dir)
    plan = recorded_plan(run_dir)
    peaks = measured_peaks(run_dir)
    if "ram" not in peaks:
        raise UserError(f"{run_dir} holds no measured memory (memory/peak_rss_anon in metrics.jsonl): let moesys train "
                        "run at least one step there")
    predicted = predicted_per_rank(plan, cfg.topology.gpus_per_node)
    world = int(plan["per_rank"]["world_size"])
    return [TierComparison(rank, tier, nbytes, peaks.get(tier, {}).get(rank))
            for rank in range(world) for tier, nbytes in predicted.items()]


def comparison_to_dict(run_dir: Path, rows: list[TierComparison]) -> dict:
    """The `moesys plan --compare --json` contract."""
    ranks: dict[int, dict] = {}
    for row in rows:
        ranks.setdefault(row.rank, {})[row.tier] = {
            "predicted_bytes": row.predicted_bytes, "measured_bytes": row.measured_bytes,
            "ratio": row.ratio, "within_tolerance": row.within}
    return {"run_dir": str(run_dir), "tolerance": TOLERANCE,
            "ranks": [{"rank": rank, "tiers": tiers} for rank, tiers in sorted(ranks.items())],
            "within_tolerance": all(row.within is not False for row in rows)}
