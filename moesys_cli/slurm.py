"""`moesys train launcher=slurm`: print the submitted job's id and how to follow it, exit 0.

SLURM runs the job later, on other nodes; nothing here waits for it (unlike the torchrun launchers)."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

from moesys_cli.render import print_json
from runtime.files.paths import METRICS
from runtime.launch.command import SlurmJob


def submitted(job: SlurmJob, run_dir: Path, json_out: bool) -> NoReturn:
    if json_out:
        print_json({"run_dir": str(run_dir), "job_id": job.job_id, "script": str(job.script),
                    "log": str(job.log) if job.log else None})
        raise typer.Exit(0)
    if job.job_id:
        typer.echo(f"submitted SLURM job {job.job_id} ({job.script})")
        typer.echo(f"follow it: squeue -j {job.job_id}; output: tail -f {job.log}; "
                   f"per-step metrics: {run_dir / METRICS}")
    else:
        typer.echo(f"submitted {job.script}; sbatch answered: {job.answer}")
        typer.echo(f"follow it: squeue -u $USER; output: {job.log or run_dir / 'logs'}")
    raise typer.Exit(0)
