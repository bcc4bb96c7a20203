"""What each rank measures of its own memory, to set beside the plan's per-rank estimate: peak
anonymous RSS since the worker started, CUDA's max allocated, the pinned host memory CUDA's host allocator holds, the
bytes of its SSD expert store.

The record is also kept in RUN_DIR/memory/rank<R>.json, rewritten whenever the peak grows by 2%: a rank that the
kernel's OOM killer takes mid-step never writes a metrics line, and this file is its last measured memory.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.files.paths import MEMORY_DIR, rank_memory_file
from runtime.host.io import atomic_write_json
from runtime.host.memory_probe import PeakMemory, cuda_peak_bytes, pinned_host_peak_bytes

if TYPE_CHECKING:
    import torch


GROWTH = 1.02
"""The file is rewritten when the peak RSS has grown by this factor since the last write (a few dozen writes from
start to steady state, none after)."""

PER_RANK_KEYS = ("memory/peak_rss_anon", "memory/cuda_max_allocated", "memory/ssd_bytes", "memory/pinned_host")
"""metrics.jsonl fields, one list entry per rank: peak anonymous RSS, CUDA max allocated (0 on CPU), SSD store
bytes (0 without storage.offload=ssd), peak pinned host bytes (0 on CPU; outside the anonymous RSS)."""


class RankMemory(PeakMemory):
    """PeakMemory of this worker that also keeps RUN_DIR/memory/rank<R>.json. Start with `start()`, stop with
    `close()`; the sampler thread is a daemon, so a worker that dies never waits for it."""

    def __init__(self, run_dir: Path, rank: int, device: torch.device, interval_s: float = 0.02):
        super().__init__(interval_s)
        self.path = Path(run_dir) / MEMORY_DIR / rank_memory_file(rank)
        self.rank, self.device = rank, device
        self.ssd_bytes = 0
        self._written = 0
        self._lock = threading.Lock()

    def start(self) -> RankMemory:
        self.write()
        self.__enter__()
        return self

    def close(self) -> None:
        self.__exit__(None, None, None)
        self.write()

    def sample(self) -> int:
        now = super().sample()
        if self.peak > self._written * GROWTH:
            self.write()
        return now

    def per_rank(self, ssd_bytes: int) -> dict[str, int]:
        """This rank's entries of the PER_RANK_KEYS, sampled now (the end of a step is a high point); then the
        heap's free memory goes back to the OS (trim_heap)."""
        self.sample()
        trim_heap()
        self.ssd_bytes = int(ssd_bytes)
        return dict(zip(PER_RANK_KEYS, self._values(self.peak), strict=True))

    def _values(self, peak: int) -> tuple[int, int, int, int]:
        """The PER_RANK_KEYS' values, in order, with `peak` as the anonymous RSS's."""
        return peak, cuda_peak_bytes(self.device), self.ssd_bytes, pinned_host_peak_bytes(self.device)

    def write(self) -> None:
        with self._lock:
            peak = self.peak
            record = {"rank": self.rank, "local_rank": int(os.environ.get("LOCAL_RANK", self.rank)),
                      "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                      **dict(zip(PER_RANK_KEYS, self._values(peak), strict=True))}
            try:
                atomic_write_json(self.path, record)
            except OSError:
                return  # a full or read-only disk must not stop training over a diagnostic file
            self._written = peak


def trim_heap() -> bool:
    """Give the heap's free memory back to the OS (glibc malloc_trim). glibc raises its mmap threshold to the
    largest block freed so far, after which activations come from heap arenas that keep freed memory, and a worker's
    anonymous RSS grows every step without bound; trimmed after each step it levels off. A fixed small mmap
    threshold holds the same floor but makes every tensor allocation a fresh mapping, which slows steps
    (benchmarks/host-memory_*.md). False where glibc's malloc_trim is not there (other C libraries)."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(malloc_trim(0))
