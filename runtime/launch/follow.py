"""A launched job followed to its end: torchrun started tied to this process, rank 0's progress, resumes and restarts
told to the watcher, the OOM killer's victim, a lost node or a worker's recorded verdict stopping it at once, and the
end said in one line (runtime/launch/failure.py says why)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.config import MoesysConfig
from runtime.files.paths import node_logs
from runtime.files.run_dir import last_step_metrics, read_fatal, record_fatal, run_summary
from runtime.launch.command import LaunchSpec, rendezvous_connect_s
from runtime.launch.failure import last_error, oom_killed, stopped_at
from runtime.launch.node_watch import LostNodeWatch
from runtime.launch.oom import OUT_OF_MEMORY_EXIT, OomWatch
from runtime.launch.process import LauncherJob, TorchrunLogs, resume_point, worker_pids

if TYPE_CHECKING:
    from runtime.launch.job import JobResult, JobWatcher

POLL_S = 0.5
"""How often the follower looks at the job: its exit, its logs, rank 0's metrics."""
TIMED_OUT_EXIT = 124
"""Exit status of a job stopped at its time limit (what coreutils' `timeout` exits with)."""


def launch_and_follow(cfg: MoesysConfig, run_dir: Path, spec: LaunchSpec, watcher: JobWatcher,
                      time_limit_s: float | None = None, preexec: Callable[[], None] | None = None) -> JobResult:
    """Run `spec`'s torchrun in `run_dir` (prepared, plan.json written) and follow it to its end; how it ended."""
    from runtime.launch.job import JobResult  # job.py imports this module: its result type, once both are loaded

    logs_dir = node_logs(run_dir, cfg)  # this node's, in a run directory the nodes share
    logs_dir.mkdir(parents=True, exist_ok=True)
    logs = TorchrunLogs(logs_dir)
    oom = OomWatch(logs_dir / "launcher.log")
    launched_at = oom.offset  # the launcher log's size before this launch (a resume appends to it)
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    with LauncherJob(spec.argv, logs_dir / "launcher.log", env=spec.env, preexec=preexec) as job:
        lost = lost_node_watch(cfg, job)
        code = _follow(job, logs, run_dir, cfg, oom, lost, watcher, deadline)
    summary = run_summary(run_dir)
    fatal = read_fatal(run_dir)

    def failed(exit_code: int, why: str) -> JobResult:
        return JobResult(run_dir, exit_code, error=why, summary=summary)

    if code is None:
        return failed(TIMED_OUT_EXIT, f"did not finish in {time_limit_s:.0f} s")
    if code != 0 and fatal is not None and job.stop_signal is None:  # a worker's own verdict, not retried
        return failed(fatal[0], fatal[1])
    if job.stop_signal is not None and (code != 0 or summary["stopped_early"]):
        # asked for, so not an error; the exit status still says it was stopped
        return JobResult(run_dir, 128 + job.stop_signal, summary=summary,
                         stopped=f"{signal.Signals(job.stop_signal).name}: {stopped_at(run_dir, summary['steps'])}")
    if lost is not None and lost.reason:
        cause = last_error(logs, logs_dir, cfg, launched_at)
        return failed(1, f"training failed on node {cfg.launcher.node_rank}: {lost.reason}; {cause} (logs in "
                         f"{logs_dir})")
    if code < 0:  # torchrun itself was killed; its workers died with it
        return failed(128 - code, f"training failed: torchrun was killed by {signal.Signals(-code).name} (logs in "
                                  f"{logs_dir})")
    if code != 0:
        cause = last_error(logs, logs_dir, cfg, launched_at)
        return failed(code, f"training failed with exit code {code}: {cause} (logs in {logs_dir})")
    return JobResult(run_dir, 0, summary=summary)


def lost_node_watch(cfg: MoesysConfig, job: LauncherJob) -> LostNodeWatch | None:
    """The watch for this node of a multinode job losing the others (None for one node)."""
    if cfg.launcher.name != "multinode" or cfg.topology.nodes < 2:
        return None
    # Once workers ran, a node whose workers ended and that cannot reach node 0 is lost soon; before, node 0 may
    # not be started yet (by hand), and torchrun gives up on its own after rendezvous_connect_s.
    grace_s = max(10.0, cfg.train.collective_timeout_s)
    return LostNodeWatch(job.started.pid, cfg.launcher.rdzv_endpoint, grace_s=grace_s,
                         join_grace_s=rendezvous_connect_s(cfg) + grace_s)


def _follow(job: LauncherJob, logs: TorchrunLogs, run_dir: Path, cfg: MoesysConfig, oom: OomWatch,
            lost: LostNodeWatch | None, watcher: JobWatcher, deadline: float | None) -> int | None:
    """Tell the watcher each step, and when the job resumed from a checkpoint or torchrun restarted its workers,
    until the job ends. Returns the job's exit code, or OUT_OF_MEMORY_EXIT at once when the OOM killer took a worker
    (leaving the with-block then stops torchrun before it restarts again), or 1 once a multinode job is lost on this
    node (torchrun is stopped: it may be blocked on the network for minutes), or 1 once torchrun restarts workers
    after one recorded an error that every restart meets again, or None once past `deadline` (it is stopped)."""
    tr = cfg.train
    watcher.following(tr.max_steps)
    resumed = resume_point(run_dir)
    if resumed and resumed[1] > 0:  # a step-0 checkpoint is a starting point (moesys distill's student)
        watcher.say(f"resumed from step {resumed[1]} ({resumed[0]})")
    restarts, stopping, fatal_at = 0, None, None
    workers: frozenset[int] = frozenset()
    generation_restarts = 0  # this node's workers now, and restarts when they started
    while True:
        code = job.wait(timeout=POLL_S)
        victim = oom.victim()  # before the restart it caused is reported: there will be no other
        if victim is not None:
            record_fatal(run_dir, OUT_OF_MEMORY_EXIT, oom_killed(cfg, run_dir, victim))
            return OUT_OF_MEMORY_EXIT
        if job.stop_signal is not None and stopping is None:
            stopping = job.stop_signal
            watcher.say(f"{signal.Signals(stopping).name}: the workers checkpoint at the end of the step and exit "
                        "(send it again to stop at once)")
        if fatal_at is None and read_fatal(run_dir) is not None:
            fatal_at = logs.restarts()
        elif fatal_at is not None and logs.restarts() > fatal_at:
            return 1  # the failed attempt is over, and every later one stops on the verdict: do not wait for them
        if logs.restarts() > restarts and read_fatal(run_dir) is None:  # else restarts only report it
            restarts = logs.restarts()
            point = resume_point(run_dir)
            watcher.say(f"worker restarted ({restarts} of {tr.max_restarts} restarts), back to step "
                        f"{point[1] if point else 0}")
        pids = worker_pids(job.started.pid) if cfg.launcher.name == "multinode" else frozenset()
        if pids and not pids & workers:  # new workers; torchrun restarts a node's workers without counting
            if workers and logs.restarts() == generation_restarts and read_fatal(run_dir) is None:
                point = resume_point(run_dir)  # when another node's failed: say so, as for a counted one
                watcher.say(f"workers restarted with the other nodes (not counted in train.max_restarts), back to "
                            f"step {point[1] if point else 0}")
            generation_restarts = logs.restarts()
        workers = pids or workers
        m = last_step_metrics(run_dir)
        if m:
            watcher.step(m)
        if code is not None:
            return code
        if lost is not None and lost.lost():
            job.kill()
            return 1
        if deadline is not None and time.monotonic() >= deadline:
            job.kill()
            return None
