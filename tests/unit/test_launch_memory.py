"""The memory check `moesys train` runs before starting CPU workers: the plan's host bytes per process times
topology.nproc_per_node must fit this machine's RAM."""

from __future__ import annotations

import pytest

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.errors import UserError
from runtime.launch import check_host_memory, check_launchable, host_memory_problem
from runtime.plan.budget import GB
from runtime.plan.planner import LAUNCHER_BYTES, PROCESS_RUNTIME_BYTES, plan_placement
from runtime.topology import detect_machine

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


def _issue_run(cpu_memory_gb: float) -> MoesysConfig:
    """The offloaded run a user planned under a memory cap: 2 CPU workers, 240 experts a layer on SSD."""
    return MoesysConfig(
        model=ModelConfig(hidden_size=1024, ffn_hidden_size=512, num_layers=6, num_heads=8, num_experts=240, top_k=1,
                          max_seq_len=64, vocab_size=256),
        topology=TopologyConfig(nproc_per_node=2, expert_parallel=2, cpu_memory_gb=cpu_memory_gb, ssd_gb=1000),
        storage=StorageConfig(offload="ssd", alpha=0.125), train=TrainConfig(seq_len=32))


@pytest.mark.parametrize("cap_gib", [6, 10, 10.5, 16, 24.3])
def test_the_launch_check_accepts_what_the_plan_sized_under_a_cap(monkeypatch, tmp_path, cap_gib):
    cap = int(cap_gib * 2**30)
    monkeypatch.setattr("runtime.topology.host_memory_bytes", lambda: cap)
    cfg = _issue_run(detect_machine(str(tmp_path)).cpu_memory_gb)  # as topology=local measures the cap
    assert cfg.topology.cpu_memory_gb * GB <= cap
    plan = plan_placement(cfg)
    assert plan.feasible and plan.per_rank.host > 0, plan.problems
    assert host_memory_problem(cfg, cap, plan.process_host_bytes) is None
    check_host_memory(cfg, cap, plan)


def test_the_refusal_totals_every_term_it_compares():
    cfg = _issue_run(10.0)
    each = plan_placement(cfg).process_host_bytes
    ram = 2 * each + LAUNCHER_BYTES - 10**6  # a megabyte short
    message = host_memory_problem(cfg, ram, each)
    need = float(message.split("need about ")[1].split()[0])
    has = float(message.split("this machine has ")[1].split()[0])
    assert need > has and abs(need * GB - (2 * each + LAUNCHER_BYTES)) < 0.01 * GB
    assert f"2 x {each / GB:.2f} GB each by the plan + {LAUNCHER_BYTES / GB:.2f} GB for the launcher" in message
