"""Offloaded training against resident training on the same shape, side by side in one run: the resolved config trained
by real `torchrun` jobs with storage.offload=none, cpu (and cpu with the delayed update) and ssd, each on its own run
directory; on request also cpu with the first half of the MoE layers kept on the device (cpu_half), or as many as the
plan says the GPU holds (cpu_fit). Reports tokens/s after warm-up, the ratios to none, MFU against the device's
measured matmul peak (and its data sheet's, mfu_spec), the host side of each offloaded step from its metrics (host
work, the hidden share, fetch stalls, alpha: the share of the offloaded experts a step activates), and each step's
bound (runtime/plan/step_time.py) from this machine's measured rates: bound_s, bound_term, bound_terms_s, vs_bound."""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from runtime.bench.jobs import job_root
from runtime.bench.machine import measured_rates
from runtime.bench.mfu import peak_flops, spec_peak_flops, training_flops_per_token
from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.files.run_dir import read_metrics
from runtime.launch.job import run_job
from runtime.model.precision import PRECISION_DTYPES
from runtime.plan.params import count_parameters
from runtime.plan.planner import plan_placement
from runtime.plan.step_time import Rates, StepBound, StepWork, compute_seconds, step_bound, tokens_per_rank

VARIANTS: dict[str, tuple[str, bool, float | str]] = {
            "none": ("none", False, 0.0), "cpu": ("cpu", False, 0.0), "cpu_delayed": ("cpu", True, 0.0),
            "ssd": ("ssd", False, 0.0), "cpu_half": ("cpu", False, 0.5), "cpu_half_delayed": ("cpu", True, 0.5),
            "cpu_fit": ("cpu", False, "fit"), "cpu_fit_delayed": ("cpu", True, "fit")}
"""Name -> (storage.offload, storage.delayed_update, MoE layers kept on the device with storage.resident_layers:
a share of them, the first half for 0.5, 0 keeps the config's; "fit": as many as the plan says the GPU holds,
placement.resident_layers_fit)."""
DEFAULT_VARIANTS = ("none", "cpu", "cpu_delayed", "ssd")


def variant_config(base: MoesysConfig, root: Path, name: str, steps: int) -> MoesysConfig:
    """`base` as the job of variant `name`: its storage, `steps` steps, no checkpoints or restarts, run in
    root/name."""
    cfg = copy.deepcopy(base)
    cfg.storage.offload, cfg.storage.delayed_update, kept = VARIANTS[name]
    cfg.storage.ssd_path = ""
    tr = cfg.train
    tr.max_steps, tr.checkpoint_every, tr.final_checkpoint, tr.max_restarts = steps, 0, False, 0
    tr.run_dir = str(root / name)
    if cfg.storage.offload == "none":  # the plan's fit last: the job as it runs (no checkpoints on its disk)
        cfg.storage.resident_layers = 0
    elif kept == "fit":
        cfg.storage.resident_layers = plan_placement(cfg).keepable_layers
    elif isinstance(kept, float) and kept:
        cfg.storage.resident_layers = int(cfg.model.num_moe_layers * kept)
    return cfg


def timed_job(cfg: MoesysConfig, warmup: int, timeout_s: float) -> dict:
    """One job: tokens/s (median of the steps after `warmup`) and the medians of its offload metrics; or the one
    line of why it was refused or failed."""
    try:
        job = run_job(cfg, time_limit_s=timeout_s)
    except UserError as exc:  # refused before launch, as moesys train refuses it (the plan says it does not fit)
        return {"error": str(exc)}
    if not job.ok:
        return {"error": job.error or job.stopped}
    run_dir = job.run_dir
    steps = read_metrics(run_dir)[warmup:]
    median = lambda key: statistics.median(m[key] for m in steps) if steps and key in steps[0] else None  # noqa
    out: dict[str, Any] = {"tokens_per_s": median("tokens_per_s"), "step_time_s": median("step_time_s"),
                           "steps_timed": len(steps)}
    for key in ("host_cost_s", "host_hidden_share", "fetch_stall_s", "experts_active", "copied_bytes",
                "grad_home_bytes", "ssd_read_bytes", "ssd_write_bytes"):
        value = median(f"offload/{key}")
        if value is not None:
            out[key] = value
    if "experts_active" in out and _offloaded_experts(cfg):
        out["alpha"] = out["experts_active"] / _offloaded_experts(cfg)
    kinds = sorted({k for m in steps for k in m if k.startswith("offload/time_")})
    if kinds:  # where an offloaded step's host time goes, per timeline kind (seconds a step, median; 0 if absent)
        out["time_s"] = {k[len("offload/time_"):-len("_s")]: statistics.median(m.get(k, 0.0) for m in steps)
                         for k in kinds}
    return out


def variant_bound(cfg: MoesysConfig, measured: dict, none: dict | None, rates: Rates) -> StepBound:
    """The bound of one variant's measured step (runtime/plan/step_time.py): the resident step's time (none's
    measured step, else the plan's compute), and the bytes and active experts its metrics report."""
    compute = (none["step_time_s"] if none and none.get("step_time_s")
               else compute_seconds(cfg, rates, tokens_per_rank(cfg)))
    d2h = measured.get("grad_home_bytes", 0.0)
    work = StepWork(compute_s=compute, h2d_bytes=max(0.0, measured.get("copied_bytes", 0.0) - d2h), d2h_bytes=d2h,
                    optimizer_params=measured.get("experts_active", 0) * count_parameters(cfg.model).per_expert,
                    host_cores=rates.cores / max(1, cfg.topology.processes_per_node),
                    disk_read_bytes=measured.get("ssd_read_bytes", 0.0),
                    disk_write_bytes=measured.get("ssd_write_bytes", 0.0))
    return step_bound(work, rates)


def _offloaded_experts(cfg: MoesysConfig) -> int:
    """The experts a rank keeps off the device: its local experts of every MoE layer past storage.resident_layers
    (the share of them a step activates is Eq. 1's alpha)."""
    local = cfg.model.num_experts // cfg.topology.expert_parallel
    if cfg.storage.resident_layers is None:  # auto: the plan picks them at launch, unknown here
        return 0
    return local * (cfg.model.num_moe_layers - cfg.storage.resident_layers)


def run_offload_train_bench(base: MoesysConfig, steps: int = 10, warmup: int = 3, time_limit_s: float = 1200.0,
                            variants: tuple[str, ...] = DEFAULT_VARIANTS, workdir: Path | None = None) -> dict:
    """`variants` (names of VARIANTS; the ratios need none) on the resolved config; `time_limit_s` is shared by the
    jobs (a job that runs out is reported with its error, not waited for); the run directories go in `workdir`
    (kept) or a temporary directory."""
    device = torch.device("cuda" if base.topology.gpus_per_node and torch.cuda.is_available() else "cpu")
    dtype = PRECISION_DTYPES[base.train.precision] if device.type == "cuda" else torch.float32
    peak = peak_flops(device, dtype)
    devices = base.topology.world_size if device.type == "cuda" else 1  # CPU ranks share one machine's cores
    flops = training_flops_per_token(base.model, base.train.seq_len)
    deadline = time.monotonic() + time_limit_s
    results = {}
    with job_root("moesys-bench-offload-train-", workdir) as tmp:
        for i, name in enumerate(variants):
            budget = max(60.0, (deadline - time.monotonic()) / (len(variants) - i))
            results[name] = timed_job(variant_config(base, Path(tmp), name, steps), warmup, budget)
    spec = spec_peak_flops(device, dtype)
    for r in results.values():
        if r.get("tokens_per_s"):
            r["mfu"] = flops * r["tokens_per_s"] / (peak * devices)
            if spec:
                r["mfu_spec"] = flops * r["tokens_per_s"] / (spec * devices)
    rates = measured_rates(base, device, "ssd" in variants)
    for name, r in results.items():
        if r.get("step_time_s"):
            r.update(variant_bound(variant_config(base, Path("."), name, steps), r, results.get("none"), rates)
                     .to_dict(r["step_time_s"]))
    none = results.get("none", {}).get("tokens_per_s")
    ratios = {f"{name}_vs_none": r["tokens_per_s"] / none for name, r in results.items()
              if name != "none" and none and r.get("tokens_per_s")}
    return {"device": str(device), "precision": base.train.precision, "peak_flops": peak,
            "flops_per_token": flops, "steps": steps, "warmup": warmup, **results, **ratios,
            "global_batch_tokens": base.train.micro_batch_size * base.topology.world_size * base.train.seq_len}
