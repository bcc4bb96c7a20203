"""Training a model whose expert states outgrow the machine's memory (the paper's "Training Phase").

A training job runs as `moesys train` runs it (the job API: 2 processes, EP 2, storage.offload=ssd, topology=single),
its torchrun and workers inside a memory cgroup smaller than the model (the plan is told 85% of the cap), on a GPT-style
MoE sized so that its expert states (fp32 weights and AdamW moments, 12 bytes per parameter) are `ratio` times the
machine's RAM. Reported side by side: the states against the RAM and the cap, each rank's peak anonymous memory against
the plan's estimate, seconds per step, and the store's read and write bytes/s (rank 0's, doubled for the two ranks
sharing the disk) against the disk's own sequential bandwidth measured in the same run.

What must fit in memory is Eq. 1's CPU tier, 16aS: a step holds the experts it touches (a share `alpha` of them)
with their gradients until the CPU AdamW step. The model has many experts and top-1 routing over a few tokens per
step, so a step touches at most `alpha` of them, which is what lets 12S exceed the memory. The steps are the first
of a run (learning-rate warm-up over 100 steps), where routing is still spread; ten of them fill the CPU cache the
plan sized, so the measured peak is the steady state the plan predicts, not a cold start.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from runtime.bench.disk import measure_disk
from runtime.config import ModelConfig, MoesysConfig, validate
from runtime.errors import UserError
from runtime.files.paths import EXPERT_STORE
from runtime.files.run_dir import read_metrics
from runtime.host import memcap
from runtime.launch.job import run_job
from runtime.plan.params import count_parameters

HIDDEN, FFN, LAYERS, HEADS = 1024, 512, 6, 8
GPT_LAYOUT: dict[str, Any] = {"expert_type": "gelu", "norm": "layernorm", "position": "learned", "bias": True,
                              "tie_embeddings": True}
"""The model's layout, GPT-MoE's (recipe=tiny gives only the rest): its experts' size decides how many there are."""
GB = 1e9
PLANNED_SHARE = 0.85
TOKENS_PER_RANK = 32
"""train.seq_len x train.micro_batch_size: 64 tokens a step over 2 ranks, top-1, so a step touches at most 64 of a
layer's ~500 experts (alpha 1/8) and a rank at most 64 of its ~250 (the plan's device buffers hold 2 alpha)."""


def bench_config(base: MoesysConfig, experts: int, alpha: float, run_dir: Path, steps: int, memory_gb: float,
                 data: Path) -> MoesysConfig:
    """The capped run: `base` (the tiny recipe) on 2 CPU processes with expert parallelism 2 and the plan told
    `memory_gb` of RAM, a GPT-style MoE (GPT_LAYOUT) of `experts` experts per layer routed top-1, its expert states
    on SSD, trained on `data` without checkpoints; validated as `moesys train` validates a resolved config."""
    cfg = replace(
        base,
        model=replace(base.model, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_layers=LAYERS, num_heads=HEADS,
                      num_experts=experts, top_k=1, max_seq_len=64, **GPT_LAYOUT),
        topology=replace(base.topology, detect=False, nodes=1, gpus_per_node=0, gpu_memory_gb=0, ssd_gb=100,
                         cpu_memory_gb=round(memory_gb, 2), nproc_per_node=2, expert_parallel=2),
        train=replace(base.train, data=str(data), seq_len=TOKENS_PER_RANK, micro_batch_size=1, max_steps=steps,
                      warmup_steps=100, checkpoint_every=0, final_checkpoint=False, max_restarts=0,
                      run_dir=str(run_dir)),
        storage=replace(base.storage, offload="ssd", alpha=alpha))
    validate(cfg)
    return cfg


def _experts_for(ratio: float, ram: int) -> int:
    """The fewest experts per layer (even, for EP 2) whose states are `ratio` x `ram`."""
    one = count_parameters(ModelConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_layers=LAYERS,
                                       num_heads=HEADS, num_experts=2, top_k=1, **GPT_LAYOUT)).per_expert
    experts = math.ceil(ratio * ram / (12 * one * LAYERS))
    return experts + experts % 2


def run_beyond_memory_bench(base: MoesysConfig, ratio: float = 1.5, cap_fraction: float = 0.75, steps: int = 10,
                            root: str | None = None) -> dict:
    """The tiny recipe (`base`) grown until its expert states are `ratio` x this machine's RAM, trained for `steps`
    steps under a memory cap of `cap_fraction` x the RAM."""
    why = memcap.available()
    if why:
        raise UserError(f"moesys bench beyond-memory needs a memory cgroup: {why}")
    ram = psutil.virtual_memory().total
    cap = int(cap_fraction * ram)
    experts = _experts_for(ratio, ram)
    alpha = min(1.0, 2 * TOKENS_PER_RANK / experts)
    work = Path(tempfile.mkdtemp(prefix="moesys-bench-beyond-", dir=root))
    run_dir = work / "run"
    try:
        disk = measure_disk(work)
        # Random printable characters route tokens to experts about uniformly, so a step touches the share alpha
        # the plan assumes (text, a few frequent letters, routes most tokens of a fresh model to a few experts).
        data = work / "random-text.txt"
        data.write_text("".join(random.Random(0).choices([chr(c) for c in range(32, 127)], k=1 << 20)))
        # The plan gets 85% of the cap: the rest is the page cache the store's reads and writes pass through.
        cfg = bench_config(base, experts, alpha, run_dir, steps, PLANNED_SHARE * cap / GB, data)
        began = time.perf_counter()
        with memcap.MemoryCap(cap, "moesys-bench") as group:
            job = run_job(cfg, preexec=group.preexec)  # torchrun and its workers run in the capped group
            oom_kills, cap_peak = group.oom_kills(), group.max_usage()
        wall = time.perf_counter() - began
        if not job.ok:
            raise UserError(f"the capped training run failed (exit {job.exit_code}, OOM kills {oom_kills}): "
                            f"{job.error or job.stopped}")
        plan = json.loads((run_dir / "plan.json").read_text())["plan"]
        records = read_metrics(run_dir)
        states = sum(f.stat().st_size for f in (run_dir / EXPERT_STORE).rglob("*.safetensors"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    last = records[-1]
    timed = records[1:] or records  # the first step also warms up
    step_s = statistics.median(r["step_time_s"] for r in timed)
    rate = lambda key: statistics.median(r.get(key, 0) / r["step_time_s"] for r in timed)  # noqa: E731
    read_bps, write_bps = rate("offload/ssd_read_bytes"), rate("offload/ssd_write_bytes")
    predicted = plan["per_rank"]["process_host_bytes"]
    measured = last.get("memory/peak_rss_anon", [])
    return {
        "model": {"experts_per_layer": experts, "moe_layers": LAYERS, "hidden": HIDDEN, "ffn": FFN,
                  "sparse_params": plan["params"]["sparse"], "alpha": alpha},
        "expert_states_bytes": states, "ram_bytes": ram, "memory_cap_bytes": cap,
        "states_vs_ram": states / ram, "states_vs_cap": states / cap,
        "oom_kills": oom_kills, "cgroup_peak_bytes_with_page_cache": cap_peak,
        "plan_rank_bytes": predicted,
        "measured_rank_peak_bytes": measured,
        "measured_vs_plan": [m / predicted for m in measured],
        "steps": len(records), "seconds_per_step": step_s, "wall_s": wall,
        "experts_active_per_step": last.get("offload/experts_active"),
        "rank0_store_read_bytes_per_s": read_bps, "rank0_store_write_bytes_per_s": write_bps,
        "disk": disk.as_dict(),
        "store_read_vs_disk": 2 * read_bps / disk.read_bytes_per_s,
        "store_write_vs_disk": 2 * write_bps / disk.write_bytes_per_s,
    }
