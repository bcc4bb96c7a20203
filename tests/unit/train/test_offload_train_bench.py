"""moesys bench offload-train: real torchrun jobs per storage mode on the resolved config, tokens/s and their
ratios to resident, MFU from a FLOP count that matches torch's own count of the step's matmuls."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from runtime.bench.mfu import matmul_flops_per_token, training_flops_per_token
from runtime.bench.offload_train import run_offload_train_bench
from runtime.config import ModelConfig, MoesysConfig, TopologyConfig, TrainConfig
from runtime.files.paths import PLAN
from runtime.model.transformer import Transformer


@pytest.mark.parametrize("expert_type", ["gelu", "swiglu"])
def test_matmul_flops_per_token_match_torchs_count_of_a_training_step(expert_type):
    """torch's FlopCounterMode counts mm/addmm (not _grouped_mm): the experts run as the per-expert loop here."""
    m = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_experts=4, top_k=2, vocab_size=256,
                    max_seq_len=64, expert_type=expert_type)
    model = Transformer(m, seed=0)
    for layer in model.moe_layers():
        layer.experts.impl = "loop"
    tokens = torch.randint(0, m.vocab_size, (2, 64))
    with FlopCounterMode(display=False) as counter:
        out = model(tokens)
        F.cross_entropy(out.logits.flatten(0, 1), tokens.flatten()).backward()
    per_token = counter.get_total_flops() / tokens.numel()
    assert matmul_flops_per_token(m) == pytest.approx(per_token, rel=0.02)
    assert training_flops_per_token(m, 64) - matmul_flops_per_token(m) == 12 * 2 * 64 * 64


@pytest.mark.extended
def test_offload_train_bench_runs_each_mode_and_reports_ratios_and_mfu():
    cfg = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, max_seq_len=32),
                       topology=TopologyConfig(nproc_per_node=1, expert_parallel=1),
                       train=TrainConfig(seq_len=16, micro_batch_size=2))
    r = run_offload_train_bench(cfg, steps=4, warmup=1, variants=("none", "cpu", "cpu_half"), time_limit_s=300)
    assert r["device"] == "cpu" and r["peak_flops"] > 0
    for name in ("none", "cpu"):
        assert "error" not in r[name], r[name]
        assert r[name]["tokens_per_s"] > 0 and r[name]["steps_timed"] == 3 and 0 < r[name]["mfu"] < 2
    assert r["cpu_vs_none"] == r["cpu"]["tokens_per_s"] / r["none"]["tokens_per_s"] and r["cpu_half_vs_none"] > 0
    assert r["cpu_half"]["experts_active"] <= 4 < r["cpu"]["experts_active"]  # one of the 2 layers offloaded
    assert r["cpu"]["experts_active"] > 0 and 0 <= r["cpu"]["host_hidden_share"] <= 1
    assert "adamw" in r["cpu"]["time_s"] and "time_s" not in r["none"]  # where the offloaded step's time went
    assert r["cpu_half"]["alpha"] == r["cpu_half"]["experts_active"] / 4 and 0 < r["cpu"]["alpha"] <= 1


def test_a_corpus_of_one_token_activates_top_k_of_the_experts_each_step(tmp_path):
    """The GPU script's alpha <= 0.25 case: with rotary positions every position of a one-token text has the same
    hidden state, so each MoE layer sends all its tokens to the same top_k experts: alpha = top_k / experts."""
    one_token = tmp_path / "a.txt"
    one_token.write_text("a" * 4096)
    cfg = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2,
                                         max_seq_len=32, position="rope"),
                       topology=TopologyConfig(nproc_per_node=1, expert_parallel=1),
                       train=TrainConfig(seq_len=16, micro_batch_size=4, data=str(one_token)))
    r = run_offload_train_bench(cfg, steps=4, warmup=1, variants=("cpu",), time_limit_s=300, workdir=tmp_path)
    assert r["cpu"]["experts_active"] == 2 * 2 and r["cpu"]["alpha"] == 0.25
    recorded = json.loads((tmp_path / "cpu" / PLAN).read_text())  # the job API's launch planned it; no worker did
    assert recorded["placement"]["offload"] == "cpu"


def test_a_variant_the_launch_refuses_is_reported_by_its_one_line_and_not_run(tmp_path):
    """As `moesys train` refuses it: the plan says it does not fit, so nothing is launched."""
    cfg = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, max_seq_len=32),
                       topology=TopologyConfig(nproc_per_node=1, expert_parallel=1, cpu_memory_gb=0.01),
                       train=TrainConfig(seq_len=16, micro_batch_size=2))
    r = run_offload_train_bench(cfg, steps=4, warmup=1, variants=("cpu",), time_limit_s=300, workdir=tmp_path)
    assert r["cpu"]["error"].startswith("the plan says this run does not fit") and "\n" not in r["cpu"]["error"]
    assert not (tmp_path / "cpu" / PLAN).exists()


def test_the_fit_variants_keep_as_many_layers_as_the_plan_says_the_gpu_holds(tmp_path):
    from runtime.bench.offload_train import variant_config
    from runtime.plan.planner import plan_placement

    model = ModelConfig(hidden_size=1024, ffn_hidden_size=4096, num_layers=8, num_heads=8, num_experts=8,
                        max_seq_len=512)
    gpu = TopologyConfig(detect=False, gpus_per_node=1, gpu_memory_gb=8, cpu_memory_gb=64, nproc_per_node=1,
                         expert_parallel=1)
    cfg = MoesysConfig(model=model, topology=gpu, train=TrainConfig(seq_len=512, micro_batch_size=1,
                                                                     precision="bf16"))
    fit = variant_config(cfg, tmp_path, "cpu_fit_delayed", 4)
    assert fit.storage.offload == "cpu" and fit.storage.delayed_update
    assert 0 < fit.storage.resident_layers == plan_placement(fit).keepable_layers < 7
    cpu_only = dataclasses.replace(cfg, topology=dataclasses.replace(gpu, gpus_per_node=0))
    assert variant_config(cpu_only, tmp_path, "cpu_fit", 4).storage.resident_layers == 0  # nothing fits off the CPU
