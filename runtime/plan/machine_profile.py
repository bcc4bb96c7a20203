"""This machine's measured rates (`moesys plan --measure`), kept for later plans on the same machine, and the rates a
plan uses: a `topology.*` key where set, else the profile where the job runs on this machine, else the default.

The cache is one small JSON file per machine identity (host name, CPU model, usable cores, GPU models) under
$MOESYS_CACHE_DIR, else $XDG_CACHE_HOME/moesys, else ~/.cache/moesys: machines/<identity digest>.json. A profile
holds the machine's rates and the resident MFU of at most MAX_MODELS jobs (model shape and node layout; the newest
measured).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
from pathlib import Path

from runtime.config import MoesysConfig
from runtime.host.io import atomic_write_json
from runtime.plan.step_time import GB, Rates

MAX_MODELS = 8
"""Jobs (model shape and node layout, model_key) whose resident MFU a profile keeps (older ones are dropped)."""

DEFAULT_RATES = {"pcie_h2d_gbps": 25.0, "pcie_d2h_gbps": 25.0, "adamw_gparams_per_core": 0.25,
                 "cpu_cores_per_node": 16, "disk_read_gbps": 2.0, "disk_write_gbps": 1.0}
"""The topology.* rates a plan assumes when neither a key nor this machine's profile gives one: PCIe 4.0 x16's
practical pinned bandwidth, torch's fused CPU AdamW on one server core, an NVMe disk."""
DEFAULT_GEMM_TFLOPS = {True: 400.0, False: 0.1}
"""topology.gemm_tflops by whether the topology has GPUs: a bf16 GEMM on a current data-center GPU, a few CPU cores."""
DEFAULT_RESIDENT_MFU = {True: 0.4, False: 0.3}
"""topology.resident_mfu by whether the topology has GPUs (the resident step's share of the GEMM rate)."""
PROFILE_RATES = ("pcie_h2d_gbps", "pcie_d2h_gbps", "adamw_gparams_per_core", "disk_read_gbps", "disk_write_gbps",
                 "gemm_tflops")


def cache_root() -> Path:
    """Where moesys keeps per-user caches ($MOESYS_CACHE_DIR, $XDG_CACHE_HOME/moesys or ~/.cache/moesys)."""
    if os.environ.get("MOESYS_CACHE_DIR"):
        return Path(os.environ["MOESYS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moesys"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _gpu_models() -> list[str]:
    """The NVIDIA driver's model name of each GPU, read from /proc (no CUDA context, no torch)."""
    root = Path("/proc/driver/nvidia/gpus")
    models = []
    for info in sorted(root.glob("*/information")) if root.is_dir() else []:
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                models.append(line.partition(":")[2].strip())
    return models


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_identity() -> dict:
    """What makes two machines the same for their rates."""
    return {"host": socket.gethostname(), "cpu": _cpu_model(), "cores": usable_cores(), "gpus": _gpu_models()}


def profile_path(identity: dict | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(identity or machine_identity(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "machines" / f"{digest}.json"


def read_profile(identity: dict | None = None) -> dict | None:
    """This machine's profile, or None when it has none (or an unreadable one: a plan then uses the defaults)."""
    try:
        data = json.loads(profile_path(identity).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_profile(rates: dict, model_key: str | None = None, resident_mfu: float | None = None) -> Path:
    """Merge measured `rates` (and the resident MFU of one model shape) into this machine's profile, atomically."""
    identity = machine_identity()
    old = read_profile(identity) or {}
    models = {k: v for k, v in (old.get("resident_mfu") or {}).items() if k != model_key}
    if model_key and resident_mfu:
        models[model_key] = resident_mfu
    models = dict(list(models.items())[-MAX_MODELS:])
    path = profile_path(identity)
    atomic_write_json(path, {"identity": identity, **{k: v for k, v in old.items() if k in PROFILE_RATES},
                             **rates, "resident_mfu": models})
    return path


def model_key(cfg: MoesysConfig) -> str:
    """The job a resident MFU was measured on: the model, the precision, the sequence length, whether its blocks are
    compiled and the layout of a node (its ranks, GPUs and expert parallelism: the collectives and the cores' share
    the step pays for)."""
    tr, t = cfg.train, cfg.topology
    shape = {**dataclasses.asdict(cfg.model), "precision": tr.precision, "seq_len": tr.seq_len, "compile": tr.compile,
             "ranks_per_node": t.processes_per_node, "gpus_per_node": t.gpus_per_node,
             "expert_parallel": t.expert_parallel}
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def profile_applies(cfg: MoesysConfig, profile: dict | None) -> bool:
    """A profile describes the machines of a job launched here (launcher=local) whose topology has GPUs where this
    machine has them; a declared cluster or SLURM topology uses its keys."""
    if profile is None or cfg.launcher.name != "local":
        return False
    return bool(cfg.topology.gpus_per_node) == bool(profile.get("identity", {}).get("gpus"))


def machine_rates(cfg: MoesysConfig, profile: dict | None = None) -> Rates:
    """The rates of `cfg`'s nodes: each topology.* key that is set, else this machine's profile (when it applies),
    else the default. `profile`: this machine's (read here when None)."""
    t = cfg.topology
    gpus = bool(t.gpus_per_node)
    profile = profile if profile is not None else read_profile()
    mine = profile if profile is not None and profile_applies(cfg, profile) else {}
    sources: dict[str, str] = {}

    def rate(key: str, default: float) -> float:
        value = getattr(t, key)
        if value:
            sources[key] = "key"
            return float(value)
        if mine.get(key):
            sources[key] = "profile"
            return float(mine[key])
        sources[key] = "default"
        return float(default)

    cores_default = usable_cores() if cfg.launcher.name == "local" else DEFAULT_RATES["cpu_cores_per_node"]
    measured = (mine.get("resident_mfu") or {}).get(model_key(cfg))
    sources["resident_mfu"] = "key" if t.resident_mfu else "profile" if measured else "default"
    sources["cpu_cores_per_node"] = "key" if t.cpu_cores_per_node else "this machine" if cfg.launcher.name == "local" \
        else "default"
    gb = {key: rate(key, DEFAULT_RATES[key]) * GB for key in ("pcie_h2d_gbps", "pcie_d2h_gbps",
                                                              "adamw_gparams_per_core", "disk_read_gbps",
                                                              "disk_write_gbps")}
    return Rates(h2d_bytes_per_s=gb["pcie_h2d_gbps"], d2h_bytes_per_s=gb["pcie_d2h_gbps"],
                 adamw_params_per_s_per_core=gb["adamw_gparams_per_core"],
                 cores=int(t.cpu_cores_per_node or cores_default),
                 disk_read_bytes_per_s=gb["disk_read_gbps"], disk_write_bytes_per_s=gb["disk_write_gbps"],
                 gemm_flops=rate("gemm_tflops", DEFAULT_GEMM_TFLOPS[gpus]) * 1e12,
                 resident_mfu=float(t.resident_mfu or measured or DEFAULT_RESIDENT_MFU[gpus]), gpus=gpus,
                 sources=tuple(sorted(sources.items())))


def rates_to_dict(rates: Rates) -> dict:
    """`moesys plan --json`'s rates: in the topology keys' units, and where each came from."""
    return {"pcie_h2d_gbps": rates.h2d_bytes_per_s / GB, "pcie_d2h_gbps": rates.d2h_bytes_per_s / GB,
            "adamw_gparams_per_core": rates.adamw_params_per_s_per_core / GB, "cpu_cores_per_node": rates.cores,
            "disk_read_gbps": rates.disk_read_bytes_per_s / GB, "disk_write_gbps": rates.disk_write_bytes_per_s / GB,
            "gemm_tflops": rates.gemm_flops / 1e12, "resident_mfu": rates.resident_mfu,
            "from": ", ".join(f"{k} {v}" for k, v in rates.sources)}
