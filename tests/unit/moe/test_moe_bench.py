"""The MoE layer benchmark runs on a tiny problem and reports consistent ratios."""

import json
import statistics

import pytest
import torch

from runtime.bench.moe_layer import run_moe_layer_bench
from runtime.bench.qwen3_moe_block import transformers_blocks
from runtime.config import ModelConfig
from runtime.moe.layer import MoELayer

TINY_QWEN3 = {"tokens": 24, "hidden": 32, "ffn": 16, "experts": 16, "top_k": 4}


def test_bench_reports_all_three_and_their_ratios():
    out = run_moe_layer_bench(tokens=64, hidden=16, ffn=32, experts=4, top_k=2, repeats=2, warmup=1,
                              fine_grained=None)
    json.dumps(out)
    for key in ("moe_tokens_per_s", "ceiling_tokens_per_s", "loop_tokens_per_s"):
        assert out[key] > 0
    # with one round the paired ratio is the ratio of that round's times
    one = run_moe_layer_bench(tokens=64, hidden=16, ffn=32, experts=4, top_k=2, repeats=1, warmup=0,
                              fine_grained=None)
    assert one["moe_vs_ceiling"] == pytest.approx(one["median_s"]["ceiling"] / one["median_s"]["moe"])
    assert one["moe_vs_loop"] == pytest.approx(one["median_s"]["loop"] / one["median_s"]["moe"])
    assert len(out["moe_vs_loop_rounds"]) == 2
    assert out["moe_vs_loop"] == pytest.approx(statistics.median(out["moe_vs_loop_rounds"]))
    assert out["moe_vs_ceiling"] == pytest.approx(statistics.median(out["moe_vs_ceiling_rounds"]))
    assert out["config"]["experts"] == 4 and out["torch_threads"] >= 1 and "fine_grained" not in out


def test_fine_grained_shape_runs_beside_transformers_blocks_on_the_same_work():
    pytest.importorskip("transformers")
    out = run_moe_layer_bench(tokens=32, hidden=16, ffn=32, experts=4, top_k=2, repeats=1, warmup=0,
                              fine_grained=TINY_QWEN3, fine_grained_repeats=2)
    json.dumps(out)
    fine = out["fine_grained"]
    assert fine["config"] == {**TINY_QWEN3, "expert_type": "swiglu", "bias": False, "repeats": 2, "warmup": 0}
    assert fine["transformers_default_impl"] == "grouped_mm"  # transformers 5's default where it can dispatch
    assert set(fine["by_dtype"]) == {"fp32", "bf16"}
    fp32 = fine["by_dtype"]["fp32"]
    assert fp32["outputs_agree"] is True
    assert max(d["max"] for d in fp32["forward_abs_diff"].values()) <= 1e-5
    for dtype in fine["by_dtype"].values():
        for rival in ("transformers", "transformers_eager"):
            assert len(dtype[f"moe_vs_{rival}_rounds"]) == 2
            assert dtype[f"moe_vs_{rival}"] == pytest.approx(statistics.median(dtype[f"moe_vs_{rival}_rounds"]))
            assert dtype[f"{rival}_tokens_per_s"] > 0


def test_transformers_blocks_hold_the_layers_weights_and_their_own_implementations():
    pytest.importorskip("transformers")
    cfg = ModelConfig(hidden_size=16, ffn_hidden_size=8, num_experts=6, top_k=2, expert_type="swiglu", bias=False,
                      capacity_factor=0.0, normalize_top_k=True)
    layer = MoELayer(cfg)
    blocks = transformers_blocks(layer, torch.float32)
    default, eager = blocks["transformers"], blocks["transformers_eager"]
    assert default.experts.config._experts_implementation == "grouped_mm"
    assert eager.experts.config._experts_implementation == "eager"
    assert eager.experts.gate_up_proj is default.experts.gate_up_proj  # one copy of the weights between them
    x = torch.randn(1, 10, 16)
    for block in (default, eager):
        torch.testing.assert_close(block(x), layer(x, stats=False)[0], rtol=1e-5, atol=1e-6)
