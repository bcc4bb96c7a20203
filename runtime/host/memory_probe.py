"""A process's peak memory as the plan counts it: anonymous RSS on the host (what the OOM killer weighs; page
cache and memory-mapped files are reclaimable and left out) and, on a GPU, CUDA's max allocated.

The kernel keeps no high-water mark of anonymous memory, so `PeakMemory` samples /proc/self/status from a daemon
thread (every `interval_s`) and also at every `sample()` call; a peak shorter than the interval can be missed, so
callers sample at their known high points (end of backward, checkpoint writes).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_STATUS = "/proc/self/status"


def rss_anon_bytes() -> int:
    """Anonymous resident memory of this process now (RssAnon), 0 where /proc does not say."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def disk_read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io read_bytes: page-cache hits, including
    memory-mapped pages already cached, are not counted), 0 where /proc does not say."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakMemory:
    """Peak anonymous RSS of this process since start or the last `reset()`, sampled in the background."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peak = rss_anon_bytes()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        now = rss_anon_bytes()
        self.peak = max(self.peak, now)
        return now

    def reset(self) -> None:
        self.peak = rss_anon_bytes()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self._thread = threading.Thread(target=self._run, name="moesys-peak-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            # it wakes at once on the event; a daemon thread that does not (a stalled /proc read) is left behind
            self._thread.join(timeout=max(1.0, 10 * self.interval_s))
            self._thread = None
        self.sample()


def cuda_peak_bytes(device: torch.device) -> int:
    """CUDA's max allocated on `device` since the last reset, 0 off CUDA."""
    if device.type != "cuda":
        return 0
    import torch

    return int(torch.cuda.max_memory_allocated(device))


def pinned_host_peak_bytes(device: torch.device) -> int:
    """Page-locked host bytes CUDA's caching host allocator has held at most (its blocks as it allocates them:
    rounded up to powers of two below runtime/host/pinned.py's threshold), 0 off CUDA. The driver maps pinned memory
    itself, so the anonymous RSS leaves it out."""
    if device.type != "cuda":
        return 0
    import torch

    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0))
    except (AttributeError, RuntimeError):  # a torch without the allocator's statistics
        return 0
