"""The memory check `moesys train` runs before starting CPU workers: the plan's host bytes per process times
topology.nproc_per_node must fit this machine's RAM."""

from __future__ import annotations

import pytest

from runtime.config import MoesysConfig, TopologyConfig, TrainConfig
from runtime.errors import UserError
from runtime.launch import check_host_memory, check_launchable
from runtime.plan.budget import GB
from runtime.plan.planner import PROCESS_RUNTIME_BYTES, plan_placement

RAM_24_GIB = 24 * 2**30


def cpu_run(nproc: int, micro_batch_size: int = 8) -> MoesysConfig:
    return MoesysConfig(topology=TopologyConfig(nproc_per_node=nproc, expert_parallel=2),
                        train=TrainConfig(micro_batch_size=micro_batch_size))


def test_64_cpu_workers_do_not_fit_24_gib_and_the_error_names_the_keys():
    with pytest.raises(UserError) as err:
        check_launchable(cpu_run(64), ram_bytes=RAM_24_GIB)
    message = str(err.value)
    assert "\n" not in message and "topology.nproc_per_node=64" in message
    fit = int(message.split("at most ")[1].split()[0])
    assert 2 <= fit < 64 and "train.micro_batch_size" in message
    check_launchable(cpu_run(fit), ram_bytes=RAM_24_GIB)


def test_two_cpu_workers_fit_and_each_counts_its_runtime():
    cfg = cpu_run(2)
    check_launchable(cfg, ram_bytes=RAM_24_GIB)
    plan = plan_placement(cfg)
    assert plan.process_host_bytes == plan.per_rank.device_total + plan.per_rank.host + PROCESS_RUNTIME_BYTES


def test_a_micro_batch_of_one_is_not_asked_to_shrink():
    with pytest.raises(UserError) as err:
        check_host_memory(cpu_run(64, micro_batch_size=1), 4 * GB)
    assert "micro_batch_size" not in str(err.value)


def test_slurm_jobs_skip_the_ram_check(monkeypatch):
    slurm = cpu_run(64)
    slurm.launcher.name = "slurm"
    monkeypatch.setattr("runtime.launch.shutil.which", lambda name: "/usr/bin/sbatch")
    check_launchable(slurm, ram_bytes=1 * GB)  # the nodes are not this machine
