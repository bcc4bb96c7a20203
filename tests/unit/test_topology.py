"""runtime/host/topology.py: the CPUs a process may use and the share torch's thread pool gets."""

from __future__ import annotations

import pytest
import torch

from runtime.host import topology
from runtime.host.topology import set_cpu_threads, usable_cpus


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_usable_cpus_is_the_affinity_mask_capped_by_the_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    monkeypatch.setattr(topology, "CGROUP_CPU_MAX", tmp_path / "missing")
    assert usable_cpus() == 6
    (tmp_path / "cpu.max").write_text("max 100000\n")
    monkeypatch.setattr(topology, "CGROUP_CPU_MAX", tmp_path / "cpu.max")
    assert usable_cpus() == 6
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert usable_cpus() == 3


def test_set_cpu_threads_shares_the_cpus_unless_the_user_chose(monkeypatch, threads):
    monkeypatch.setattr(topology, "usable_cpus", lambda: 6)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert set_cpu_threads(1) == 6 and set_cpu_threads(4) == 1 and set_cpu_threads(2) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(5)
    assert set_cpu_threads(1) == 5  # the user's choice stands
    assert set_cpu_threads(2, respect_env=False) == 3  # torchrun's workers: OMP_NUM_THREADS=1 is torchrun's default


def test_host_memory_is_the_cgroup_limit_when_lower():
    """Inside a memory cgroup (a container, a capped job) the plan must size for the limit, not the machine's RAM."""
    import subprocess
    import sys

    from runtime.host import memcap

    if memcap.available():
        pytest.skip(memcap.available())
    probe = "from runtime.host.topology import detect_machine as d; print(d('.').cpu_memory_gb)"
    with memcap.MemoryCap(3 * 2**30) as cap:
        out = subprocess.run([sys.executable, "-c", probe], preexec_fn=cap.preexec, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == round(3 * 2**30 / 1e9, 2)


def test_last_level_cache_is_the_largest_data_cache_the_kernel_describes(tmp_path):
    from runtime.host.topology import LAST_LEVEL_CACHE_FALLBACK, last_level_cache_bytes

    for index, (kind, size) in enumerate([("Data", "32K"), ("Instruction", "64M"), ("Unified", "1024K"),
                                          ("Unified", "32768K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "type").write_text(kind + "\n")
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "absent") == LAST_LEVEL_CACHE_FALLBACK
