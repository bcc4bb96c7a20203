"""Resolved config + run directory -> the torchrun command line (local, multinode) or an sbatch script (SLURM).

Workers are started as `torchrun ... -m runtime.train.worker RUN_DIR`; they read RUN_DIR/config.yaml.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.config import MoesysConfig
from runtime.errors import UserError

WORKER_MODULE = "runtime.train.worker"


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    """The command to run here (torchrun, or sbatch for SLURM)."""
    script: str | None = None
    """The sbatch script text, when the launcher is slurm."""
    nproc_per_node: int = 1


def torchrun_prefix() -> list[str]:
    """torchrun from this environment, so workers import the same moesys and torch."""
    beside = Path(sys.executable).with_name("torchrun")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def check_launchable(cfg: MoesysConfig) -> None:
    """A job launched on this machine (local, multinode) needs the GPUs its topology declares."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.launcher.name != "slurm" and cfg.topology.gpus_per_node > gpus:
        raise UserError(f"topology.gpus_per_node={cfg.topology.gpus_per_node} but this machine has {gpus} GPU(s); "
                        "use topology=local (this machine), topology=single (CPU processes) or launcher=slurm")


def processes_per_node(cfg: MoesysConfig) -> int:
    """One process per GPU when GPUs are configured and present, else topology.nproc_per_node CPU processes."""
    if cfg.topology.gpus_per_node and torch.cuda.is_available():
        return cfg.topology.gpus_per_node
    return cfg.topology.nproc_per_node


def build_launch(cfg: MoesysConfig, run_dir: Path) -> LaunchSpec:
    launcher, nproc = cfg.launcher, processes_per_node(cfg)
    worker = ["-m", WORKER_MODULE, str(run_dir)]
    common = [f"--nproc_per_node={nproc}", f"--max_restarts={cfg.train.max_restarts}",
              f"--log_dir={run_dir / 'logs'}", "--redirects=3"]
    if launcher.name == "local":
        argv = [*torchrun_prefix(), "--standalone", "--nnodes=1", *common, *worker]
        return LaunchSpec(argv=argv, nproc_per_node=nproc)
    if launcher.name == "multinode":
        argv = [*torchrun_prefix(), f"--nnodes={cfg.topology.nodes}", f"--node_rank={launcher.node_rank}",
                "--rdzv_backend=c10d", f"--rdzv_endpoint={launcher.rdzv_endpoint}", f"--rdzv_id={launcher.rdzv_id}",
                *common, *worker]
        return LaunchSpec(argv=argv, nproc_per_node=nproc)
    script = slurm_script(cfg, run_dir, cfg.topology.gpus_per_node or nproc)
    return LaunchSpec(argv=["sbatch", str(run_dir / "job.sbatch")], script=script, nproc_per_node=nproc)


def slurm_script(cfg: MoesysConfig, run_dir: Path, nproc: int) -> str:
    """One srun task per node; each runs torchrun with a c10d rendezvous on the job's first node."""
    launcher = cfg.launcher
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=moesys-{cfg.recipe or 'run'}",
        f"#SBATCH --nodes={cfg.topology.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={launcher.time}",
        f"#SBATCH --output={run_dir / 'logs' / 'slurm-%j.out'}",
    ]
    if cfg.topology.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={cfg.topology.gpus_per_node}")
    if launcher.partition:
        lines.append(f"#SBATCH --partition={launcher.partition}")
    torchrun = " ".join(shlex.quote(a) for a in torchrun_prefix())
    lines += [
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"srun {torchrun} --nnodes=\"$SLURM_NNODES\" --nproc_per_node={nproc} "
        f"--max_restarts={cfg.train.max_restarts} --rdzv_backend=c10d "
        f"--rdzv_endpoint=\"$head_node:{launcher.master_port}\" --rdzv_id=\"$SLURM_JOB_ID\" "
        f"-m {WORKER_MODULE} {shlex.quote(str(run_dir))}",
    ]
    return "\n".join(lines) + "\n"
