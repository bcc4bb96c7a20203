"""Elastic multi-task training measured (the paper's "Elastic MoE Training", design and ablation, figure 6): a 2-task
load with a 3:1 imbalance on 4 processes, trained with the naive 2/2 allocation and with the rebalanced one, side by
side.

Each variant is a real multi-task training job (the job API: planned once, torchrun) on its own run directory;
throughput per process is all samples of a step over the median step time (steps after the first) over the 4 processes.
The rebalanced allocation is what `allocate()` (the `moesys rebalance` search) gives for the workload, not a hard-coded
3/1.
"""

from __future__ import annotations

import copy
import os
import statistics
from pathlib import Path

from runtime.bench.jobs import job_root
from runtime.config import MoesysConfig, TaskConfig
from runtime.elastic.allocation import allocate
from runtime.elastic.workload import workload_from_config, workload_from_metrics
from runtime.files.run_dir import read_metrics
from runtime.launch.job import run_job

NPROC = 4


def _variant(base: MoesysConfig, root: Path, name: str, tasks: dict[str, TaskConfig], steps: int,
             expert_parallel: int | None = None) -> MoesysConfig:
    cfg = copy.deepcopy(base)
    cfg.topology.nodes, cfg.topology.gpus_per_node, cfg.topology.nproc_per_node = 1, 0, NPROC
    cfg.topology.expert_parallel = expert_parallel or next(
        ep for ep in (NPROC, 2, 1) if cfg.model.num_experts % ep == 0)
    cfg.parallel.ranks_per_node = 0
    cfg.storage.offload = "none"
    cfg.train.max_steps, cfg.train.checkpoint_every, cfg.train.max_restarts = steps, 0, 0
    cfg.train.run_dir = str(root / name)
    cfg.tasks = copy.deepcopy(tasks)
    return cfg


def _per_process(run_dir: Path, samples_per_step: int) -> float:
    times = [m["step_time_s"] for m in read_metrics(run_dir) if "loss" in m][1:]
    return samples_per_step / statistics.median(times) / NPROC


def run_elastic_bench(base: MoesysConfig, steps: int = 8, rounds: int = 2, workdir: Path | None = None) -> dict:
    """{imbalanced,rebalanced}_samples_per_s_per_process and their ratio; the variants alternate for `rounds`
    rounds (the medians over rounds are reported) so that a noisy neighbour slows both alike. The run directories
    go in `workdir` (kept) or a temporary directory."""
    light = max(1, base.train.micro_batch_size)
    tasks = {"heavy": TaskConfig(batch_size=3 * light), "light": TaskConfig(batch_size=light)}
    workload = workload_from_config(tasks)
    balanced = allocate(workload, NPROC, 1)
    counts = {"imbalanced": {"heavy": 2, "light": 2}, "rebalanced": balanced.gpus}
    samples = sum(t.batch_size for t in tasks.values())
    speeds: dict[str, list[float]] = {name: [] for name in counts}

    def with_gpus(gpus: dict[str, int]) -> dict[str, TaskConfig]:
        return {t: TaskConfig(batch_size=c.batch_size, gpus=gpus[t]) for t, c in tasks.items()}

    with job_root("moesys-bench-elastic-", workdir) as root:
        for r in range(rounds):
            for name, gpus in counts.items():
                run_dir = run_job(_variant(base, root, f"{name}-{r}", with_gpus(gpus), steps)).or_raise().run_dir
                speeds[name].append(_per_process(run_dir, samples))
        # What `moesys rebalance --from-run` finds in the imbalanced job, measured with replicated experts: with
        # expert parallelism every MoE layer's AlltoAll makes a light rank wait for the heavy ones inside its
        # compute time, which hides the imbalance from the per-rank speeds.
        probe = run_job(_variant(base, root, "measure", with_gpus(counts["imbalanced"]), steps, 1)).or_raise().run_dir
        measured = workload_from_metrics(probe, {t: c.batch_size for t, c in tasks.items()})
    imbalanced, rebalanced = (statistics.median(speeds[n]) for n in ("imbalanced", "rebalanced"))
    baseline = balanced.baseline
    assert baseline is not None, "allocate() compares its allocation against the naive one"
    return {
        "recipe": base.recipe, "processes": NPROC, "cpu_cores": os.cpu_count(), "steps": steps, "rounds": rounds,
        "batch_sizes": {t: c.batch_size for t, c in tasks.items()},
        "imbalanced_allocation": counts["imbalanced"], "rebalanced_allocation": counts["rebalanced"],
        "max_load_per_process": {"imbalanced": baseline.max_load_per_gpu,
                                 "rebalanced": balanced.max_load_per_gpu},
        "expected_ratio_from_load": baseline.max_load_per_gpu / balanced.max_load_per_gpu,
        "measured_cost_per_sample": {t: cost for t, (_, cost) in measured.items()},
        "allocation_from_measured_run": allocate(measured, NPROC, 1).gpus,
        "imbalanced_samples_per_s_per_process": imbalanced,
        "rebalanced_samples_per_s_per_process": rebalanced,
        "rebalanced_vs_imbalanced": rebalanced / imbalanced,
    }
