"""The resident step `moesys plan --measure` probes is the job's (its ranks and expert parallelism, not one process),
and the plan built on the profile predicts what the profile's numbers imply: the measured step for resident training,
that step plus the host AdamW over the active offloaded experts for cpu on a CPU-only machine. The references are
the arithmetic written out by hand for the tiny recipe's shape."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.bench.machine import _probe_config
from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.plan.machine_profile import machine_rates, model_key, write_profile
from runtime.plan.prediction import predict_modes
from runtime.plan.step_time import resident_mfu_of

GEMM_TFLOPS, ADAMW_GPARAMS_PER_CORE = 0.156, 0.66
"""A profile's rates (the node's GEMM rate, the host AdamW of one core): inputs, not expectations."""


def tiny(**topology) -> MoesysConfig:
    """The tiny recipe: a Mixtral-layout model on 2 CPU processes with expert parallelism 2, 8 x 128 tokens a rank."""
    model = ModelConfig(hidden_size=128, num_layers=4, num_heads=4, vocab_size=320, ffn_hidden_size=256,
                        num_experts=8, top_k=2, expert_type="swiglu", norm="rmsnorm", bias=False, position="rope",
                        tie_embeddings=False, max_seq_len=256)
    layout = {"nodes": 1, "gpus_per_node": 0, "cpu_memory_gb": 16, "nproc_per_node": 2, "expert_parallel": 2,
              **topology}
    return MoesysConfig(model=model, topology=TopologyConfig(detect=False, **layout),
                        storage=StorageConfig(alpha=0.5), train=TrainConfig(micro_batch_size=8, seq_len=128))


def reference_flops_per_token() -> int:
    """6 per matmul parameter a token touches (attention, the router, 2 of 8 SwiGLU experts, norms, the output head)
    and 12 x layers x hidden x seq_len of attention, for the tiny shape."""
    h, ffn, layers, vocab, seq = 128, 256, 4, 320, 128
    per_layer = 4 * h * h + 2 * h + 8 * h + 2 * 3 * h * ffn
    return 6 * (layers * per_layer + h + vocab * h) + 12 * layers * h * seq


def test_the_probe_runs_the_jobs_layout_resident():
    cfg = dataclasses.replace(tiny(nodes=2, expert_parallel=4), storage=StorageConfig(offload="cpu"),
                              train=dataclasses.replace(tiny().train, grad_accum_steps=2, recompute="moe"))
    probe = _probe_config(cfg, 8e9, gpus=0)
    t = probe.topology
    assert (t.nodes, t.nproc_per_node, t.expert_parallel, t.gpus_per_node) == (1, 2, 2, 0)  # one node of the job
    assert probe.storage.offload == "none" and probe.model == cfg.model
    assert (probe.train.grad_accum_steps, probe.train.recompute, probe.train.micro_batch_size) == (1, "none", 8)
    assert probe.launcher.name == "local"


def test_a_measured_mfu_belongs_to_the_layout_it_was_measured_in():
    assert model_key(tiny()) != model_key(tiny(nproc_per_node=1, expert_parallel=1))
    assert model_key(tiny()) != model_key(tiny(expert_parallel=1))
    assert model_key(tiny()) == model_key(tiny(cpu_memory_gb=8))


def test_the_plan_predicts_the_probed_step_and_adds_the_host_adamw_for_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESYS_CACHE_DIR", str(tmp_path))
    cfg = tiny()
    measured_step_s = 0.2879
    mfu = resident_mfu_of(cfg, GEMM_TFLOPS * 1e12, False, measured_step_s)
    rank_flops = 8 * 128 * reference_flops_per_token()
    assert mfu == pytest.approx(rank_flops / measured_step_s / (GEMM_TFLOPS * 1e12 / 2))  # each rank: half the cores
    write_profile({"gemm_tflops": GEMM_TFLOPS, "adamw_gparams_per_core": ADAMW_GPARAMS_PER_CORE}, model_key(cfg), mfu)
    rates = machine_rates(cfg)
    assert dict(rates.sources)["resident_mfu"] == "profile" and rates.cores >= 1
    modes = predict_modes(cfg, rates)
    assert modes["none"]["step_s"] == pytest.approx(measured_step_s)
    assert modes["none"]["tokens_per_s"] == pytest.approx(2 * 8 * 128 / measured_step_s)
    per_expert = 3 * 128 * 256
    active = 8  # alpha 0.5 of a rank's 4 local experts in each of 4 MoE layers
    host_cores = rates.cores / 2
    cpu_step = measured_step_s + active * per_expert / (ADAMW_GPARAMS_PER_CORE * 1e9 * host_cores)
    assert modes["cpu"]["step_s"] == pytest.approx(cpu_step)
    assert modes["cpu"]["vs_none"] == pytest.approx(measured_step_s / cpu_step)
    assert modes["ssd"]["step_s"] >= modes["cpu"]["step_s"]
