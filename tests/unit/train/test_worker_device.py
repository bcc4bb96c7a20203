"""The worker's device follows the topology: a CPU topology (topology.gpus_per_node=0) stays on the CPU on a machine
with CUDA, because its plan, its process count and its RAM check assumed CPU processes."""

from __future__ import annotations

import pytest
import torch

from runtime.train import worker


@pytest.fixture
def single_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)


def test_a_cpu_topology_stays_on_the_cpu_where_cuda_is_available(single_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail(f"set_device({device}) on a CPU job"))
    assert worker.init_distributed(gpus=False) == (0, 1, 1, torch.device("cpu"))


def test_without_a_topology_the_device_is_cuda_where_available(single_process, monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert worker.init_distributed()[3] == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker.init_distributed()[3] == torch.device("cpu")


@pytest.mark.gpu
def test_a_gpu_topology_takes_the_local_gpu(single_process, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert worker.init_distributed(gpus=True)[3] == torch.device("cuda", 0)
