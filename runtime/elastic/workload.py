"""Per-task workload for elastic allocation: configured, or measured from a finished run (the paper's "Elastic MoE
Training").

The paper allocates by "the workload of the task that is statistically estimated in advance"; here that is
batch_size x cost_per_sample, with the cost either configured or measured as seconds per sample.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.elastic.allocation import AllocationError, Workload
from runtime.files.paths import METRICS


def workload_from_config(tasks: Mapping[str, Any]) -> dict[str, Workload]:
    """{name: (batch_size, cost_per_sample)} from the config's tasks (TaskConfig-like objects)."""
    return {name: (int(t.batch_size), float(t.cost_per_sample)) for name, t in tasks.items()}


def workload_from_metrics(run_dir: str | Path, batch_sizes: Mapping[str, int]) -> dict[str, Workload]:
    """{name: (batch_size, measured cost_per_sample)} from run_dir/metrics.jsonl.

    Expected lines (one JSON object each; other lines and lines without both fields are ignored):
        {"step": 12, "rank": 3, "task": "caption", "samples_per_s": 41.5, ...}
    written by each rank for the task it trains. A task's cost per sample is 1 / (mean samples_per_s over
    its lines), normalised so that the cheapest task costs 1.0. `batch_sizes` holds the configured tasks;
    a task measured but not configured, or configured but never measured, raises AllocationError.
    """
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise AllocationError(f"no metrics to measure workloads from: {path} does not exist")
    rates: dict[str, list[float]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise AllocationError(f"{path}:{lineno} is not a JSON line") from None
            if not isinstance(record, dict) or "task" not in record or "samples_per_s" not in record:
                continue
            task, rate = str(record["task"]), record["samples_per_s"]
            if not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
                raise AllocationError(f"{path}:{lineno} has samples_per_s={rate!r}; it must be positive")
            if task not in batch_sizes:
                raise AllocationError(f"task {task!r} in {path} is not configured (configured: "
                                      f"{', '.join(batch_sizes) or 'none'})")
            rates.setdefault(task, []).append(float(rate))
    missing = [name for name in batch_sizes if name not in rates]
    if missing:
        raise AllocationError(f"configured task {missing[0]!r} has no samples_per_s lines in {path}")
    cost = {name: len(r) / sum(r) for name, r in rates.items()}
    cheapest = min(cost.values())
    return {name: (int(batch_sizes[name]), cost[name] / cheapest) for name in batch_sizes}
