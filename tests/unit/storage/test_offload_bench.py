"""The offload benchmark runs every mode in its own process on each input and reports consistent ratios."""

from runtime.bench.offload import run_offload_bench


def test_offload_bench_small():
    r = run_offload_bench(hidden=32, ffn=64, experts=4, layers=2, tokens=8, steps=3, warmup=1, rounds=1,
                          inputs=("random", "corpus"))
    assert r["input"] == "random" and set(r["by_input"]) == {"random", "corpus"}
    for result in r["by_input"].values():
        for mode in ("none", "ssd", "fetch_all"):
            assert result[f"{mode}_steps_per_s"] > 0
        assert result["ssd_vs_none"] == result["ssd_steps_per_s"] / result["none_steps_per_s"]
        assert result["ssd_vs_fetch_all"] == result["ssd_steps_per_s"] / result["fetch_all_steps_per_s"]
        assert 0 < result["mean_active_experts"] <= r["total_experts"]
        assert 0.0 <= result["ssd_cache_hit_rate"] <= 1.0
    assert r["cache_experts"] == 2  # 25% of 2 layers x 4 experts
    assert r["ssd_vs_none"] == r["by_input"]["random"]["ssd_vs_none"]
