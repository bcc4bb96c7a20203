"""The placement training runs with, decided once: `moesys train` plans (Eq. 1, `plan_placement`), writes the result
to RUN_DIR/plan.json beside config.yaml, and every worker reads it, so no rank plans again and what
`storage.offload=auto` chose is on record. A resume keeps the recorded placement unless the config changed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import MoesysConfig
from runtime.io import atomic_write_json
from runtime.plan.budget import GB
from runtime.plan.planner import plan_placement, plan_to_dict
from runtime.files.paths import PLAN


@dataclass(frozen=True)
class Placement:
    """Where this run's expert states live and the budgets of each tier, per rank."""

    offload: str
    """none, cpu or ssd (auto resolved)."""
    cpu_cache_experts: int
    """Experts the CPU cache holds (storage.cpu_cache_experts, or the plan's number; every local expert for cpu)."""
    local_experts: int
    device_capacity: int
    host_capacity: int
    ssd_capacity: int
    task_gpus: dict[str, int] = field(default_factory=dict)
    """Ranks per task of a multi-task load (the elastic allocation, seed 004 section 4.1); empty otherwise."""
    device_expert_layers: int = 0
    """Offloaded modes: MoE layers whose active experts the device holds at once (0: the layer computing and
    storage.prefetch_depth ahead)."""


def decide(cfg: MoesysConfig) -> tuple[Placement, dict]:
    """(the placement, the full plan as `moesys plan --json` prints it) for this config."""
    plan = plan_placement(cfg)
    st, r = cfg.storage, plan.per_rank
    mode = plan.mode if st.offload == "auto" else st.offload
    cache = r.local_experts if mode == "cpu" else min(st.cpu_cache_experts or r.cache_experts, r.local_experts)
    task_gpus = {}
    if cfg.tasks:
        from runtime.train.tasks import task_gpu_counts  # torch; only multi-task recipes need it

        task_gpus = task_gpu_counts(cfg, cfg.topology.world_size, plan)
    placement = Placement(mode, cache if mode != "none" else 0, r.local_experts, r.device_capacity, r.host_capacity,
                          int(cfg.topology.ssd_gb * GB / cfg.topology.processes_per_node), task_gpus,
                          r.expert_window)
    return placement, plan_to_dict(plan)


def _digest(cfg: MoesysConfig) -> str:
    """What the placement depends on: the model, topology, storage and tasks sections and the batch shape."""
    parts = {k: dataclasses.asdict(getattr(cfg, k)) for k in ("model", "topology", "storage")}
    parts["tasks"] = {name: dataclasses.asdict(task) for name, task in cfg.tasks.items()}
    parts["batch"] = [cfg.train.micro_batch_size, cfg.train.seq_len, cfg.train.precision]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def record(run_dir: Path, cfg: MoesysConfig) -> tuple[Placement, str | None]:
    """Write RUN_DIR/plan.json for this launch. Returns (placement, a note when a resume re-planned because the
    config changed since the recorded plan, else None)."""
    path = Path(run_dir) / PLAN
    old = read(run_dir, with_digest=True)
    if old is not None and old[1] == _digest(cfg):
        return old[0], None
    placement, plan = decide(cfg)
    atomic_write_json(path, {"placement": dataclasses.asdict(placement), "config_digest": _digest(cfg),
                             "plan": plan})
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
