"""Run processes inside a memory cap: a cgroup v1 memory controller group with a hard limit.

Used where moesys must show that training goes beyond memory (`moesys bench beyond-memory`, the capped-run tests):
every process started with `cap.preexec` (the launcher and everything it forks) shares one limit, and the kernel's
OOM killer fires inside the group when the limit is exceeded. The group's peak usage and OOM-kill count are read
back afterwards. Needs a writable /sys/fs/cgroup/memory (root, cgroup v1); `available()` says whether it is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from runtime.host.topology import oom_kill_count

ROOT = Path("/sys/fs/cgroup/memory")


def available() -> str | None:
    """None when a memory cap can be created here, else why not (one line)."""
    if not (ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {ROOT}"
    if not os.access(ROOT, os.W_OK):
        return f"{ROOT} is not writable (run as root)"
    return None


class MemoryCap:
    """A cgroup with `limit_bytes` of memory (page cache included, as the kernel counts it), removed on exit."""

    def __init__(self, limit_bytes: int, name: str = "moesys"):
        why = available()
        if why:
            raise RuntimeError(f"cannot cap memory: {why}")
        self.limit = int(limit_bytes)
        self.path = ROOT / f"{name}-{os.getpid()}-{time.monotonic_ns()}"

    def __enter__(self) -> MemoryCap:
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        swap = self.path / "memory.memsw.limit_in_bytes"
        if swap.exists():  # no swapping around the cap either (only where the kernel accounts swap)
            try:
                swap.write_text(str(self.limit))
            except OSError:
                pass
        return self

    def preexec(self) -> None:
        """For subprocess.Popen(preexec_fn=...): the child joins the group before it execs."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def max_usage(self) -> int:
        """The group's peak memory use, page cache included."""
        return int(self._read("memory.max_usage_in_bytes"))

    def max_rss(self) -> int:
        """The group's anonymous memory now (rss, not page cache); the OOM killer's reason."""
        stat = dict(line.split() for line in self._read("memory.stat").splitlines())
        return int(stat["total_rss"])

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this group."""
        return oom_kill_count(self.path / "memory.oom_control") or 0

    def __exit__(self, *exc) -> None:
        deadline = time.monotonic() + 10
        while True:  # the group can go once its last process has exited
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.1)
