"""The ring benchmark runs all three modes on one model and reports consistent ratios and byte budgets."""

import statistics

import pytest

from runtime.bench.ring import bench_model_config, run_ring_bench
from runtime.plan.params import count_parameters


def test_default_bench_model_is_expert_heavy():
    counts = count_parameters(bench_model_config())
    assert counts.sparse / counts.total >= 0.8


def test_ring_bench_small():
    cfg = bench_model_config(hidden=32, ffn=64, experts=4, layers=3, max_seq_len=32)
    r = run_ring_bench(cfg, ring_slots=2, batches=(4, 1), prompt_len=4, new_tokens=3, repeats=3)
    assert r["model"]["expert_share"] >= 0.5
    for key in ("none_tokens_per_s", "ring_tokens_per_s", "ondemand_tokens_per_s"):
        assert r[key] > 0
    assert r["batch"] == 4 and set(r["by_batch"]) == {"4", "1"}
    assert r["by_batch"]["4"]["ring_vs_none"] == r["ring_vs_none"]
    assert len(r["ring_vs_none_rounds"]) == 3
    assert r["ring_vs_none"] == statistics.median(r["ring_vs_none_rounds"])
    assert r["ring_vs_ondemand"] == statistics.median(r["ring_vs_ondemand_rounds"])
    assert r["copy_within_compute"] == (r["layer_copy_ms"] <= r["layer_compute_ms"])
    none_forward_s, copy_s = r["batch"] / r["none_tokens_per_s"], 3 * r["layer_copy_ms"] / 1e3
    assert r["ring_stall_per_copy_s"] == pytest.approx(none_forward_s * (1 / r["ring_vs_none"] - 1) / copy_s)
    assert r["expert_device_bytes_ring"] * 3 == r["expert_device_bytes_none"] * 2  # K/N of resident
    assert r["expert_device_bytes_ondemand"] * 3 == r["expert_device_bytes_none"]
    layer_bytes = r["expert_device_bytes_ondemand"]
    # both offloading modes move one layer per MoE layer per forward: 3 layers x 3 forwards over 4 x 3 tokens
    assert r["copied_bytes_per_token_ondemand"] == layer_bytes * 3 * 3 / 12
    assert r["copied_bytes_per_token_ring"] == r["copied_bytes_per_token_ondemand"]
    assert 0.0 <= r["copy_hidden_share_ring"] <= 1.0
