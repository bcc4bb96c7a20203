"""The plan chooses the split, the user the batch: with grad_accum_steps, recompute and resident_layers left to auto
the schedule keeps the tokens a step, fits the memory, prefers the fastest predicted step, and says from what batch
offloading reaches 0.8x resident (checked against a plain scan over accumulation)."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.plan.machine_profile import machine_rates
from runtime.plan.modes import OffloadMode
from runtime.plan.planner import fit_training, keepable_layers
from runtime.plan.prediction import global_tokens, predict
from runtime.plan.schedule import apply_schedule, auto_keys, choose_schedule


def shape(gpu_gb: float = 80, micro: int = 16, accum: int = 0, recompute: str = "auto", offload: str = "cpu",
          resident_layers: int | None = 0) -> MoesysConfig:
    model = ModelConfig(hidden_size=1024, num_layers=4, num_heads=8, ffn_hidden_size=4096, num_experts=8, top_k=2,
                        expert_type="swiglu", norm="rmsnorm", position="rope", bias=False, vocab_size=32000,
                        tie_embeddings=False, max_seq_len=2048)
    topology = TopologyConfig(gpus_per_node=1, gpu_memory_gb=gpu_gb, cpu_memory_gb=256, nproc_per_node=1,
                              expert_parallel=1, cpu_cores_per_node=16, adamw_gparams_per_core=0.25,
                              gemm_tflops=700, resident_mfu=0.4, pcie_h2d_gbps=50, pcie_d2h_gbps=50)
    return MoesysConfig(model=model, topology=topology,
                        storage=StorageConfig(offload=offload, resident_layers=resident_layers),
                        train=TrainConfig(micro_batch_size=micro, grad_accum_steps=accum, recompute=recompute,
                                          seq_len=2048, precision="bf16"))


def fits(cfg: MoesysConfig, micro: int, recompute: str) -> bool:
    trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=micro, grad_accum_steps=1,
                                                               recompute=recompute))
    return not fit_training(trial)[2]


def test_the_split_keeps_the_users_tokens_and_takes_the_largest_micro_batch_that_fits():
    cfg = shape(gpu_gb=12)
    assert auto_keys(cfg) == ("train.grad_accum_steps", "train.recompute")
    s = choose_schedule(cfg)
    assert s.micro_batch_size * s.grad_accum_steps == 16 and s.prediction.fits
    assert s.prediction.tokens_per_step == 16 * 2048
    larger = [m for m in (16, 8, 4, 2, 1) if m > s.micro_batch_size]
    assert all(not fits(cfg, m, r) for m in larger for r in ("none", "moe"))  # nothing larger fits
    assert fits(cfg, s.micro_batch_size, s.recompute)
    assert s.recompute == "none" or not fits(cfg, s.micro_batch_size, "none")  # recompute only when it must
    applied = apply_schedule(cfg)
    assert auto_keys(applied) == () and global_tokens(applied) == global_tokens(dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=1)))
    assert (applied.train.micro_batch_size, applied.train.grad_accum_steps, applied.train.recompute) == \
        (s.micro_batch_size, s.grad_accum_steps, s.recompute)


def test_recompute_is_chosen_where_no_split_fits_without_it():
    for gpu_gb in (x / 10 for x in range(10, 200)):
        cfg = shape(gpu_gb=gpu_gb, micro=1)
        if not fits(cfg, 1, "none") and fits(cfg, 1, "moe"):
            break
    else:
        pytest.fail("no device size between needs and does not need recomputation")
    s = choose_schedule(cfg)
    assert s.recompute == "moe" and s.prediction.fits
    assert s.chosen == ("train.grad_accum_steps", "train.recompute")


def test_a_key_the_user_set_stays_and_resident_layers_auto_keeps_what_fits():
    cfg = shape(gpu_gb=40, micro=4, accum=2, recompute="none", resident_layers=None)
    s = choose_schedule(cfg)
    assert (s.micro_batch_size, s.grad_accum_steps, s.recompute) == (4, 2, "none")
    mode, _, _, p = fit_training(dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, resident_layers=0)))
    kept = keepable_layers(dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, resident_layers=0)),
                           p, mode)
    assert 0 < s.resident_layers == kept < 4
    assert s.chosen == ("storage.resident_layers",)


def test_the_tokens_for_0_8_are_the_first_accumulation_a_plain_scan_finds():
    cfg = shape(gpu_gb=80, micro=4, accum=1, recompute="none")
    rates = machine_rates(cfg, profile={})
    s = choose_schedule(cfg, rates)
    assert s.prediction.mode is OffloadMode.CPU and s.prediction.bound.bound_term == "cpu_optimizer"

    def ratio(accum: int) -> float:
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=accum))
        cpu, none = predict(trial, rates), predict(dataclasses.replace(
            trial, storage=dataclasses.replace(trial.storage, offload="none")), rates)
        return none.step_s / cpu.step_s

    first = next(a for a in range(1, 10_000) if ratio(a) >= 0.8)
    assert s.tokens_per_step_for_0_8 == 4 * first * 2048 and s.example == (4, first, "none")
    line = s.line()
    assert line.startswith(f"cpu_optimizer bound: {s.vs_resident:.2f}x resident at 8,192 tokens a step")
    assert f"0.8x from {4 * first * 2048:,} (e.g. micro_batch 4 x grad_accum {first} with recompute none)" in line
    d = s.to_dict()
    assert {"micro_batch_size", "grad_accum_steps", "recompute", "resident_layers", "predicted_tokens_per_s",
            "predicted_vs_resident", "bound_term", "tokens_per_step_for_0_8"} <= set(d)
    assert d["predicted_vs_resident"] == pytest.approx(ratio(1))


def test_resident_training_needs_no_batch_to_reach_resident():
    s = choose_schedule(shape(offload="none", micro=8, accum=1, recompute="none"))
    assert s.tokens_per_step_for_0_8 is None and s.vs_resident == pytest.approx(1.0)
    assert s.line().startswith("gpu bound: 1.00x resident")
