"""Training-step throughput of a recipe, measured side by side in one run: 1 process vs 2 expert-parallel processes, and
flat vs hierarchical AlltoAll on 4 processes arranged as 2 nodes x 2 ranks (the paper's "Resource-Aware Communication"),
each with its MFU against this machine's measured matmul peak.

Each variant is a real `torchrun` job on its own run directory; tokens/s is the median over its steps after the
first (warm-up).
"""

from __future__ import annotations

import copy
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from runtime.bench.mfu import peak_flops, training_flops_per_token
from runtime.config import MoesysConfig
from runtime.launch import build_launch
from runtime.train.run_setup import prepare_run_dir
from runtime.files.run_dir import read_metrics


def _variant(base: MoesysConfig, root: Path, name: str, nproc: int, ep: int, alltoall: str,
             ranks_per_node: int, steps: int) -> MoesysConfig:
    cfg = copy.deepcopy(base)
    cfg.topology.nodes, cfg.topology.gpus_per_node = 1, 0
    cfg.topology.nproc_per_node, cfg.topology.expert_parallel = nproc, ep
    cfg.parallel.alltoall, cfg.parallel.ranks_per_node = alltoall, ranks_per_node
    cfg.train.max_steps, cfg.train.checkpoint_every, cfg.train.max_restarts = steps, 0, 0
    cfg.train.run_dir = str(root / name)
    # The global batch stays the same, so every variant does the same work per step.
    cfg.train.micro_batch_size = max(1, base.train.micro_batch_size * base.topology.nproc_per_node // nproc)
    return cfg


def _tokens_per_s(cfg: MoesysConfig) -> float:
    run_dir = prepare_run_dir(cfg)
    spec = build_launch(cfg, run_dir)
    done = subprocess.run(spec.argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark job {run_dir} failed: {done.stderr.strip().splitlines()[-1:]}")
    speeds = [m["tokens_per_s"] for m in read_metrics(run_dir)][1:]
    return statistics.median(speeds)


def run_train_bench(base: MoesysConfig, steps: int = 8) -> dict:
    with tempfile.TemporaryDirectory(prefix="moesys-bench-train-") as tmp:
        root = Path(tmp)
        variants = {
            "one_process": _variant(base, root, "one", 1, 1, "flat", 0, steps),
            "two_process_ep": _variant(base, root, "two", 2, 2, "flat", 0, steps),
            "flat_4": _variant(base, root, "flat4", 4, 4, "flat", 2, steps),
            "hierarchical_4": _variant(base, root, "hier4", 4, 4, "hierarchical", 2, steps),
        }
        speed = {name: _tokens_per_s(cfg) for name, cfg in variants.items()}
    peak = peak_flops(torch.device("cpu"), torch.float32)  # the variants run on this machine's CPU cores
    flops = training_flops_per_token(base.model, base.train.seq_len)
    return {
        "recipe": base.recipe, "steps": steps,
        "global_batch_tokens": base.train.micro_batch_size * base.topology.nproc_per_node * base.train.seq_len,
        "one_process_tokens_per_s": speed["one_process"],
        "two_process_tokens_per_s": speed["two_process_ep"],
        "two_vs_one": speed["two_process_ep"] / speed["one_process"],
        "flat_tokens_per_s": speed["flat_4"],
        "hierarchical_tokens_per_s": speed["hierarchical_4"],
        "hierarchical_vs_flat": speed["hierarchical_4"] / speed["flat_4"],
        "peak_flops": peak, "flops_per_token": flops,
        **{f"{name}_mfu": flops * tokens_per_s / peak for name, tokens_per_s in speed.items()},
    }
