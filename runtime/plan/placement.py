"""The placement training runs with, decided once: `moesys train` plans (Eq. 1, `plan_placement`, once per launch),
writes the result to RUN_DIR/plan.json beside config.yaml, and every worker reads it, so no rank plans again and what
`storage.offload=auto` chose is on record. A resume keeps the recorded placement unless the config changed. The
Placement is what the workers build from: its `offload` (an OffloadMode) decides where expert states live."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.config import MoesysConfig
from runtime.files.paths import PLAN
from runtime.host.io import atomic_write_json
from runtime.plan.budget import GB
from runtime.plan.modes import OffloadMode
from runtime.plan.planner import Plan, plan_placement, plan_to_dict
from runtime.plan.rebalance import task_gpu_counts


@dataclass(frozen=True)
class Placement:
    """Where this run's expert states live and the budgets of each tier, per rank."""

    offload: OffloadMode
    """none, cpu or ssd (auto resolved)."""
    cpu_cache_experts: int
    """Experts the CPU cache holds (storage.cpu_cache_experts, or the plan's number; every local expert for cpu)."""
    local_experts: int
    device_capacity: int
    host_capacity: int
    ssd_capacity: int
    task_gpus: dict[str, int] = field(default_factory=dict)
    """Ranks per task of a multi-task load (the elastic allocation, the paper's "Elastic MoE Training"); empty
    otherwise."""
    device_expert_layers: int = 0
    """Offloaded modes: MoE layers whose active experts the device holds at once (0: the layer computing and
    storage.prefetch_depth ahead)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload", OffloadMode(self.offload))  # plan.json holds its name

    def to_dict(self) -> dict:
        """As plan.json records it (plain data)."""
        return {**dataclasses.asdict(self), "offload": str(self.offload)}


def decide(cfg: MoesysConfig, plan: Plan | None = None) -> tuple[Placement, dict]:
    """(the placement, the full plan as `moesys plan --json` prints it) for this config; `plan`: its plan, when the
    caller has it (made here otherwise)."""
    plan = plan or plan_placement(cfg)
    st, r, mode = cfg.storage, plan.per_rank, plan.mode
    cache = r.local_experts if mode is OffloadMode.CPU else min(st.cpu_cache_experts or r.cache_experts,
                                                                 r.local_experts)
    task_gpus = task_gpu_counts(cfg, cfg.topology.world_size, plan) if cfg.tasks else {}
    placement = Placement(mode, cache if mode.offloaded else 0, r.local_experts, r.device_capacity, r.host_capacity,
                          int(cfg.topology.ssd_gb * GB / cfg.topology.processes_per_node), task_gpus,
                          r.expert_window)
    return placement, plan_to_dict(plan)


def _digest(cfg: MoesysConfig) -> str:
    """What the placement depends on: the model, topology, storage and tasks sections and the batch shape."""
    parts: dict[str, Any] = {k: dataclasses.asdict(getattr(cfg, k)) for k in ("model", "topology", "storage")}
    parts["tasks"] = {name: dataclasses.asdict(task) for name, task in cfg.tasks.items()}
    tr = cfg.train
    parts["batch"] = [tr.micro_batch_size, tr.seq_len, tr.precision]
    if tr.grad_accum_steps != 1 or tr.recompute != "none":  # the split (a digest of a run without one unchanged)
        parts["batch"] += [tr.grad_accum_steps, tr.recompute]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def record(run_dir: Path, cfg: MoesysConfig, plan: Plan | None = None) -> tuple[Placement, str | None]:
    """Write RUN_DIR/plan.json for this launch (`plan`: the launch's plan of `cfg`, made here when not given). Returns
    (placement, a note when a resume re-planned because the config changed since the recorded plan, else None)."""
    path = Path(run_dir) / PLAN
    old = read(run_dir, with_digest=True)
    if old is not None and old[1] == _digest(cfg):
        return old[0], None
    placement, planned = decide(cfg, plan)
    atomic_write_json(path, {"placement": placement.to_dict(), "config_digest": _digest(cfg), "plan": planned})
    note = None
    if old is not None:
        changes = [f"{k} {getattr(old[0], k)} -> {getattr(placement, k)}" for k in ("offload", "cpu_cache_experts",
                                                                                   "task_gpus")
                   if getattr(old[0], k) != getattr(placement, k)]
        note = "the config changed since the recorded plan: re-planned" + (f" ({', '.join(changes)})" if changes
                                                                            else ", same placement")
    return placement, note


def read(run_dir: Path, with_digest: bool = False):
    """The recorded placement (and its config digest), or None when the run directory has no plan.json."""
    path = Path(run_dir) / PLAN
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    placement = Placement(**data["placement"])
    return (placement, data.get("config_digest")) if with_digest else placement
