"""Resolved config + run directory -> the torchrun command line (local, multinode) or an sbatch script (SLURM).

Workers are started as `torchrun ... --no-python PYTHON -u -c SAFE_RUN runtime.train.worker RUN_DIR` (the worker module,
with the working directory off sys.path); they read RUN_DIR/config.yaml.
A SLURM job is submitted and left to the scheduler (`submit_slurm`): nothing here follows it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.files.paths import LOGS, SLURM_LOG, SLURM_SCRIPT, node_logs
from runtime.host.io import atomic_write_text
from runtime.host.topology import host_memory_bytes
from runtime.plan.budget import GB
from runtime.plan.planner import LAUNCHER_BYTES, Plan, plan_placement

WORKER_MODULE = "runtime.train.worker"
SAFE_RUN = ('import runpy, sys; sys.path[:1] == [""] and sys.path.pop(0); '
            'runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)')
"""`python -c SAFE_RUN MODULE ARGS...` runs MODULE as `python -m MODULE ARGS...` does, without the working directory
on sys.path: -m and -c put it first, so a runtime/ folder there would be imported instead of the installed moesys
(Python 3.11's -P does this; 3.10 has no such flag). PYTHONPATH and site-packages stay as they are."""
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torchrun's workers then get a new TCP store from rank 0 every rendezvous round (see multinode_env)."""
JOIN_TIMEOUT_MIN_S = 60
"""The least time a multinode node waits for the others to join (the commands are started by hand)."""
_NO_SBATCH = ("launcher=slurm submits with {command}, which is not on PATH; run moesys train on a SLURM login node, "
              "or add --dry-run to print the sbatch script")


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    """The command to run here (torchrun, or sbatch for SLURM)."""
    script: str | None = None
    """The sbatch script text, when the launcher is slurm."""
    nproc_per_node: int = 1
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables the command runs with, beyond this process's own."""


def cuda_device_count() -> int:
    import torch  # only when a topology asks for GPUs: CPU launches start without loading torch here

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_prefix() -> list[str]:
    """torchrun from this environment, so workers import the same moesys and torch."""
    beside = Path(sys.executable).with_name("torchrun")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def check_launchable(cfg: MoesysConfig, ram_bytes: float | None = None, plan: Plan | None = None) -> None:
    """A job launched on this machine (local, multinode) needs the GPUs its topology declares and, on CPU, RAM
    (`ram_bytes`, default this machine's or its cgroup limit) for all its processes, by `plan` (the launch's plan of
    `cfg`; made here when not given); a SLURM job needs sbatch."""
    if cfg.launcher.name == "slurm" and shutil.which("sbatch") is None:
        raise UserError(_NO_SBATCH.format(command="sbatch"))
    gpus = cuda_device_count() if cfg.launcher.name != "slurm" and cfg.topology.gpus_per_node else 0
    if cfg.launcher.name != "slurm" and cfg.topology.gpus_per_node > gpus:
        raise UserError(f"topology.gpus_per_node={cfg.topology.gpus_per_node} but this machine has {gpus} GPU(s); "
                        "use topology=local (this machine), topology=single (CPU processes) or launcher=slurm")
    if cfg.launcher.name != "slurm" and not cfg.topology.gpus_per_node:
        check_host_memory(cfg, host_memory_bytes() if ram_bytes is None else ram_bytes, plan)
    if cfg.launcher.name == "multinode" and cfg.topology.nodes > 1:
        check_node_address(cfg.launcher.local_addr)


def check_node_address(local_addr: str | None, hostname: str | None = None) -> None:
    """The address torchrun publishes for this node must reach it from the others: launcher.local_addr, which must
    be one of this machine's, or else this machine's name (`hostname`, default its FQDN as torchrun takes it),
    which must not resolve to a loopback address (the other nodes would connect to themselves, and hang)."""
    if local_addr:
        if interface_of(local_addr) is None:
            raise UserError(f"launcher.local_addr={local_addr} is not an address of this machine; set it to this "
                            "node's address on the network the nodes share")
        return
    name = hostname or socket.getfqdn()
    addresses = _addresses(name)
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        what = "resolves to a loopback address, which the other nodes cannot reach" if addresses else \
            "does not resolve to an address"
        raise UserError(f"launcher=multinode: this machine's name {name!r} {what}; set launcher.local_addr to this "
                        "node's address on the network the nodes share")


def _addresses(host: str) -> list[str]:
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (socket.gaierror, UnicodeError):
        return []


def interface_of(address: str) -> str | None:
    """The network interface of this machine that holds `address` (an IP address or a name resolving to one)."""
    wanted = set(_addresses(address))
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] in wanted for a in addrs):
            return name
    return None


def rendezvous_join_s(cfg: MoesysConfig) -> int:
    """Seconds a node waits for the others to join the rendezvous, at the start and after a restart:
    train.collective_timeout_s, at least JOIN_TIMEOUT_MIN_S."""
    return int(max(JOIN_TIMEOUT_MIN_S, cfg.train.collective_timeout_s))


def rendezvous_connect_s(cfg: MoesysConfig) -> int:
    """The longest torchrun on a node other than node 0 may try to reach node 0's rendezvous store before it gives
    up: its TCP store client connects twice, read_timeout (rendezvous_join_s) each, with a back-off between
    (benchmarks/rendezvous_*.md)."""
    return 3 * rendezvous_join_s(cfg)


def multinode_env(cfg: MoesysConfig) -> dict[str, str]:
    """A fresh TCP store for every rendezvous round (torchrun's shared store is reused across rounds, and a
    worker restarted on one node must not meet the keys of the previous round); gloo and NCCL bound to the
    interface of launcher.local_addr, unless the user chose one."""
    env = dict(FRESH_STORE)
    interface = interface_of(cfg.launcher.local_addr) if cfg.launcher.local_addr else None
    if interface:
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if key not in os.environ:
                env[key] = interface
    return env


def check_host_memory(cfg: MoesysConfig, ram_bytes: float, plan: Plan | None = None) -> None:
    """CPU processes of one node share its RAM: the plan's host bytes per process times nproc_per_node must fit."""
    problem = host_memory_problem(cfg, ram_bytes, plan.process_host_bytes if plan else None)
    if problem:
        raise UserError(problem)


def host_memory_problem(cfg: MoesysConfig, ram_bytes: float, each: int | None = None) -> str | None:
    """Why this config's CPU processes do not fit in `ram_bytes` (one line with what to change), None when they
    do; `each` is the plan's host bytes per process (computed when not given)."""
    nproc = cfg.topology.nproc_per_node
    each = plan_placement(cfg).process_host_bytes if each is None else each
    if nproc * each + LAUNCHER_BYTES <= ram_bytes:
        return None
    fit = int(max(0, ram_bytes - LAUNCHER_BYTES) // each)
    fixes = [f"lower topology.nproc_per_node to at most {fit} (topology.expert_parallel must divide it)" if fit
             else "shrink the model"]
    if cfg.train.micro_batch_size > 1:
        fixes.append("lower train.micro_batch_size")
    need, digits = nproc * each + LAUNCHER_BYTES, 2
    while digits < 6 and f"{need / GB:.{digits}f}" == f"{ram_bytes / GB:.{digits}f}":
        digits += 1  # the two figures compared are printed so that they differ
    return (f"topology.nproc_per_node={nproc} CPU processes need about {need / GB:.{digits}f} GB of RAM ({nproc} x "
            f"{each / GB:.2f} GB each by the plan + {LAUNCHER_BYTES / GB:.2f} GB for the launcher) but this machine "
            f"has {ram_bytes / GB:.{digits}f} GB; {' or '.join(fixes)}")


def launch_ram_problem(cfg: MoesysConfig, each: int) -> str | None:
    """What `moesys train` would refuse on this machine's RAM before launching (check_launchable): CPU processes
    launched here (launcher local or multinode) that do not fit in its RAM or memory cgroup. None otherwise."""
    if cfg.launcher.name == "slurm" or cfg.topology.gpus_per_node:
        return None
    ram = host_memory_bytes()
    problem = host_memory_problem(cfg, ram, each)
    if problem is None:
        return None
    declared = cfg.topology.cpu_memory_gb * GB
    other = (f"; topology.cpu_memory_gb={cfg.topology.cpu_memory_gb:g} is more than this machine has"
             if declared > ram else "")
    return f"launched here (launcher={cfg.launcher.name}) {problem}{other}; moesys train would refuse it"


def processes_per_node(cfg: MoesysConfig) -> int:
    """One process per GPU when GPUs are configured and present, else topology.nproc_per_node CPU processes."""
    if cfg.topology.gpus_per_node and cuda_device_count():
        return cfg.topology.gpus_per_node
    return cfg.topology.nproc_per_node


def worker_command(run_dir: Path, module: str = WORKER_MODULE) -> list[str]:
    """torchrun's arguments that start one worker: this Python, unbuffered, running `module` (the training worker,
    or a benchmark's) through SAFE_RUN on the run directory."""
    return ["--no-python", sys.executable, "-u", "-c", SAFE_RUN, module, str(run_dir)]


def build_launch(cfg: MoesysConfig, run_dir: Path, module: str = WORKER_MODULE) -> LaunchSpec:
    """What starts `module`'s workers on `run_dir`: the torchrun command (local, multinode) or the sbatch script."""
    launcher, nproc = cfg.launcher, processes_per_node(cfg)
    worker = worker_command(run_dir, module)
    common = [f"--nproc_per_node={nproc}", f"--max_restarts={cfg.train.max_restarts}",
              f"--log_dir={node_logs(run_dir, cfg)}", "--redirects=3"]
    if launcher.name == "local":
        argv = [*torchrun_prefix(), "--standalone", "--nnodes=1", *common, *worker]
        return LaunchSpec(argv=argv, nproc_per_node=nproc)
    if launcher.name == "multinode":
        # c10d ignores --node_rank (the rendezvous orders the nodes); node 0 hosts the rendezvous store, said
        # explicitly: torchrun's guess (the endpoint names this machine) misses an address of a secondary NIC.
        # A node waits for the others (at the start, and after a restart) as long as for a peer in a collective;
        # read_timeout too: a node started before node 0 connects to its store within read_timeout (torchrun's
        # default 60 s), not join_timeout.
        hosts = "true" if launcher.node_rank == 0 else "false"
        join_s = rendezvous_join_s(cfg)
        local = [f"--local_addr={launcher.local_addr}"] if launcher.local_addr else []
        argv = [*torchrun_prefix(), f"--nnodes={cfg.topology.nodes}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={launcher.rdzv_endpoint}", f"--rdzv_id={launcher.rdzv_id}",
                f"--rdzv_conf=is_host={hosts},join_timeout={join_s},read_timeout={join_s}", *local, *common, *worker]
        return LaunchSpec(argv=argv, nproc_per_node=nproc, env=multinode_env(cfg))
    script = slurm_script(cfg, run_dir, cfg.topology.gpus_per_node or nproc, module)
    return LaunchSpec(argv=["sbatch", str(run_dir / SLURM_SCRIPT)], script=script, nproc_per_node=nproc)


def slurm_script(cfg: MoesysConfig, run_dir: Path, nproc: int, module: str = WORKER_MODULE) -> str:
    """One srun task per node; each runs torchrun with a c10d rendezvous on the job's first node."""
    launcher = cfg.launcher
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=moesys-{cfg.recipe or 'run'}",
        f"#SBATCH --nodes={cfg.topology.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={launcher.time}",
        f"#SBATCH --output={run_dir / LOGS / SLURM_LOG}",
    ]
    if cfg.topology.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={cfg.topology.gpus_per_node}")
    if launcher.partition:
        lines.append(f"#SBATCH --partition={launcher.partition}")
    torchrun = " ".join(shlex.quote(a) for a in torchrun_prefix())
    lines += [
        "set -euo pipefail",
        *(f"export {k}={v}" for k, v in FRESH_STORE.items()),
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"srun {torchrun} --nnodes=\"$SLURM_NNODES\" --nproc_per_node={nproc} "
        f"--max_restarts={cfg.train.max_restarts} --rdzv_backend=c10d "
        f"--rdzv_endpoint=\"$head_node:{launcher.master_port}\" --rdzv_id=\"$SLURM_JOB_ID\" "
        f"{shlex.join(worker_command(run_dir, module))}",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SlurmJob:
    job_id: str | None
    """SLURM's job id; None when sbatch's answer did not name one."""
    script: Path
    log: Path | None
    """The job's output file (the script's #SBATCH --output)."""
    answer: str
    """What sbatch printed."""


def submit_slurm(spec: LaunchSpec, run_dir: Path) -> SlurmJob:
    """Write the sbatch script into the run directory and submit it; the scheduler runs it later."""
    script = run_dir / SLURM_SCRIPT
    atomic_write_text(script, spec.script or "")
    try:
        done = subprocess.run(spec.argv, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise UserError(_NO_SBATCH.format(command=spec.argv[0])) from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{spec.argv[0]} did not answer in 120 s; the script is {script}") from None
    answer = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        last = answer.splitlines()[-1] if answer else "no output"
        raise UserError(f"{spec.argv[0]} failed with exit code {done.returncode}: {last} (script {script})")
    found = re.search(r"Submitted batch job (\d+)", answer) or re.match(r"(\d+)", answer)
    job_id = found.group(1) if found else None
    log = run_dir / LOGS / SLURM_LOG.replace("%j", job_id) if job_id else None
    return SlurmJob(job_id=job_id, script=script, log=log, answer=answer)
