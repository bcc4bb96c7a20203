"""What a training report reads from a run directory: the step lines of metrics.jsonl (a torn or half-written last
line is skipped), the per-rank lines of multi-task runs, where the run resumed or restarted, whether it is still
going, its config, its plan and the plan's memory estimate against each rank's measured peak.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import UserError
from runtime.files.paths import CONFIG, LOCK, METRICS, PLAN
from runtime.files.run_dir import is_run_dir, model_files, read_metrics


@dataclass(frozen=True)
class StartMark:
    """A worker start after the first: a resume from a checkpoint and/or a torchrun restart of the workers."""

    step: int
    """The first step line written after the start."""
    resumed_from: int
    restart: int

    @property
    def label(self) -> str:
        parts = ([f"restart {self.restart}"] if self.restart else []) + (
            [f"resumed from step {self.resumed_from}"] if self.resumed_from else [])
        return ", ".join(parts) or "restart"


@dataclass
class RunData:
    run_dir: Path
    steps: list[dict]
    """Step lines (they carry "loss"), one per step, in step order."""
    rank_lines: list[dict] = field(default_factory=list)
    """Per-rank task lines of multi-task runs: step, rank, task, samples, compute_s, samples_per_s."""
    marks: list[StartMark] = field(default_factory=list)
    config_text: str = ""
    plan: dict | None = None
    """RUN_DIR/plan.json (placement, config digest and the plan), when the run has one."""
    running: bool = False
    """A `moesys train` holds the run directory's lock now."""

    @property
    def last_step(self) -> int:
        return self.steps[-1]["step"] if self.steps else 0

    @property
    def max_steps(self) -> int:
        return int(self.steps[-1].get("max_steps", 0)) if self.steps else 0

    @property
    def status(self) -> str:
        if not self.steps:
            return "running, no step finished yet" if self.running else "no step recorded"
        where = f"step {self.last_step} of {self.max_steps}"
        if self.running:
            return f"running: {where}"
        return f"finished: {where}" if self.last_step >= self.max_steps else f"stopped at {where}"

    def has(self, key: str) -> bool:
        return any(key in s for s in self.steps)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a numeric step-line field, over the lines that have it."""
        points = [(s["step"], s[key]) for s in self.steps if isinstance(s.get(key), (int, float))]
        return [p[0] for p in points], [float(p[1]) for p in points]

    def ranked_by(self, per_rank: Callable[[dict], list]) -> dict[int, tuple[list[int], list[float]]]:
        """{rank: (steps, values)} of `per_rank(step line)`, a list with one value per rank (a per-rank field such as
        memory/peak_rss_anon, or a sum of such fields)."""
        out: dict[int, tuple[list[int], list[float]]] = {}
        for s in self.steps:
            for rank, value in enumerate(per_rank(s)):
                steps, values = out.setdefault(rank, ([], []))
                steps.append(s["step"])
                values.append(float(value))
        return out


def _lock_held(run_dir: Path) -> bool:
    """Whether a process holds the flock of RUN_DIR/.lock (runtime.files.run_dir.RunLock), read from /proc/locks so that
    looking never takes the lock a starting `moesys train` wants. False where /proc/locks cannot be read."""
    try:
        st = (run_dir / LOCK).stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return False
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(line.split()[1:2] == ["FLOCK"] and wanted in line.split() for line in locks.splitlines())


def start_marks(steps: list[dict]) -> list[StartMark]:
    return [StartMark(s["step"], int(s.get("resumed_from", 0)), int(s.get("restart", 0)))
            for s in steps if s.get("resumed_from") or s.get("restart")]


def read_run(run_dir: str | Path) -> RunData:
    """A run directory's data; UserError when `run_dir` is not one."""
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        found = model_files(run_dir)
        why = f"it holds a model: {', '.join(found)}" if found else f"no {CONFIG} with logs/, checkpoints/ or {METRICS}"
        raise UserError(f"{run_dir} is not a run directory ({why}); pass the train.run_dir of a moesys train run, or "
                        "a moesys infer --json file")
    by_step: dict[int, dict] = {}
    rank_lines = []
    for record in read_metrics(run_dir):
        if "loss" in record and isinstance(record.get("step"), int):
            by_step[record["step"]] = record  # a step written twice (a restart mid-write): the later line
        elif "task" in record and "rank" in record:
            rank_lines.append(record)
    steps = [by_step[k] for k in sorted(by_step)]
    plan = None
    if (run_dir / PLAN).exists():
        try:
            plan = json.loads((run_dir / PLAN).read_text())
        except ValueError:
            plan = None  # being replaced: the page shows no plan rather than failing
    config_text = (run_dir / CONFIG).read_text(errors="replace") if (run_dir / CONFIG).exists() else ""
    return RunData(run_dir=run_dir, steps=steps, rank_lines=rank_lines, marks=start_marks(steps),
                   config_text=config_text, plan=plan, running=_lock_held(run_dir))
