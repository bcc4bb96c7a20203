"""Training-step throughput of a recipe, measured side by side in one run: 1 process vs 2 expert-parallel processes, and
flat vs hierarchical AlltoAll on 4 processes arranged as 2 nodes x 2 ranks (the paper's "Resource-Aware Communication"),
each with its MFU against this machine's measured matmul peak.

Each variant is a real training job (the job API: planned once, torchrun) on its own run directory; its tokens/s is the
median over its steps after the first (warm-up). The variants run in `rounds` rounds, in turn within a round and in the
reverse order the next, so that a neighbour's load slows each pair alike: a ratio is taken within each round, the
reported one is their median, with every round's ratio and the spread (min, median, max) beside it.
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import torch

from runtime.bench.jobs import job_root
from runtime.bench.mfu import peak_flops, training_flops_per_token
from runtime.config import MoesysConfig
from runtime.files.run_dir import read_metrics
from runtime.launch.job import run_job

VARIANTS = {  # name: (processes, expert-parallel size, alltoall, ranks per node)
    "one_process": (1, 1, "flat", 0),
    "two_process_ep": (2, 2, "flat", 0),
    "flat_4": (4, 4, "flat", 2),
    "hierarchical_4": (4, 4, "hierarchical", 2),
}
RATIOS = {"two_vs_one": ("two_process_ep", "one_process"), "hierarchical_vs_flat": ("hierarchical_4", "flat_4")}
"""Each reported ratio: (numerator, denominator) variants' tokens/s, taken within a round."""
MIN_STEPS = 2
"""A variant's speed is the median of its steps after the first: it needs at least one of them."""


def _variant(base: MoesysConfig, root: Path, name: str, nproc: int, ep: int, alltoall: str,
             ranks_per_node: int, steps: int) -> MoesysConfig:
    cfg = copy.deepcopy(base)
    cfg.topology.nodes, cfg.topology.gpus_per_node = 1, 0
    cfg.topology.nproc_per_node, cfg.topology.expert_parallel = nproc, ep
    cfg.parallel.alltoall, cfg.parallel.ranks_per_node = alltoall, ranks_per_node
    cfg.train.max_steps, cfg.train.checkpoint_every, cfg.train.max_restarts = steps, 0, 0
    cfg.train.final_checkpoint, cfg.train.log_every = False, 1  # a throughput run: every step's speed, no resume
    cfg.train.run_dir = str(root / name)
    # The global batch stays the same, so every variant does the same work per step.
    cfg.train.micro_batch_size = max(1, base.train.micro_batch_size * base.topology.nproc_per_node // nproc)
    return cfg


def _tokens_per_s(cfg: MoesysConfig) -> float:
    run_dir = run_job(cfg).or_raise().run_dir
    steps = {m["step"]: m["tokens_per_s"] for m in read_metrics(run_dir) if "tokens_per_s" in m}
    if len(steps) != cfg.train.max_steps:
        raise RuntimeError(f"benchmark job {run_dir} logged {len(steps)} steps, not train.max_steps="
                           f"{cfg.train.max_steps}")
    return statistics.median(speed for step, speed in sorted(steps.items())[1:])


def spread(values: list[float]) -> dict[str, float]:
    """min, median and max of a ratio's rounds."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run_train_bench(base: MoesysConfig, steps: int = 8, rounds: int = 3, workdir: Path | None = None) -> dict:
    """Every variant `rounds` times for `steps` steps (train.max_steps when the user gives it), alternating; the run
    directories go in `workdir` (kept) or a temporary directory."""
    if steps < MIN_STEPS:
        raise ValueError(f"train.max_steps={steps}: moesys bench train needs at least {MIN_STEPS} steps (the first "
                         "is warm-up)")
    speeds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with job_root("moesys-bench-train-", workdir) as root:
        for r in range(rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                cfg = _variant(base, root, f"{name}-{r}", *VARIANTS[name], steps)
                speeds[name].append(_tokens_per_s(cfg))
    per_round = {ratio: [a / b for a, b in zip(speeds[num], speeds[den], strict=True)]
                 for ratio, (num, den) in RATIOS.items()}
    speed = {name: statistics.median(values) for name, values in speeds.items()}
    peak = peak_flops(torch.device("cpu"), torch.float32)  # the variants run on this machine's CPU cores
    flops = training_flops_per_token(base.model, base.train.seq_len)
    return {
        "recipe": base.recipe, "steps": steps, "rounds": rounds,
        "global_batch_tokens": base.train.micro_batch_size * base.topology.nproc_per_node * base.train.seq_len,
        "one_process_tokens_per_s": speed["one_process"],
        "two_process_tokens_per_s": speed["two_process_ep"],
        "two_vs_one": statistics.median(per_round["two_vs_one"]),
        "two_vs_one_rounds": per_round["two_vs_one"], "two_vs_one_spread": spread(per_round["two_vs_one"]),
        "flat_tokens_per_s": speed["flat_4"],
        "hierarchical_tokens_per_s": speed["hierarchical_4"],
        "hierarchical_vs_flat": statistics.median(per_round["hierarchical_vs_flat"]),
        "hierarchical_vs_flat_rounds": per_round["hierarchical_vs_flat"],
        "hierarchical_vs_flat_spread": spread(per_round["hierarchical_vs_flat"]),
        "peak_flops": peak, "flops_per_token": flops,
        **{f"{name}_mfu": flops * tokens_per_s / peak for name, tokens_per_s in speed.items()},
    }
