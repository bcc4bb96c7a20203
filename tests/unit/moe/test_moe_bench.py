"""The MoE layer benchmark runs on a tiny problem and reports consistent ratios."""

import json

import pytest

from runtime.bench.moe_layer import run_moe_layer_bench


def test_bench_reports_all_three_and_their_ratios():
    out = run_moe_layer_bench(tokens=64, hidden=16, ffn=32, experts=4, top_k=2, repeats=2, warmup=1)
    json.dumps(out)
    for key in ("moe_tokens_per_s", "ceiling_tokens_per_s", "loop_tokens_per_s"):
        assert out[key] > 0
    assert out["moe_vs_ceiling"] == pytest.approx(out["moe_tokens_per_s"] / out["ceiling_tokens_per_s"])
    assert out["moe_vs_loop"] == pytest.approx(out["moe_tokens_per_s"] / out["loop_tokens_per_s"])
    assert out["config"]["experts"] == 4 and out["torch_threads"] >= 1
