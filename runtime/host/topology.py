"""What this machine has: GPUs and their memory, host RAM, free disk where the SSD tier will live, and the CPUs
this process may use (the share each process gives torch's thread pool)."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

GB = 1e9


@dataclass(frozen=True)
class Machine:
    gpus: int
    gpu_memory_gb: float
    cpu_memory_gb: float
    ssd_free_gb: float


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def memory_cgroup() -> tuple[Path, str] | None:
    """This process's memory cgroup directory and its version ("v1" or "v2"); None without /proc, or on cgroup v2
    in the root group (no memory files of its own)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "v1"
        if controllers == "":
            unified = Path("/sys/fs/cgroup") / path.lstrip("/")
    if unified is not None and (unified / "memory.max").exists():
        return unified, "v2"
    return None


def oom_kill_count(path: Path) -> int | None:
    """The `oom_kill` counter of a cgroup's memory.oom_control / memory.events, or of /proc/vmstat; None when it
    cannot be read."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def cgroup_memory_limit() -> int | None:
    """The memory limit of this process's cgroup (v1 memory.limit_in_bytes, v2 memory.max), None without one:
    inside a container or a capped job that limit, not the machine's RAM, is what the OOM killer enforces."""
    found = memory_cgroup()
    if found is None:
        return None
    path, version = found
    try:
        text = (path / ("memory.limit_in_bytes" if version == "v1" else "memory.max")).read_text().strip()
    except OSError:
        return None
    return None if text == "max" or int(text) >= 2**60 else int(text)


def host_memory_bytes() -> int:
    """Host memory this process's jobs may use: the RAM or, when lower, its cgroup's limit."""
    return min(psutil.virtual_memory().total, cgroup_memory_limit() or 2**63)


def gb_floor(nbytes: float) -> float:
    """Bytes as GB with two decimals, rounded down: a plan sized to a measured capacity must not get the few MB
    that rounding up adds (10 GiB is 10.737 GB: 10.74 would let the plan fill more than the machine has)."""
    return math.floor(nbytes / GB * 100) / 100


def detect_machine(ssd_path: str) -> Machine:
    """Measure this node; the SSD figure is the free space of the filesystem that holds ssd_path. Host memory is
    the RAM or, when lower, this process's cgroup memory limit."""
    import torch  # here, not at import: `moesys plan` and `moesys config` start without loading torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_mem = min((torch.cuda.get_device_properties(i).total_memory for i in range(gpus)), default=0)
    free = shutil.disk_usage(_existing_parent(Path(ssd_path))).free
    return Machine(gpus=gpus, gpu_memory_gb=gb_floor(gpu_mem), cpu_memory_gb=gb_floor(host_memory_bytes()),
                   ssd_free_gb=gb_floor(free))


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
LAST_LEVEL_CACHE_FALLBACK = 64 << 20
"""Bytes assumed for the last-level cache where the kernel does not say (larger than most server CPUs' share)."""
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
"""The suffixes of the kernel's cache sizes ("32768K")."""


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int:
    """Bytes of the largest data cache the first CPU sees (its L3 on most machines), from the kernel's cache
    description; LAST_LEVEL_CACHE_FALLBACK where there is none."""
    sizes = []
    for index in caches.glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if text[-1:] in SIZE_UNITS and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * SIZE_UNITS[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=LAST_LEVEL_CACHE_FALLBACK)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (os.cpu_count counts the whole machine), capped by a
    cgroup v2 CPU quota (a container limited to 2 CPUs of a 64-core host)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this OS
        cpus = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def set_cpu_threads(processes: int = 1, respect_env: bool = True) -> int:
    """Give torch's intra-op pool this process's share of the usable CPUs (`processes` on this node share them),
    unless the user chose OMP_NUM_THREADS and respect_env is set. Returns the thread count in effect."""
    import torch

    if not (respect_env and os.environ.get("OMP_NUM_THREADS")):
        torch.set_num_threads(max(1, usable_cpus() // max(1, processes)))
    return torch.get_num_threads()
