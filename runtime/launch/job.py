"""One training job, as `moesys train`, `moesys distill` and the training benchmarks run it: planned once, checked,
its run directory made with config.yaml and plan.json (the workers read both, so none plans again), torchrun started
and followed to its end. What happens on the way goes to a JobWatcher (the CLI renders it; a benchmark ignores it);
how the job ended comes back as a JobResult, in one line when it failed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.config import MoesysConfig
from runtime.data.pretokenize import prepare_run_data
from runtime.data.tokenizer import run_tokenizer
from runtime.files.paths import default_run_dir
from runtime.files.resume import apply_resume_from, chosen_checkpoint
from runtime.files.run_dir import RunLock, check_run_dir, clear_fatal, clear_rank_memory
from runtime.launch.command import WORKER_MODULE, LaunchSpec, SlurmJob, build_launch, check_launchable, submit_slurm
from runtime.launch.follow import launch_and_follow
from runtime.plan.checks import check_disk, check_plan
from runtime.plan.placement import record as record_placement
from runtime.plan.planner import Plan, keep_layers_hint, plan_placement
from runtime.train.preflight import check_before_launch
from runtime.train.run_setup import prepare_run_dir


class JobWatcher:
    """What a job tells while it runs. This one tells no one (a benchmark's job); the CLI's draws progress."""

    def note(self, line: str) -> None:
        """A remark on the plan, before anything is written."""

    def say(self, line: str) -> None:
        """A line for the user: checkpoints set aside, a re-plan, a resume, a restart, a stop asked for."""

    def tokenizing(self, source: str, done: int, total: int) -> None:
        """Bytes of a text source tokenized so far, before launch."""

    def following(self, total_steps: int) -> None:
        """The workers are being started; the job runs `total_steps` steps."""

    def step(self, metrics: dict) -> None:
        """Rank 0's newest step line (metrics.jsonl), polled while the job runs."""


class JobFailed(RuntimeError):
    """A job that a caller needed to end well did not (JobResult.or_raise): the message is its one line."""


@dataclass(frozen=True)
class JobResult:
    """How a job ended."""

    run_dir: Path
    exit_code: int
    """0 when it ran to its end (or SLURM took it); else the status `moesys train` exits with."""
    error: str | None = None
    """Why it failed, one line; None when it did not fail."""
    stopped: str | None = None
    """Where a stop signal the job was sent ended it (`SIGINT: stopped at step 3 with checkpoint ...`); None when
    no stop signal ended it early."""
    summary: dict | None = None
    """The run's summary (run_summary) once its processes ended; None for a job SLURM runs later."""
    slurm: SlurmJob | None = None
    """The submitted SLURM job; None for a job launched here."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def or_raise(self) -> JobResult:
        """This result when the job ended well; else JobFailed naming the run directory and why."""
        if not self.ok:
            raise JobFailed(f"job {self.run_dir} failed: {self.error or self.stopped or f'exit {self.exit_code}'}")
        return self


class Job:
    """A resolved training config as one job. `worker`: the module torchrun runs in each process (the training
    worker; a benchmark may run its own, which reads the same run directory). Setting train.run_dir (absolute; a
    new directory under outputs/ when unset) is the one change made to `cfg`."""

    def __init__(self, cfg: MoesysConfig, watcher: JobWatcher | None = None, worker: str = WORKER_MODULE):
        self.cfg, self.watcher, self.worker = cfg, watcher or JobWatcher(), worker
        self.run_dir = Path(cfg.train.run_dir or default_run_dir(cfg)).resolve()
        cfg.train.run_dir = str(self.run_dir)

    def check(self) -> None:
        """What every worker would fail on, after torchrun's retries, refused now in one line (UserError): a run
        directory that holds an export or a model, a tokenizer or data that cannot be used, an unwritable store."""
        check_run_dir(self.run_dir)
        check_before_launch(self.cfg)
        if self.cfg.train.init_from and (start := chosen_checkpoint(self.cfg)) is not None:
            self.watcher.note(f"note: {self.run_dir} holds checkpoint {start.name}: resuming from it, "
                              f"train.init_from={self.cfg.train.init_from} is ignored")

    def command(self) -> LaunchSpec:
        """The torchrun command (or sbatch script) that starts the workers."""
        return build_launch(self.cfg, self.run_dir, self.worker)

    def plan(self) -> Plan:
        """The launch's one plan, and every check of it (each a UserError): GPUs and RAM here, the plan's verdict,
        the run directory, disk space for the store and the checkpoints."""
        cfg = self.cfg
        plan = plan_placement(cfg)
        check_launchable(cfg, plan=plan)
        check_plan(cfg, plan)  # a run the plan says does not fit fails later on a tier's budget or by the OOM killer
        check_run_dir(self.run_dir)  # before the lock file is written into it
        check_disk(cfg, plan)  # the store and checkpoints must fit where they go, or the disk fills minutes in
        hint = keep_layers_hint(plan)
        if hint:
            self.watcher.note(f"note: {hint}")
        return plan

    def prepare(self, plan: Plan, prepare: Callable[[Path], None] | None = None) -> Path:
        """The run directory, ready for the workers (called under the run's lock): config.yaml, the checkpoint
        train.resume_from names made the newest, train.init_from's generation facts on a fresh start, the tokenizer,
        the text sources tokenized and the chat sources rendered and encoded once for every rank,
        `prepare(run_dir)`, the last launch's verdicts cleared, and plan.json from `plan`."""
        cfg = self.cfg
        run_dir = prepare_run_dir(cfg)
        # node 0 moves the checkpoints after the one train.resume_from names, before any worker starts
        moved = apply_resume_from(cfg) if cfg.launcher.node_rank == 0 else None
        if moved:
            self.watcher.say(moved)
        from runtime.data.chat_source import prepare_chat_data  # these two import torch: the CLI starts without it
        from runtime.train.init_from import record_source_facts

        record_source_facts(cfg)  # the source's chat template and stop tokens, before anything encodes with them
        prepare_run_data(cfg, self.watcher.tokenizing)
        for note in prepare_chat_data(cfg, run_tokenizer(cfg)):  # chat sources rendered and encoded once, likewise
            self.watcher.note(note)
        if prepare is not None:
            prepare(run_dir)
        clear_fatal(run_dir)
        clear_rank_memory(run_dir)
        _, replanned = record_placement(run_dir, cfg, plan)  # plan.json: the workers read it; none plans again
        if replanned:
            self.watcher.say(replanned)
        return run_dir

    def run(self, prepare: Callable[[Path], None] | None = None, time_limit_s: float | None = None,
            preexec: Callable[[], None] | None = None) -> JobResult:
        """Plan, check, prepare the run directory (`prepare`: see Job.prepare), launch and follow the job to its
        end, holding the run directory's lock (one job per run directory) until its processes have ended. A SLURM
        job is submitted and left to the scheduler. `time_limit_s`: a job still running then is stopped and fails;
        `preexec`: run in torchrun's process before it starts (a memory cap's group to join)."""
        plan = self.plan()
        lock = RunLock(self.run_dir, self.cfg.launcher.node_rank)
        try:
            run_dir = self.prepare(plan, prepare)
            spec = self.command()
            if spec.script:
                lock.release()  # the scheduler runs it later, in processes of its own
                return JobResult(run_dir, 0, slurm=submit_slurm(spec, run_dir))
            return launch_and_follow(self.cfg, run_dir, spec, self.watcher, time_limit_s, preexec)
        finally:
            lock.release()


def run_job(cfg: MoesysConfig, watcher: JobWatcher | None = None, worker: str = WORKER_MODULE,
            prepare: Callable[[Path], None] | None = None, time_limit_s: float | None = None,
            preexec: Callable[[], None] | None = None) -> JobResult:
    """Check, plan once, prepare, launch and follow one job (Job's steps, in order); its result."""
    job = Job(cfg, watcher, worker)
    job.check()
    return job.run(prepare, time_limit_s, preexec)
