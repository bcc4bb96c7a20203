"""`moesys plan --measure`: this machine's rates, measured here and kept in its profile
(runtime/plan/machine_profile.py) for later plans: pinned copies each way (with a GPU), torch's fused AdamW per CPU
core, the disk each way, the dense GEMM rate, and the resident MFU of the planned model's training step as its job
runs it (a short real job in the planned layout: its ranks, backend, threads and collectives)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from runtime.bench.disk import measure_disk
from runtime.bench.mfu import peak_flops
from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.host.topology import set_cpu_threads
from runtime.model.precision import PRECISION_DTYPES
from runtime.plan.machine_profile import cache_root, machine_rates, model_key, usable_cores, write_profile
from runtime.plan.step_time import GB, Rates, resident_mfu_of
from runtime.storage.optim import AdamWHyper, fused_adamw

PROBE_STEPS, PROBE_WARMUP = 10, 3
"""The resident probe job's steps, and how many of them are warm-up (not timed): as `moesys bench offload-train`
times its jobs, so that both see the same steady state."""
PROBE_TIME_LIMIT_S = 600.0
"""Seconds the resident probe job may run before it counts as failed."""
ADAMW_PARAMS = 1 << 24
"""Parameters the AdamW probe steps (64 MB a tensor: past every cache, as a real step's are)."""
COPY_BYTES = 256 << 20
DISK_BYTES = 256 << 20


def _median_seconds(fn, repeats: int = 3, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def adamw_params_per_s_per_core(params: int = ADAMW_PARAMS) -> float:
    """torch's fused CPU AdamW over `params` fp32 parameters on every usable core, per core."""
    cores = usable_cores()
    before = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        p, g, m, v = (torch.randn(params) for _ in range(4))
        v.abs_()
        step = torch.zeros(())
        seconds = _median_seconds(lambda: fused_adamw([p], [g], [m], [v], [step], 1e-4, AdamWHyper()))
    finally:
        torch.set_num_threads(before)
    return params / seconds / cores


def pinned_copy_gbps(nbytes: int = COPY_BYTES) -> tuple[float, float]:
    """(host to device, device to host) GB/s of one pinned copy of `nbytes` on GPU 0."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    h2d = _median_seconds(lambda: device.copy_(host, non_blocking=True), sync=sync)
    d2h = _median_seconds(lambda: host.copy_(device, non_blocking=True), sync=sync)
    return nbytes / h2d / GB, nbytes / d2h / GB


def _probe_config(cfg: MoesysConfig, memory_bytes: float, gpus: int) -> MoesysConfig:
    """The planned job trained resident on one node of its layout (its ranks, expert parallelism within the node, the
    backend and threads a rank gets; on the `gpus` this machine has), with as many of its layers as fit a rank's
    share of `memory_bytes` (a model's MFU hardly changes with its depth), no accumulation or recomputation."""
    from runtime.plan.params import count_parameters

    m, t = cfg.model, cfg.topology
    per_layer = max(1, count_parameters(m).total // max(1, m.num_layers))
    layers = max(m.moe_layer_freq, min(m.num_layers, int(memory_bytes / 4 / (16 * per_layer))))
    layers -= layers % m.moe_layer_freq
    model = dataclasses.replace(m, num_layers=max(layers, m.moe_layer_freq))
    topology = dataclasses.replace(t, nodes=1, gpus_per_node=min(t.gpus_per_node, gpus))
    topology = dataclasses.replace(topology, expert_parallel=math.gcd(t.expert_parallel, topology.processes_per_node))
    storage = dataclasses.replace(cfg.storage, offload="none", resident_layers=0, delayed_update=False,
                                  dense_shard=False)
    train = dataclasses.replace(cfg.train, grad_accum_steps=1, recompute="none", eval_every=0,
                                micro_batch_size=max(1, cfg.train.micro_batch_size))
    return dataclasses.replace(cfg, model=model, topology=topology, storage=storage, train=train,
                               launcher=dataclasses.replace(cfg.launcher, name="local", node_rank=0))


def resident_mfu(probe: MoesysConfig, gemm_flops: float, gpus: bool) -> float:
    """The resident step's MFU against `gemm_flops` (a GPU's, or the node's cores') as the job runs it: `probe`
    launched as a real job (torchrun, its ranks, their backend and threads, the collectives between them), the median
    step after PROBE_WARMUP."""
    from runtime.bench.offload_train import timed_job, variant_config  # it imports this module

    with tempfile.TemporaryDirectory(prefix="moesys-measure-") as tmp:
        step = timed_job(variant_config(probe, Path(tmp), "none", PROBE_STEPS), PROBE_WARMUP, PROBE_TIME_LIMIT_S)
    if not step.get("step_time_s"):
        raise UserError(f"moesys plan --measure: the resident probe job failed ({step.get('error')}); fix the "
                        "config, or set topology.resident_mfu instead of measuring it")
    return min(1.0, resident_mfu_of(probe, gemm_flops, gpus, step["step_time_s"]))  # > 1 only on a busier probe


def measure_machine(cfg: MoesysConfig, disk_dir: str | Path | None = None) -> tuple[dict, Path]:
    """Measure this machine's rates (and the planned model's resident MFU in its job's layout) and merge them into
    its profile. Returns (the rates measured, the profile's path)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and cfg.topology.gpus_per_node else 0
    device = torch.device("cuda" if gpus else "cpu")
    rates: dict = {"adamw_gparams_per_core": adamw_params_per_s_per_core() / GB}
    if gpus:
        rates["pcie_h2d_gbps"], rates["pcie_d2h_gbps"] = pinned_copy_gbps()
    directory = Path(disk_dir or cfg.storage.ssd_path or cache_root())
    directory.mkdir(parents=True, exist_ok=True)
    disk = measure_disk(directory, DISK_BYTES)
    rates["disk_read_gbps"], rates["disk_write_gbps"] = disk.read_bytes_per_s / GB, disk.write_bytes_per_s / GB
    dtype = PRECISION_DTYPES[cfg.train.precision] if gpus else torch.float32
    threads = torch.get_num_threads()
    ranks = 1 if gpus else max(1, cfg.topology.processes_per_node)
    set_cpu_threads(ranks, respect_env=False)  # a rank's share of the cores, as the job's workers set it
    try:
        share = peak_flops(device, dtype)  # one rank's GEMM rate, measured at the threads its step runs with
    finally:
        torch.set_num_threads(threads)
    rates["gemm_tflops"] = share * ranks / 1e12  # the node's (the rate a plan divides among its ranks)
    memory = (torch.cuda.get_device_properties(device).total_memory if gpus
              else cfg.topology.cpu_memory_gb * GB / max(1, cfg.topology.processes_per_node))
    if gpus:
        torch.cuda.empty_cache()  # the probes' blocks back to the driver: the job's ranks need the memory
    mfu = resident_mfu(_probe_config(cfg, memory, gpus), share * ranks, bool(gpus))
    return {**rates, "resident_mfu": mfu}, write_profile(rates, model_key(cfg), mfu)


def measured_rates(cfg: MoesysConfig, device: torch.device, disk: bool = False,
                   disk_dir: str | Path | None = None) -> Rates:
    """The rates a benchmark's bound uses: `cfg`'s (keys, profile, defaults) with the host AdamW, the pinned copies
    (on a GPU) and, when `disk`, the disk measured now."""
    rates = machine_rates(cfg)
    changes: dict[str, Any] = {"adamw_params_per_s_per_core": adamw_params_per_s_per_core()}
    if device.type == "cuda":
        h2d, d2h = pinned_copy_gbps()
        changes.update(h2d_bytes_per_s=h2d * GB, d2h_bytes_per_s=d2h * GB)
    if disk:
        with tempfile.TemporaryDirectory(dir=disk_dir or cfg.storage.ssd_path or None) as tmp:
            bw = measure_disk(tmp, DISK_BYTES)
        changes.update(disk_read_bytes_per_s=bw.read_bytes_per_s, disk_write_bytes_per_s=bw.write_bytes_per_s)
    return dataclasses.replace(rates, **changes)
