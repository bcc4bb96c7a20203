"""The plan's host term for oneDNN's bf16 kernels (ONEDNN_BF16_BYTES) against what torch's CPU bf16 matmuls keep."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.config import MoesysConfig, TopologyConfig, TrainConfig
from runtime.plan.planner import ONEDNN_BF16_BYTES, PROCESS_RUNTIME_BYTES, plan_placement, process_runtime_bytes

GROWTH = """
import ctypes, torch
def anon():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon"))
w = torch.randn(64, 64, dtype=torch.bfloat16)
start = anon()
for m in range(1, 2501):  # an expert GEMM's shapes: its token count changes from step to step
    x = torch.randn(m, 64, dtype=DTYPE)
    (x @ w.to(DTYPE)).t() @ x
ctypes.CDLL(None).malloc_trim(0)  # as a training worker does after each step
print(anon() - start)
"""


def _growth(dtype: str) -> int:
    """Anonymous RSS a fresh process gains running a forward and a weight-gradient GEMM at 2,500 shapes."""
    done = subprocess.run([sys.executable, "-c", GROWTH.replace("DTYPE", dtype)], capture_output=True, text=True,
                          timeout=300, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.extended
def test_bf16_matmuls_of_many_shapes_keep_memory_within_the_plans_term_and_fp32_ones_keep_none():
    bf16 = _growth("torch.bfloat16")
    assert ONEDNN_BF16_BYTES / 3 < bf16 <= ONEDNN_BF16_BYTES
    assert _growth("torch.float32") < 0.05 * ONEDNN_BF16_BYTES


def test_the_term_counts_for_bf16_workers_without_a_gpu_only():
    def runtime(precision: str, gpus: int) -> int:
        cfg = MoesysConfig(train=TrainConfig(precision=precision),
                           topology=TopologyConfig(detect=False, gpus_per_node=gpus, gpu_memory_gb=80 * gpus))
        return process_runtime_bytes(cfg)

    assert runtime("bf16", 0) == PROCESS_RUNTIME_BYTES + ONEDNN_BF16_BYTES
    assert runtime("fp32", 0) == runtime("fp16", 0) == PROCESS_RUNTIME_BYTES
    assert runtime("bf16", 1) == runtime("fp32", 1) > PROCESS_RUNTIME_BYTES  # CUDA's host side instead
    bf16 = MoesysConfig(train=TrainConfig(precision="bf16"))
    fp32 = MoesysConfig(train=TrainConfig(precision="fp32"))
    assert plan_placement(bf16).process_host_bytes - plan_placement(fp32).process_host_bytes > ONEDNN_BF16_BYTES / 2
