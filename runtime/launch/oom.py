"""Out of memory, named: a worker that the kernel's OOM killer took (torchrun saw it die by
SIGKILL while the OOM-kill counter of its memory cgroup went up) or that hit CUDA's out-of-memory error stops the
job, since a restart would meet the same limit, with one line: the rank, its last measured memory, the plan's
estimate and the smallest change that fits by the plan re-run with the memory really there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.config import MoesysConfig
from runtime.errors import JobError
from runtime.host.topology import memory_cgroup, oom_kill_count
from runtime.plan.budget import GB
from runtime.plan.planner import plan_placement
from runtime.plan.suggest import changed

if TYPE_CHECKING:
    import torch

OUT_OF_MEMORY_EXIT = 137
"""Exit status of a job stopped by an out-of-memory death: what a shell shows for a process killed by SIGKILL."""


class OutOfMemory(JobError):
    """A worker ran out of memory (CUDA's OutOfMemoryError); the message is oom_message's line."""


_KILLED = re.compile(r"failed \(exitcode: -9\) local_rank: (\d+) \(pid: (\d+)\)")
"""torchrun's line for the first worker of an attempt to fail, when it died by SIGKILL."""


def _cgroup_oom_file() -> Path | None:
    """This process's memory cgroup file that counts OOM kills (v1 memory.oom_control, v2 memory.events); None in
    the root group (no limit of its own: the kernel-wide count applies) or without /proc."""
    found = memory_cgroup()
    if found is None or found[0] in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        return None
    path, version = found
    return path / ("memory.oom_control" if version == "v1" else "memory.events")


def oom_kills() -> int | None:
    """OOM kills so far in this process's memory cgroup (its workers inherit it), else kernel-wide (/proc/vmstat);
    None where neither can be read."""
    own = _cgroup_oom_file()
    count = oom_kill_count(own) if own is not None else None
    return count if count is not None else oom_kill_count(Path("/proc/vmstat"))


class OomWatch:
    """Made before a launch: follows torchrun's log as it grows and says which local rank the OOM killer took."""

    def __init__(self, launcher_log: Path):
        self.log = Path(launcher_log)
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self.before = oom_kills()
        self.killed: list[int] = []
        """Local ranks torchrun saw die by SIGKILL since the launch, in order."""

    def victim(self) -> int | None:
        """The first local rank that died by SIGKILL, once the OOM-kill count has gone up since the launch."""
        if self.log.exists():
            with self.log.open("rb") as f:
                f.seek(self.offset)
                text = f.read()
            complete = text.rfind(b"\n") + 1  # a line still being written is read next time
            self.offset += complete
            self.killed += [int(m.group(1)) for m in _KILLED.finditer(text[:complete].decode(errors="replace"))]
        if not self.killed:
            return None
        now = oom_kills()
        return self.killed[0] if self.before is not None and now is not None and now > self.before else None


def smallest_fix(cfg: MoesysConfig, available_bytes: int | None, gpu: bool) -> str:
    """The plan's smallest change that fits the memory really there (`available_bytes`: a GPU's memory, or the
    node's RAM or cgroup limit), or, when the plan says the run already fits there, that it under-estimated."""
    key = "topology.gpu_memory_gb" if gpu else "topology.cpu_memory_gb"
    if available_bytes:
        gb = int(available_bytes / GB * 100) / 100
        here = changed(cfg, "topology", **{key.split(".")[1]: gb})
        plan = plan_placement(here)
        if not plan.feasible:
            fits = [s for s in plan.suggestions if "=" in s]
            if fits:
                return f"with the {gb:.2f} GB really there ({key}={gb}) the plan says: try {fits[0]}"
            return f"with the {gb:.2f} GB really there ({key}={gb}): {plan.suggestions[0] if plan.suggestions else ''}"
    return ("the plan under-estimated this rank: it says the run fits, so lower train.micro_batch_size or "
            "train.seq_len, or give each rank more memory")


def oom_message(rank: int, how: str, measured: int | None, estimate: int, fix: str) -> str:
    """The one line: `how` the rank died, its last measured bytes, the plan's estimate, the fix."""
    last = f"{measured / GB:.2f} GB" if measured else "nothing yet"
    ratio = f" ({measured / estimate:.2f}x)" if measured and estimate else ""
    return (f"rank {rank} ran out of memory ({how}): last measured {last}, plan estimate {estimate / GB:.2f} GB "
            f"per rank{ratio}; {fix}; not restarted, a restart would meet the same limit")


def cuda_oom_message(cfg: MoesysConfig, plan: dict, rank: int, device: torch.device) -> str:
    """The one line for a worker whose CUDA allocation failed; `plan` as RUN_DIR/plan.json records it."""
    import torch  # a CUDA worker has it loaded already

    measured = int(torch.cuda.max_memory_allocated(device))
    fix = smallest_fix(cfg, int(torch.cuda.get_device_properties(device).total_memory), gpu=True)
    return oom_message(rank, "CUDA out of memory", measured, int(plan["per_rank"]["device_total"]), fix)
