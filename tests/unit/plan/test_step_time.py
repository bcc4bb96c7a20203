"""The step's bound and the plan's prediction (runtime/plan/step_time.py, prediction.py) against the arithmetic done by
hand: the largest term with GPUs, compute plus host work without them; the offload benchmark's 2.43B Mixtral-style shape on an H200's rates."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.plan.machine_profile import machine_rates
from runtime.plan.params import count_parameters
from runtime.plan.prediction import predict, predict_modes, with_mode
from runtime.plan.modes import OffloadMode
from runtime.plan.step_memory import activation_bytes
from runtime.plan.step_time import (Rates, StepWork, recompute_flops_per_token, step_bound,
                                    training_flops_per_token)

GPU_RATES = Rates(h2d_bytes_per_s=50e9, d2h_bytes_per_s=40e9, adamw_params_per_s_per_core=0.25e9, cores=16,
                  disk_read_bytes_per_s=2e9, disk_write_bytes_per_s=1e9, gemm_flops=800e12, resident_mfu=0.4,
                  gpus=True)


def test_with_gpus_the_largest_term_bounds_the_step():
    work = StepWork(compute_s=0.2, h2d_bytes=5e9, d2h_bytes=8e9, optimizer_params=1e9, host_cores=16,
                    disk_read_bytes=1e9, disk_write_bytes=1e9)
    b = step_bound(work, GPU_RATES)
    assert b.terms_s == pytest.approx({"gpu": 0.2, "pcie": max(5e9 / 50e9, 8e9 / 40e9), "cpu_optimizer": 1e9 / 4e9,
                                       "disk": 0.5 + 1.0})
    assert b.bound_term == "disk" and b.bound_s == pytest.approx(1.5)
    assert b.to_dict(3.0)["vs_bound"] == pytest.approx(0.5)


def test_without_gpus_compute_and_host_work_share_the_cores():
    cpu = dataclasses.replace(GPU_RATES, gpus=False)
    b = step_bound(StepWork(compute_s=0.3, h2d_bytes=1e12, optimizer_params=1e9, host_cores=2), cpu)
    assert b.terms_s["pcie"] == 0  # no bus: the device's copies are host memory
    assert b.bound_s == pytest.approx(0.3 + 1e9 / 0.5e9) and b.bound_term == "cpu_optimizer"


def h200_shape(**storage) -> MoesysConfig:
    """The offload benchmark's 2.43B Mixtral-style shape, 8,192 tokens a step, on one H200 with 16 host cores."""
    model = ModelConfig(hidden_size=2048, num_layers=8, num_heads=16, num_kv_heads=4, ffn_hidden_size=5632,
                        num_experts=8, top_k=2, expert_type="swiglu", norm="rmsnorm", position="rope", bias=False,
                        tie_embeddings=False, vocab_size=32000, max_seq_len=4096)
    topology = TopologyConfig(gpus_per_node=1, gpu_memory_gb=141, cpu_memory_gb=125, nproc_per_node=1,
                              expert_parallel=1, cpu_cores_per_node=16, adamw_gparams_per_core=0.27,
                              gemm_tflops=780, resident_mfu=0.34, pcie_h2d_gbps=55, pcie_d2h_gbps=55)
    return MoesysConfig(model=model, topology=topology, storage=StorageConfig(**storage),
                        train=TrainConfig(micro_batch_size=4, seq_len=2048, precision="bf16"))


def test_the_2_43b_shape_is_bound_by_the_host_adamw_at_a_quarter_of_resident():
    cfg = h200_shape(offload="cpu")
    rates = machine_rates(cfg, profile={})
    p = count_parameters(cfg.model)
    tokens = 4 * 2048
    compute = training_flops_per_token(cfg.model, 2048) * tokens / (780e12 * 0.34)
    adamw = p.sparse / (0.27e9 * 16)  # alpha 1: every expert of every layer is stepped on the host
    modes = predict_modes(cfg, rates)
    assert modes["none"]["step_s"] == pytest.approx(compute) and modes["none"]["bound_term"] == "gpu"
    assert modes["cpu"]["terms_s"]["cpu_optimizer"] == pytest.approx(adamw)
    assert modes["cpu"]["terms_s"]["pcie"] == pytest.approx(p.sparse * 2 / 55e9)  # bf16 weights in (and grads out)
    assert modes["cpu"]["bound_term"] == "cpu_optimizer"
    assert modes["cpu"]["vs_none"] == pytest.approx(compute / adamw)
    assert 0.2 < modes["cpu"]["vs_none"] < 0.35  # no schedule brings 8,192 tokens above 0.28x
    assert 50_000 < modes["none"]["tokens_per_s"] < 65_000  # the H200 measured 57,303


def test_recomputation_costs_a_forward_of_what_it_recomputes():
    m = h200_shape().model
    p = count_parameters(m)
    assert recompute_flops_per_token(m, 2048, "none") == 0
    assert recompute_flops_per_token(m, 2048, "moe") == 2 * m.top_k * p.per_expert * p.moe_layers
    full = training_flops_per_token(m, 2048)
    assert recompute_flops_per_token(m, 2048, "block") == pytest.approx((full - 6 * m.vocab_size * m.hidden_size) / 3)


def test_recomputation_keeps_fewer_activations_in_the_order_it_recomputes():
    cfg = h200_shape()
    sizes = {r: activation_bytes(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute=r)))
             for r in ("none", "moe", "block")}
    assert sizes["none"] > sizes["moe"] > sizes["block"] > 0


def test_a_prediction_uses_the_mode_auto_would_choose_and_says_when_it_does_not_fit():
    cfg = h200_shape(offload="auto")
    got = predict(cfg, machine_rates(cfg, profile={}))
    assert got.mode is OffloadMode.NONE and got.fits  # 2.43B fits an H200
    tiny = dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, gpu_memory_gb=8))
    assert predict(with_mode(tiny, OffloadMode.NONE), machine_rates(tiny, profile={})).fits is False
