"""`moesys train`: resolve the config, run it as one job (runtime/launch/job.py), render its progress and its end."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moesys_cli.options import Json, Overrides
from moesys_cli.render import ByteProgress, console, error, notice, print_json, warn
from moesys_cli.resolve import config_yaml, lr_warning, resolve_config
from moesys_cli.slurm import submitted
from runtime.launch.job import Job, JobWatcher

TOKENIZE_BAR_BYTES = 16 << 20
"""Text sources smaller than this are tokenized before launch without a progress bar."""
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and the command; run nothing.")]


def train(overrides: Overrides = None, dry_run: DryRun = False, json_out: Json = False) -> None:
    """Train with expert + data parallelism in torchrun processes; exits with the job's status."""
    cfg = resolve_config(overrides or [])
    if warning := lr_warning(cfg, overrides or []):
        warn(warning)
    job = Job(cfg, TrainProgress(quiet=json_out))
    job.check()  # what every worker would otherwise fail on, after torchrun's retries; dry run or not
    if dry_run:
        spec = job.command()
        typer.echo(config_yaml(cfg))
        typer.echo(spec.script if spec.script else shlex.join([*(f"{k}={v}" for k, v in spec.env.items()), *spec.argv]))
        raise typer.Exit(0)
    summary = run_job(job, resume_command(["train"], overrides or [], job.run_dir), quiet=json_out)
    if json_out:
        print_json(summary)
    else:
        held = "" if summary["eval_loss"] is None else \
            f", held-out loss {summary['eval_loss']:.3f} (perplexity {summary['eval_perplexity']:.1f})"
        console.print(f"done: {summary['steps']} steps, loss {summary['initial_loss']:.3f} -> "
                      f"{summary['final_loss']:.3f}{held}, {summary['tokens_per_s']:.0f} tokens/s; "
                      f"checkpoint {summary['checkpoint']}", markup=False, highlight=False)
    raise typer.Exit(0)


def run_job(job: Job, resume_command: str, quiet: bool, prepare: Callable[[Path], None] | None = None) -> dict:
    """Run the checked job (its watcher a TrainProgress); returns the run's summary. A failed or stopped job says why
    in one line (with `resume_command` when it can continue) and raises typer.Exit with its status; a SLURM job is
    submitted, said (as JSON when `quiet`), and exits 0. `prepare(run_dir)`: see Job.prepare."""
    watcher = job.watcher
    assert isinstance(watcher, TrainProgress), "the CLI's jobs are watched by a TrainProgress"
    with watcher:
        result = job.run(prepare)
    if result.slurm is not None:
        submitted(result.slurm, result.run_dir, quiet)
    if result.error is not None:
        error(result.error)
        raise typer.Exit(result.exit_code)
    if result.stopped is not None:  # asked for, so not an error; the exit status still says it was stopped
        notice(f"{result.stopped}; resume with: {resume_command}")
        raise typer.Exit(result.exit_code)
    assert result.summary is not None, "a job launched here that neither failed nor stopped has its summary"
    return result.summary


class TrainProgress(JobWatcher):
    """A job drawn on the terminal: remarks on stderr, tokenizing bars, then step, loss, tokens/s and expert load
    balance on one bar, with the job's lines above it. Nothing at all when `quiet` (--json). A context manager."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bars = ByteProgress(quiet, smallest=TOKENIZE_BAR_BYTES)
        self.progress: Progress | None = None
        self.evaluated: float | None = None

    def note(self, line: str) -> None:
        if not self.quiet:
            notice(line)

    def say(self, line: str) -> None:
        if not self.quiet:
            (self.progress.console if self.progress else console).print(line, markup=False, highlight=False)

    def tokenizing(self, source: str, done: int, total: int) -> None:
        self.bars(source, done, total)

    def following(self, total_steps: int) -> None:
        self.bars.__exit__()
        if self.quiet:
            return
        columns = [TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        self.progress = Progress(*columns, console=console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task("train", total=total_steps, info="starting workers")

    def step(self, metrics: dict) -> None:
        self.evaluated = metrics.get("eval_loss", self.evaluated)
        if self.progress is None:
            return
        held = f"  eval {self.evaluated:.3f}" if self.evaluated is not None else ""
        self.progress.update(self.task, completed=metrics["step"],
                             info=f"loss {metrics['loss']:.3f}{held}  {metrics['tokens_per_s']:.0f} tok/s  "
                                  f"load max/mean {metrics['expert_load_max_over_mean']:.2f}")

    def __enter__(self) -> TrainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.bars.__exit__()
        if self.progress is not None:
            self.progress.stop()


def resume_command(verb: list[str], overrides: list[str], run_dir: Path) -> str:
    """The command that continues this run: `moesys VERB...` with the user's overrides and train.run_dir set once,
    to this run; without train.resume_from, which chose where this launch started, not where the next one does."""
    kept = [o for o in overrides if not re.match(r"\+{0,2}train\.(run_dir|resume_from)=", o)]
    return shlex.join(["moesys", *verb, *kept, f"train.run_dir={run_dir}"])
