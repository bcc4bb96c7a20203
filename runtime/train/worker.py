"""torchrun entry point: `torchrun ... -m runtime.train.worker RUN_DIR`. Parse, build, train, close."""

from __future__ import annotations

import datetime
import os
import signal
import sys
from pathlib import Path

AGENT_PID = os.getppid()  # read before the imports below (seconds), so an agent that dies meanwhile is noticed

import torch
import torch.distributed as dist

from runtime.errors import JobError, UserError, os_reason, unwritable
from runtime.files.checkpoint_format import remove_partial_checkpoints
from runtime.files.paths import PLAN, SUMMARY
from runtime.files.run_dir import load_config, read_fatal, record_fatal
from runtime.host.io import atomic_write_json
from runtime.host.pinned import exact_large_pinned_blocks
from runtime.host.topology import set_cpu_threads
from runtime.launch.oom import OUT_OF_MEMORY_EXIT, OutOfMemory, cuda_oom_message
from runtime.launch.process import die_with_parent
from runtime.parallel.groups import build_groups
from runtime.plan.compare import recorded_plan
from runtime.plan.placement import read as read_placement
from runtime.train.loop import train

# CPU tensors (metrics, object gathers, offloaded experts' states) go through gloo even on a GPU job.
BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}


def init_distributed(timeout_s: float = 600.0, gpus: bool | None = None) -> tuple[int, int, int, torch.device]:
    """(rank, world size, processes on this node, device) from torchrun's environment; NCCL on GPUs, gloo on CPU.
    gpus: whether this job runs on GPUs (topology.gpus_per_node > 0); None takes one where CUDA is available.
    A CPU topology stays on the CPU on a GPU machine: its plan, its process count and its RAM check assumed so.
    timeout_s bounds every wait on a peer (train.collective_timeout_s)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if (torch.cuda.is_available() if gpus is None else gpus):
        exact_large_pinned_blocks()  # before a layer's stages are pinned
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(BACKENDS[device.type], rank=rank, world_size=world,
                                timeout=timeout, store=_attempt_store(world, timeout))
    return rank, world, local_world, device


def _attempt_store(world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's store outlives a restart of the workers; prefix every key with the restart count so that a
    restarted worker never reads the address a dead worker of the previous attempt published (a hang seen
    under load after a worker was SIGKILLed). A multinode job has no shared store (runtime/launch/command.py): rank 0
    hosts a new one every round, and the nodes' restart counts differ (a node whose workers did not fail
    restarts them without counting), so no prefix there."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"moesys/attempt_{attempt}", store)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's workers have their own sessions: nothing else ends them
        die_with_parent(signal.SIGKILL, AGENT_PID)  # when the agent dies (SIGKILL, out of memory)
    run_dir = Path(argv[0])
    fatal = read_fatal(run_dir)
    if fatal is not None:  # an earlier attempt met an error that would recur: do not retry it
        print(f"error: {fatal[1]}", file=sys.stderr)
        return fatal[0]
    try:
        return run(run_dir)
    except (UserError, JobError) as exc:
        code = 2 if isinstance(exc, UserError) else OUT_OF_MEMORY_EXIT if isinstance(exc, OutOfMemory) else 3
        record_fatal(run_dir, code, str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return code
    except Exception as exc:
        found = unwritable(exc)
        if found is None:
            raise  # torchrun restarts the workers: it may not happen again
        return _stop_unwritable(run_dir, found)


def _stop_unwritable(run_dir: Path, exc: OSError) -> int:
    """A full, read-only or forbidden filesystem, which a restart meets again: recorded as fatal, so that every rank
    and restart stops at once, and the checkpoint being written is removed (on a full disk where no other place
    takes the record, first: it frees the room the record needs)."""
    message = (f"training stopped: {os_reason(exc)}; free space there or make it writable, then run the same "
               "command again: it resumes from the last checkpoint")
    recorded = record_fatal(run_dir, 2, message)
    remove_partial_checkpoints(run_dir)
    if not recorded:
        record_fatal(run_dir, 2, message)
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(run_dir: Path) -> int:
    cfg = load_config(run_dir)
    if read_placement(run_dir) is None:  # the launch plans once (runtime/launch/job.py); no worker plans again
        raise UserError(f"{run_dir / PLAN} is missing: launch training with moesys train (runtime.launch.job), which "
                        "plans the run once and writes it for the workers")
    rank, world, local_world, device = init_distributed(cfg.train.collective_timeout_s,
                                                     gpus=bool(cfg.topology.gpus_per_node))
    if device.type == "cpu":  # a share of the CPUs this process may use; torchrun's OMP_NUM_THREADS=1 is its default
        set_cpu_threads(local_world, respect_env=False)
    groups = build_groups(world, rank, cfg.topology.expert_parallel, cfg.parallel.ranks_per_node or local_world)
    try:
        try:
            summary = train(cfg, run_dir, groups, device)
        except torch.OutOfMemoryError:  # a restart meets the same limit: one line, recorded as fatal
            raise OutOfMemory(cuda_oom_message(cfg, recorded_plan(run_dir), rank, device)) from None
        if rank == 0:
            atomic_write_json(run_dir / SUMMARY, summary)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
