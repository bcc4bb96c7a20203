"""`moesys train`: resolve the config, make the run directory, launch torchrun, follow rank 0's progress."""

from __future__ import annotations

import re
import shlex
import signal
import socket
from pathlib import Path
from typing import Annotated, Callable

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moesys_cli.options import Json, Overrides
from moesys_cli.render import ByteProgress, console, error, notice, print_json, warn
from moesys_cli.resolve import config_yaml, lr_warning, resolve_config
from moesys_cli.slurm import submit
from runtime.config import MoesysConfig
from runtime.launch import build_launch, check_launchable, rendezvous_connect_s, rendezvous_join_s
from runtime.node_watch import LostNodeWatch
from runtime.oom import OUT_OF_MEMORY_EXIT, OomWatch, oom_message, smallest_fix
from runtime.process import LauncherJob, TorchrunLogs, exception_line, resume_point, worker_pids
from runtime.files.run_dir import (RunLock, check_run_dir, clear_fatal, clear_rank_memory, last_step_metrics,
                                   read_fatal, read_rank_memory, record_fatal, run_summary)
from runtime.files.paths import default_run_dir, node_logs
from runtime.train.run_setup import prepare_run_dir
from runtime.topology import host_memory_bytes
from runtime.plan.compare import recorded_plan
from runtime.plan.checks import check_disk, check_plan
from runtime.plan.planner import keep_layers_hint, plan_placement
from runtime.train.preflight import check_before_launch
from runtime.plan.placement import record as record_placement
from runtime.files.resume import apply_resume_from, chosen_checkpoint
from runtime.data.chat_source import prepare_chat_data
from runtime.data.pretokenize import prepare_run_data
from runtime.data.tokenizer import run_tokenizer

TOKENIZE_BAR_BYTES = 16 << 20
"""Text sources smaller than this are tokenized before launch without a progress bar."""
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and the command; run nothing.")]


def train(overrides: Overrides = None, dry_run: DryRun = False, json_out: Json = False) -> None:
    """Train with expert + data parallelism in torchrun processes; exits with the job's status."""
    cfg = resolve_config(overrides or [])
    if warning := lr_warning(cfg, overrides or []):
        warn(warning)
    cfg.train.run_dir = str(Path(cfg.train.run_dir or default_run_dir(cfg)).resolve())
    check_run_dir(cfg.train.run_dir)  # an export or a model given as train.run_dir: refused, dry run or not
    check_before_launch(cfg)  # what every worker would otherwise fail on, after torchrun's retries
    if cfg.train.init_from and (start := chosen_checkpoint(cfg)) is not None and not json_out:
        notice(f"note: {cfg.train.run_dir} holds checkpoint {start.name}: resuming from it, train.init_from="
               f"{cfg.train.init_from} is ignored")
    if dry_run:
        spec = build_launch(cfg, Path(cfg.train.run_dir))
        typer.echo(config_yaml(cfg))
        typer.echo(spec.script if spec.script else shlex.join([*(f"{k}={v}" for k, v in spec.env.items()), *spec.argv]))
        raise typer.Exit(0)
    summary = run_job(cfg, resume_command(["train"], overrides or [], Path(cfg.train.run_dir)), quiet=json_out)
    if json_out:
        print_json(summary)
    else:
        held = "" if summary["eval_loss"] is None else \
            f", held-out loss {summary['eval_loss']:.3f} (perplexity {summary['eval_perplexity']:.1f})"
        console.print(f"done: {summary['steps']} steps, loss {summary['initial_loss']:.3f} -> "
                      f"{summary['final_loss']:.3f}{held}, {summary['tokens_per_s']:.0f} tokens/s; "
                      f"checkpoint {summary['checkpoint']}", markup=False, highlight=False)
    raise typer.Exit(0)


def run_job(cfg: MoesysConfig, resume_command: str, quiet: bool,
            prepare: Callable[[Path], None] | None = None) -> dict:
    """Launch the resolved config's torchrun job in its run directory and follow it to its end. Returns the run's
    summary; a failed or stopped job says why in one line (with `resume_command` when it can continue) and raises
    typer.Exit with its status. `prepare(run_dir)` runs under the run directory's lock before the workers start
    (`moesys distill` writes the student's first checkpoint there)."""
    plan = plan_placement(cfg)  # the launch's one plan: every check below and plan.json read it
    check_launchable(cfg, plan=plan)
    check_plan(cfg, plan)  # a run the plan says does not fit fails later on a tier's budget or by the OOM killer
    check_run_dir(cfg.train.run_dir)  # before the lock file is written into it
    check_disk(cfg, plan)  # the store and checkpoints must fit where they go, or the disk fills minutes in
    hint = keep_layers_hint(plan)
    if hint and not quiet:
        notice(f"note: {hint}")
    lock = RunLock(Path(cfg.train.run_dir), cfg.launcher.node_rank)  # held until exit: one job per run directory
    run_dir = prepare_run_dir(cfg)
    # the checkpoint train.resume_from names becomes the newest; node 0 moves the later ones, before any worker starts
    moved = apply_resume_from(cfg) if cfg.launcher.node_rank == 0 else None
    if moved and not quiet:
        console.print(moved, markup=False, highlight=False)
    with ByteProgress(quiet, smallest=TOKENIZE_BAR_BYTES) as progress:
        prepare_run_data(cfg, progress)  # tokenizer.json, and text sources tokenized once for every rank
    for note in prepare_chat_data(cfg, run_tokenizer(cfg)):  # chat sources rendered and encoded once, likewise
        if not quiet:
            notice(note)
    if prepare is not None:
        prepare(run_dir)
    clear_fatal(run_dir)
    clear_rank_memory(run_dir)
    _, replanned = record_placement(run_dir, cfg, plan)  # plan.json: the workers read it; none of them plans again
    if replanned and not quiet:
        console.print(replanned, markup=False, highlight=False)
    spec = build_launch(cfg, run_dir)
    if spec.script:
        lock.release()
        submit(spec, run_dir, quiet)  # SLURM runs the job later: submit it, say how to follow it, exit 0
    logs_dir = node_logs(run_dir, cfg)  # this node's, in a run directory the nodes share
    logs_dir.mkdir(parents=True, exist_ok=True)
    logs = TorchrunLogs(logs_dir)
    oom = OomWatch(logs_dir / "launcher.log")
    launched_at = oom.offset  # the launcher log's size before this launch (a resume appends to it)
    with LauncherJob(spec.argv, logs_dir / "launcher.log", env=spec.env) as job:
        lost = _lost_node_watch(cfg, job)
        code = _follow(job, logs, run_dir, cfg, oom, lost, quiet=quiet)
    summary = run_summary(run_dir)
    fatal = read_fatal(run_dir)
    if code != 0 and fatal is not None and job.stop_signal is None:  # a worker's own verdict, not retried
        error(fatal[1])
        raise typer.Exit(fatal[0])
    if job.stop_signal is not None and (code != 0 or summary["stopped_early"]):
        notice(f"{signal.Signals(job.stop_signal).name}: {_stopped(run_dir, summary['steps'])}; resume with: "
               f"{resume_command}")  # asked for, so not an error; the exit status still says it was stopped
        raise typer.Exit(128 + job.stop_signal)
    if lost is not None and lost.reason:
        cause = _last_error(logs, logs_dir, cfg, launched_at)
        error(f"training failed on node {cfg.launcher.node_rank}: {lost.reason}; {cause} (logs in {logs_dir})")
        raise typer.Exit(1)
    if code < 0:  # torchrun itself was killed; its workers died with it
        error(f"training failed: torchrun was killed by {signal.Signals(-code).name} (logs in {logs_dir})")
        raise typer.Exit(128 - code)
    if code != 0:
        cause = _last_error(logs, logs_dir, cfg, launched_at)
        error(f"training failed with exit code {code}: {cause} (logs in {logs_dir})")
        raise typer.Exit(code)
    return summary


def _lost_node_watch(cfg: MoesysConfig, job: LauncherJob) -> LostNodeWatch | None:
    if cfg.launcher.name != "multinode" or cfg.topology.nodes < 2:
        return None
    # Once workers ran, a node whose workers ended and that cannot reach node 0 is lost soon; before, node 0 may
    # not be started yet (by hand), and torchrun gives up on its own after rendezvous_connect_s.
    grace_s = max(10.0, cfg.train.collective_timeout_s)
    return LostNodeWatch(job.proc.pid, cfg.launcher.rdzv_endpoint, grace_s=grace_s,
                         join_grace_s=rendezvous_connect_s(cfg) + grace_s)


def _follow(job: LauncherJob, logs: TorchrunLogs, run_dir: Path, cfg: MoesysConfig, oom: OomWatch,
            lost: LostNodeWatch | None, quiet: bool) -> int:
    """Show step, loss, tokens/s and expert load balance until the job ends, and say when it resumed from a
    checkpoint or torchrun restarted its workers. Returns the job's exit code, or OUT_OF_MEMORY_EXIT at once when
    the OOM killer took a worker (leaving the with-block then stops torchrun before it restarts again), or 1 once
    a multinode job is lost on this node (torchrun is stopped: it may be blocked on the network for minutes), or 1
    once torchrun restarts workers after one recorded an error that every restart meets again."""
    tr = cfg.train
    columns = [TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=quiet, transient=False) as progress:
        def say(line: str) -> None:
            if not quiet:
                progress.console.print(line, markup=False, highlight=False)

        task = progress.add_task("train", total=tr.max_steps, info="starting workers")
        resumed = resume_point(run_dir)
        if resumed and resumed[1] > 0:  # a step-0 checkpoint is a starting point (moesys distill's student)
            say(f"resumed from step {resumed[1]} ({resumed[0]})")
        restarts, stopping, fatal_at, evaluated = 0, None, None, None
        workers, generation_restarts = frozenset(), 0  # this node's workers now, and restarts when they started
        while True:
            code = job.wait(timeout=0.5)
            victim = oom.victim()  # before the restart it caused is reported: there will be no other
            if victim is not None:
                record_fatal(run_dir, OUT_OF_MEMORY_EXIT, _oom_killed(cfg, run_dir, victim))
                return OUT_OF_MEMORY_EXIT
            if job.stop_signal is not None and stopping is None:
                stopping = job.stop_signal
                say(f"{signal.Signals(stopping).name}: the workers checkpoint at the end of the step and exit "
                    "(send it again to stop at once)")
            if fatal_at is None and read_fatal(run_dir) is not None:
                fatal_at = logs.restarts()
            elif fatal_at is not None and logs.restarts() > fatal_at:
                return 1  # the failed attempt is over, and every later one stops on the verdict: do not wait for them
            if logs.restarts() > restarts and read_fatal(run_dir) is None:  # else restarts only report it
                restarts = logs.restarts()
                point = resume_point(run_dir)
                say(f"worker restarted ({restarts} of {tr.max_restarts} restarts), back to step "
                    f"{point[1] if point else 0}")
            pids = worker_pids(job.proc.pid) if cfg.launcher.name == "multinode" else frozenset()
            if pids and not pids & workers:  # new workers; torchrun restarts a node's workers without counting
                if workers and logs.restarts() == generation_restarts and read_fatal(run_dir) is None:
                    point = resume_point(run_dir)  # when another node's failed: say so, as for a counted one
                    say(f"workers restarted with the other nodes (not counted in train.max_restarts), back to step "
                        f"{point[1] if point else 0}")
                generation_restarts = logs.restarts()
            workers = pids or workers
            m = last_step_metrics(run_dir)
            if m:
                evaluated = m.get("eval_loss", evaluated)
                held = f"  eval {evaluated:.3f}" if evaluated is not None else ""
                progress.update(task, completed=m["step"],
                                info=f"loss {m['loss']:.3f}{held}  {m['tokens_per_s']:.0f} tok/s  "
                                     f"load max/mean {m['expert_load_max_over_mean']:.2f}")
            if code is not None:
                return code
            if lost is not None and lost.lost():
                job.kill()
                return 1


def _stopped(run_dir: Path, step: int) -> str:
    point = resume_point(run_dir)
    if point is None:
        return f"stopped at step {step} before any checkpoint"
    if point[1] == step:
        return f"stopped at step {step} with checkpoint {point[0]}"
    return f"stopped at step {step}; the last checkpoint is {point[0]} (step {point[1]})"


def resume_command(verb: list[str], overrides: list[str], run_dir: Path) -> str:
    """The command that continues this run: `moesys VERB...` with the user's overrides and train.run_dir set once,
    to this run; without train.resume_from, which chose where this launch started, not where the next one does."""
    kept = [o for o in overrides if not re.match(r"\+{0,2}train\.(run_dir|resume_from)=", o)]
    return shlex.join(["moesys", *verb, *kept, f"train.run_dir={run_dir}"])


def _last_error(logs: TorchrunLogs, logs_dir: Path, cfg: MoesysConfig, launched_at: int = 0) -> str:
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
    rendezvous = _rendezvous_error(agent_error, cfg) if agent_error else None
    if rendezvous:
        return f"{rendezvous}; before that, {quoted}" if quoted else rendezvous
    if quoted:
        return quoted
    lines = [line for line in launcher.read_text(errors="replace").splitlines() if any(c.isalnum() for c in line)]
    return lines[-1].strip()[:300] if lines else "no log output"


def _rendezvous_error(agent_error: str, cfg: MoesysConfig) -> str | None:
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


def _oom_killed(cfg: MoesysConfig, run_dir: Path, local_rank: int) -> str:
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
