"""`moesys train`: resolve the config, make the run directory, launch torchrun, follow rank 0's progress."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moesys_cli.options import Json, Overrides
from moesys_cli.render import console, error, print_json
from moesys_cli.resolve import config_yaml, resolve_config
from moesys_cli.slurm import submit
from runtime.launch import build_launch, check_launchable
from runtime.run_dir import LOGS, default_run_dir, last_step_metrics, prepare_run_dir, run_summary
from runtime.train.data import read_text_bytes

DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and the command; run nothing.")]


def train(overrides: Overrides = None, dry_run: DryRun = False, json_out: Json = False) -> None:
    """Train with expert + data parallelism in torchrun processes; exits with the job's status."""
    cfg = resolve_config(overrides or [])
    if cfg.train.data:
        read_text_bytes(Path(cfg.train.data))  # fail here, in one line, rather than in every worker
    if dry_run:
        run_dir = Path(cfg.train.run_dir or default_run_dir(cfg)).resolve()
        spec = build_launch(cfg, run_dir)
        typer.echo(config_yaml(cfg))
        typer.echo(spec.script if spec.script else shlex.join(spec.argv))
        raise typer.Exit(0)
    check_launchable(cfg)
    run_dir = prepare_run_dir(cfg)
    spec = build_launch(cfg, run_dir)
    if spec.script:
        submit(spec, run_dir, json_out)  # SLURM runs the job later: submit it, say how to follow it, exit 0
    log = open(run_dir / LOGS / "launcher.log", "ab")
    proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT)
    code, interrupted = _follow(proc, run_dir, cfg.train.max_steps, quiet=json_out)
    summary = run_summary(run_dir)
    if interrupted:
        error(f"stopped at step {summary['steps']} with checkpoint {summary['checkpoint']}; "
              f"resume with: moesys train {shlex.join(overrides or [])} train.run_dir={run_dir}")
        raise typer.Exit(130)
    if code != 0:
        error(f"training failed with exit code {code}: {_last_error(run_dir)} (logs in {run_dir / LOGS})")
        raise typer.Exit(code)
    if json_out:
        print_json(summary)
    else:
        console.print(f"done: {summary['steps']} steps, loss {summary['initial_loss']:.3f} -> "
                      f"{summary['final_loss']:.3f}, {summary['tokens_per_s']:.0f} tokens/s; "
                      f"checkpoint {summary['checkpoint']}")
    raise typer.Exit(0)


def _follow(proc: subprocess.Popen, run_dir: Path, max_steps: int, quiet: bool) -> tuple[int, bool]:
    """Show step, loss, tokens/s and expert load balance until the job ends; Ctrl-C reaches the job too,
    whose workers checkpoint and exit. Returns (exit code, whether the user interrupted)."""
    interrupted = False
    columns = [TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=quiet, transient=False) as progress:
        task = progress.add_task("train", total=max_steps, info="starting workers")
        while True:
            try:
                code = proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                code = None
            except KeyboardInterrupt:
                interrupted = True
                progress.update(task, info="stopping: workers checkpoint and exit")
                code = proc.wait()
            m = last_step_metrics(run_dir)
            if m:
                progress.update(task, completed=m["step"],
                                info=f"loss {m['loss']:.3f}  {m['tokens_per_s']:.0f} tok/s  "
                                     f"load max/mean {m['expert_load_max_over_mean']:.2f}")
            if code is not None:
                return code, interrupted


def _last_error(run_dir: Path) -> str:
    """The last line of the newest non-empty worker error log, or of the launcher log."""
    logs = sorted((p for p in (run_dir / LOGS).rglob("error.json")), key=lambda p: p.stat().st_mtime)
    logs += sorted((p for p in (run_dir / LOGS).rglob("stderr.log") if p.stat().st_size),
                   key=lambda p: p.stat().st_mtime)
    for path in [*reversed(logs), run_dir / LOGS / "launcher.log"]:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()[:300]
    return "no log output"
