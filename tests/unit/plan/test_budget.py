"""Eq. 1 budgets and placement decisions, checked against hand-computed numbers."""

from __future__ import annotations

import math

import dataclasses

from runtime.config import MoesysConfig, ModelConfig, StorageConfig, TopologyConfig
from runtime.plan.params import count_parameters
from runtime.plan.budget import GB, eq1_budget
from runtime.plan.planner import LAUNCHER_BYTES, PROCESS_RUNTIME_BYTES, plan_placement, plan_to_dict
from runtime.plan.step_memory import CUDA_HOST_BYTES


def config(**topology) -> MoesysConfig:
    model = ModelConfig(hidden_size=4096, num_layers=12, num_heads=64, vocab_size=50304, num_experts=8, top_k=1,
                        max_seq_len=1024)
    topo = dict(nodes=1, gpus_per_node=8, gpu_memory_gb=80, cpu_memory_gb=1024, ssd_gb=15000, expert_parallel=8,
                nproc_per_node=8)
    topo.update(topology)
    cfg = MoesysConfig(model=model, topology=TopologyConfig(**topo))
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=1, seq_len=1024, precision="fp16")
    return cfg


def test_eq1_by_hand():
    cfg = config(nodes=2)
    cfg.storage = StorageConfig(alpha=0.5)
    p = count_parameters(cfg.model)
    b = eq1_budget(cfg, p)
    assert b.gpu.required_bytes == int(16 * p.dense + 4 * 0.5 * p.sparse / 12)
    assert b.gpu.capacity_bytes == int(8 * 80 * GB * 2)
    assert b.cpu.required_bytes == int(16 * 0.5 * p.sparse) and b.cpu.capacity_bytes == int(1024 * GB * 2)
    assert b.ssd.required_bytes == int(12 * p.sparse) and b.ssd.capacity_bytes == int(15000 * GB * 2)
    assert b.ok and b.min_nodes() == 1


def test_13b_fits_on_one_node_of_a100s():
    plan = plan_to_dict(plan_placement(config()))
    assert plan["feasible"] and plan["placement"]["offload"] == "none"
    assert round(plan["params"]["total"] / 1e9, 1) == 13.9
    assert set(plan["budget"]["tiers"]) == {"gpu", "cpu", "ssd"}


def test_auto_moves_experts_to_ssd_and_names_the_failing_inequality():
    cfg = config(gpu_memory_gb=32, cpu_memory_gb=50)
    cfg.storage = StorageConfig(offload="auto", alpha=0.25)
    plan = plan_placement(cfg)
    assert plan.mode == "ssd" and not plan.feasible
    assert any("Eq. 1 CPU tier fails: 16aS <= M_CPU*N" in p for p in plan.problems)
    # A step holds its active experts' states and gradients on the host (16aS): one expert per rank and layer
    # here, so only more memory per rank helps.
    assert "give each rank more memory" in plan.suggestions[-1]
    fixed = config(gpu_memory_gb=32, cpu_memory_gb=100)
    fixed.storage = StorageConfig(offload="ssd", alpha=0.25)
    assert plan_placement(fixed).feasible


def test_ssd_cache_size_comes_from_host_memory():
    cfg = config(cpu_memory_gb=64)
    cfg.storage = StorageConfig(offload="ssd", alpha=0.1)
    plan = plan_placement(cfg)
    per_expert = count_parameters(cfg.model).per_expert
    # What the cache may use: the rank's RAM less the experts the prefetcher stages for the next layer and the
    # gradients of the step's active experts; a cached expert holds its weights and moments (12 bytes).
    layer_active = math.ceil(cfg.storage.alpha * cfg.model.num_experts / cfg.topology.expert_parallel)
    step_active = math.ceil(cfg.storage.alpha * plan.per_rank.local_experts)
    staged = 12 * per_expert * layer_active * cfg.storage.prefetch_depth
    grads = 4 * per_expert * step_active
    ram = (64 * GB - LAUNCHER_BYTES) / 8 - PROCESS_RUNTIME_BYTES - CUDA_HOST_BYTES  # a CUDA worker's runtime
    assert plan.per_rank.cache_experts == int((ram - staged - grads) // (12 * per_expert))
    assert plan.per_rank.host <= plan.per_rank.host_capacity


def test_largest_ring_that_fits_for_inference():
    plan = plan_placement(config(gpu_memory_gb=8))
    inf = plan.inference
    assert inf["max_ring_slots"] == (8 * GB - inf["dense_bytes"]) // inf["expert_layer_bytes"]
