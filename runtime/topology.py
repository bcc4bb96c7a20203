"""What this machine has: GPUs and their memory, host RAM, free disk where the SSD tier will live."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

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


def detect_machine(ssd_path: str) -> Machine:
    """Measure this node; the SSD figure is the free space of the filesystem that holds ssd_path."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_mem = min((torch.cuda.get_device_properties(i).total_memory for i in range(gpus)), default=0) / GB
    free = shutil.disk_usage(_existing_parent(Path(ssd_path))).free / GB
    return Machine(gpus=gpus, gpu_memory_gb=round(gpu_mem, 2),
                   cpu_memory_gb=round(psutil.virtual_memory().total / GB, 2), ssd_free_gb=round(free, 2))
