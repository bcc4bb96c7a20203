"""Why a job ended, in one line: the error of the rank that failed first, torchrun's own rendezvous error on a
multinode node, a worker the OOM killer took, or where a stopped job can resume."""

from __future__ import annotations

import socket
from pathlib import Path

from runtime.config import MoesysConfig
from runtime.files.run_dir import last_step_metrics, read_rank_memory
from runtime.host.topology import host_memory_bytes
from runtime.launch.command import rendezvous_join_s
from runtime.launch.oom import oom_message, smallest_fix
from runtime.launch.process import TorchrunLogs, exception_line, resume_point
from runtime.plan.compare import recorded_plan


def stopped_at(run_dir: Path, step: int) -> str:
    """Where a job stopped at `step` can resume: its last checkpoint."""
    point = resume_point(run_dir)
    if point is None:
        return f"stopped at step {step} before any checkpoint"
    if point[1] == step:
        return f"stopped at step {step} with checkpoint {point[0]}"
    return f"stopped at step {step}; the last checkpoint is {point[0]} (step {point[1]})"


def last_error(logs: TorchrunLogs, logs_dir: Path, cfg: MoesysConfig, launched_at: int = 0) -> str:
    """The error of this node's rank that failed first (the others' errors are mostly its echo: a closed
    connection), else the last line of the launcher log; first, for a multinode job whose torchrun gave up
    waiting for the other nodes (launcher log from byte `launched_at`, this launch's), that."""
    failure = logs.failure()
    launcher = logs_dir / "launcher.log"
    quoted = None
    if failure:
        node = f"node {cfg.launcher.node_rank} " if cfg.launcher.name == "multinode" else ""
        quoted = f"{node}local rank {failure.local_rank}: {failure.message[:300]}"
    agent_error = None
    if cfg.launcher.name == "multinode" and launcher.exists():
        with launcher.open("rb") as f:
            f.seek(launched_at)
            agent_error = exception_line(f.read().decode(errors="replace"))
    rendezvous = rendezvous_error(agent_error, cfg) if agent_error else None
    if rendezvous:
        return f"{rendezvous}; before that, {quoted}" if quoted else rendezvous
    if quoted:
        return quoted
    lines = [line for line in launcher.read_text(errors="replace").splitlines() if any(c.isalnum() for c in line)]
    return lines[-1].strip()[:300] if lines else "no log output"


def rendezvous_error(agent_error: str, cfg: MoesysConfig) -> str | None:
    """What torchrun's own rendezvous error (the exception line of its log) means for this node, or None."""
    endpoint = cfg.launcher.rdzv_endpoint
    name = agent_error.partition(":")[0]
    if name.endswith("RendezvousTimeoutError"):  # a node never came (back)
        return (f"the other nodes did not join the rendezvous at {endpoint} within {rendezvous_join_s(cfg)} s "
                "(a node's moesys train is gone, or cannot reach it)")
    if name.endswith("RendezvousConnectionError") and cfg.launcher.node_rank == 0:
        return (f"node 0 could not host the rendezvous store at launcher.rdzv_endpoint={endpoint}: its port is in "
                "use, or its host is not an address of this machine")
    if name.endswith("RendezvousConnectionError"):
        return (f"no connection to node 0's rendezvous store at launcher.rdzv_endpoint={endpoint}: node 0's moesys "
                "train is not running, that is not node 0's address and port, or the network to it is down")
    return None


def oom_killed(cfg: MoesysConfig, run_dir: Path, local_rank: int) -> str:
    """The one line for a worker the OOM killer took: its rank and last measured memory (its memory file, or the
    last step line), the plan's estimate, and the plan's smallest change for the memory this machine gives."""
    records = [r for r in read_rank_memory(run_dir)
               if r.get("local_rank") == local_rank and r.get("host") == socket.gethostname()]
    rank = records[0]["rank"] if records else cfg.launcher.node_rank * cfg.topology.nproc_per_node + local_rank
    measured = [r.get("memory/peak_rss_anon", 0) for r in records]
    m = last_step_metrics(run_dir)
    if m and len(m.get("memory/peak_rss_anon") or []) > rank:
        measured.append(m["memory/peak_rss_anon"][rank])
    estimate = recorded_plan(run_dir)["per_rank"]["process_host_bytes"]
    fix = smallest_fix(cfg, host_memory_bytes(), gpu=False)
    return oom_message(rank, "killed by the kernel's OOM killer", max(measured, default=0), estimate, fix)
