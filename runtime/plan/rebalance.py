"""`moesys rebalance`: allocate the GPUs of the topology to the tasks of a multi-task load (the paper's "Elastic MoE
Training").

The workload comes from the config (batch_size x cost_per_sample) or from a finished run's measured samples/s;
how many tasks one GPU may host comes from the plan's per-rank memory estimate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import yaml

from runtime.config import MoesysConfig
from runtime.elastic.allocation import Allocation, AllocationError, allocate
from runtime.elastic.workload import Workload, workload_from_config, workload_from_metrics
from runtime.host.io import atomic_write_text
from runtime.plan.budget import GB
from runtime.plan.planner import Plan, plan_placement, world_size


@dataclass(frozen=True)
class Rebalance:
    workload: dict[str, Workload]
    num_gpus: int
    max_tasks_per_gpu: int
    before: Allocation
    after: Allocation
    source: str
    """"config" or the run directory the workload was measured in."""


def tasks_per_gpu(cfg: MoesysConfig, plan: Plan | None = None) -> int:
    """How many task replicas fit in one rank's device memory, by the plan's per-rank estimate (of `plan`, when
    the caller has it)."""
    return _tasks_per_gpu(cfg, plan)[0]


def _tasks_per_gpu(cfg: MoesysConfig, plan: Plan | None = None) -> tuple[int, str]:
    """tasks_per_gpu, and why no more fit (empty when every task fits on one)."""
    est = (plan or plan_placement(cfg)).per_rank
    if est.device_total <= 0:
        return max(1, len(cfg.tasks)), ""
    fit = min(len(cfg.tasks), est.device_capacity // est.device_total)
    t = cfg.topology
    if fit >= len(cfg.tasks):
        why = ""
    elif t.gpus_per_node and not t.gpu_memory_gb:  # e.g. gpus_per_node set on topology=single, a CPU topology
        why = (f"topology.gpus_per_node={t.gpus_per_node} with topology.gpu_memory_gb=0 gives the GPUs no memory to "
               "share; set topology.gpu_memory_gb to one GPU's memory (e.g. topology.gpu_memory_gb=80), or use "
               "topology=a100-80g or topology=local")
    else:
        where = "GPU" if t.gpus_per_node else "rank's RAM share"
        why = (f"by the plan a task needs {est.device_total / GB:.2f} GB of device memory and a {where} has "
               f"{est.device_capacity / GB:.2f} GB")
    return max(1, fit), why


def task_gpu_counts(cfg: MoesysConfig, world: int, plan: Plan | None = None) -> dict[str, int]:
    """Ranks per task: tasks.*.gpus when every task has it (a recipe written by `moesys rebalance --write`), else
    the elastic allocation of the configured workload on `world` ranks within the plan's memory estimate."""
    if all(t.gpus > 0 for t in cfg.tasks.values()):
        return {n: t.gpus for n, t in cfg.tasks.items()}
    return allocate(workload_from_config(cfg.tasks), world, tasks_per_gpu(cfg, plan)).gpus


def rebalance(cfg: MoesysConfig, from_run: str | None = None) -> Rebalance:
    if not cfg.tasks:
        raise AllocationError("the config has no tasks; use a multi-task recipe such as recipe=ufo-multitask")
    batch_sizes = {name: t.batch_size for name, t in cfg.tasks.items()}
    workload = workload_from_metrics(from_run, batch_sizes) if from_run else workload_from_config(cfg.tasks)
    gpus, (per_gpu, why) = world_size(cfg), _tasks_per_gpu(cfg)
    try:
        after = allocate(workload, gpus, per_gpu)
    except AllocationError as exc:
        if not why or "do not fit" not in str(exc):
            raise
        raise AllocationError(f"{exc}: {why}") from None
    assert after.baseline is not None, "allocate() compares its allocation against the naive one"
    return Rebalance(workload=workload, num_gpus=gpus, max_tasks_per_gpu=per_gpu, before=after.baseline,
                     after=after, source=str(from_run) if from_run else "config")


def _throughput_per_gpu(a: Allocation, workload: dict[str, Workload]) -> float:
    """Samples per unit of time per GPU, when a step lasts as long as the slowest GPU's load."""
    samples = sum(batch for batch, _ in workload.values())
    return samples / (a.gpus_used * a.max_load_per_gpu)


def rebalance_to_dict(r: Rebalance) -> dict:
    """The public `moesys rebalance --json` contract."""
    def side(a: Allocation) -> dict:
        return {"allocation": a.gpus, "assignment": a.assignment, "batch_per_gpu": a.batch_per_gpu,
                "load_per_gpu": a.load_per_gpu, "max_load_per_gpu": a.max_load_per_gpu,
                "throughput_per_gpu": _throughput_per_gpu(a, r.workload)}
    before, after = side(r.before), side(r.after)
    return {
        "allocation": r.after.gpus,
        "max_load_per_gpu": {"before": r.before.max_load_per_gpu, "after": r.after.max_load_per_gpu},
        "throughput_per_gpu": {"before": before["throughput_per_gpu"], "after": after["throughput_per_gpu"]},
        "speedup_per_gpu": after["throughput_per_gpu"] / before["throughput_per_gpu"],
        "gpus": r.num_gpus, "max_tasks_per_gpu": r.max_tasks_per_gpu, "source": r.source,
        "workload": {name: {"batch_size": b, "cost_per_sample": c} for name, (b, c) in r.workload.items()},
        "before": before, "after": after,
    }


def write_rebalanced_recipe(recipe_yaml: str, cfg: MoesysConfig, r: Rebalance, path: str | Path,
                            name: str) -> Path:
    """A recipe file (`moesys train recipe=PATH`): the source recipe with the topology it was balanced for
    and tasks.*.gpus set."""
    data = copy.deepcopy(yaml.safe_load(recipe_yaml) or {})
    data["recipe"] = name
    topology = data.setdefault("topology", {})
    for key in ("nodes", "gpus_per_node", "nproc_per_node", "expert_parallel"):
        topology[key] = getattr(cfg.topology, key)
    tasks = data.setdefault("tasks", {})
    for task, gpus in r.after.gpus.items():
        tasks.setdefault(task, {})["gpus"] = gpus
    header = (f"# @package _global_\n# Written by `moesys rebalance` from the {r.source} workload: "
              f"max load per GPU {r.before.max_load_per_gpu:g} -> {r.after.max_load_per_gpu:g}.\n")
    path = Path(path)
    atomic_write_text(path, header + yaml.safe_dump(data, sort_keys=False))
    return path
