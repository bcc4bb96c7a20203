"""The MoE layer benchmark runs on a tiny problem and reports consistent ratios."""

import json
import statistics

import pytest

from runtime.bench.moe_layer import run_moe_layer_bench


def test_bench_reports_all_three_and_their_ratios():
    out = run_moe_layer_bench(tokens=64, hidden=16, ffn=32, experts=4, top_k=2, repeats=2, warmup=1)
    json.dumps(out)
    for key in ("moe_tokens_per_s", "ceiling_tokens_per_s", "loop_tokens_per_s"):
        assert out[key] > 0
    # with one round the paired ratio is the ratio of that round's times
    one = run_moe_layer_bench(tokens=64, hidden=16, ffn=32, experts=4, top_k=2, repeats=1, warmup=0)
    assert one["moe_vs_ceiling"] == pytest.approx(one["median_s"]["ceiling"] / one["median_s"]["moe"])
    assert one["moe_vs_loop"] == pytest.approx(one["median_s"]["loop"] / one["median_s"]["moe"])
    assert len(out["moe_vs_loop_rounds"]) == 2
    assert out["moe_vs_loop"] == pytest.approx(statistics.median(out["moe_vs_loop_rounds"]))
    assert out["moe_vs_ceiling"] == pytest.approx(statistics.median(out["moe_vs_ceiling_rounds"]))
    assert out["config"]["experts"] == 4 and out["torch_threads"] >= 1
