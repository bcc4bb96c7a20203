"""The offload benchmark runs every mode in its own process on each input and reports consistent ratios, the
store's traffic against the disk's own bandwidth, and a realistic load with most experts active."""

import pytest

from runtime.bench.disk import measure_disk
from runtime.bench.offload import run_offload_bench


@pytest.mark.extended
def test_offload_bench_small():
    r = run_offload_bench(hidden=32, ffn=64, experts=4, layers=2, tokens=8, steps=3, warmup=1, rounds=1,
                          inputs=("corpus",), load_tokens=256, load_steps=3, disk_probe_bytes=32 << 20,
                          fine_grained_s=30.0)
    assert r["input"] == "corpus" and set(r["by_input"]) == {"corpus"}
    for result in (*r["by_input"].values(), r["realistic_load"]):
        for mode in ("none", "ssd", "fetch_all"):
            assert result[f"{mode}_steps_per_s"] > 0
            assert result[f"{mode}_s_per_step"] > 0
        assert result["ssd_vs_none"] == result["ssd_steps_per_s"] / result["none_steps_per_s"]
        assert result["ssd_vs_fetch_all"] == result["ssd_steps_per_s"] / result["fetch_all_steps_per_s"]
        assert 0 < result["mean_active_experts"] <= r["total_experts"]
        assert 0.0 <= result["ssd_cache_hit_rate"] <= 1.0
        for mode in ("ssd", "fetch_all"):
            assert result[f"{mode}_read_vs_disk"] == result[f"{mode}_read_bytes_per_s"] / r["disk"]["read_bytes_per_s"]
            assert result[f"{mode}_write_vs_disk"] > 0  # the timed steps always write updated experts home
    assert r["cache_experts"] == 2  # 25% of 2 layers x 4 experts
    assert r["ssd_vs_none"] == r["by_input"]["corpus"]["ssd_vs_none"]
    load = r["realistic_load"]
    assert load["input"] == "random" and load["tokens_per_step"] == 256 and load["active_expert_fraction"] > 0.75  # most experts active
    assert r["disk"]["probe_bytes"] == 32 << 20
    for mode in ("cpu", "ssd"):  # the host side's cost: work (the store's I/O by its CPU time) and idle waits
        h = r[mode]
        assert h["work_ns_per_param"] + h["idle_wait_ns_per_param"] == pytest.approx(h["cpu_side_ns_per_param"])
        assert h["floor_ns_per_param"] > 0 and 0.0 <= h["hidden_share"] <= 1.0
    assert r["ssd"]["seconds_by_kind"]["ssd_write"] > 0 and r["ssd"]["disk_floor_ns_per_param"] > 0
    assert r["cpu"]["store_write_bytes_per_step"] == 0 and "ssd_write" not in r["cpu"]["seconds_by_kind"]
    fine = r["fine_grained"]  # 128 experts a layer, top-8, beside 8, top-2, as many expert parameters a layer
    for name, experts, top_k, ffn in (("coarse", 8, 2, 64), ("fine", 128, 8, 4)):
        variant = fine[name]
        assert (variant["config"]["experts"], variant["config"]["top_k"], variant["config"]["ffn"]) == (experts, top_k,
                                                                                                          ffn)
        assert 0 < variant["mean_active_experts"] <= 2 * experts and 0.0 <= variant["ssd_cache_hit_rate"] <= 1.0
        assert variant["ssd_bytes_per_step"] > 0 and "fetch_all_steps_per_s" not in variant
        for mode in ("cpu", "ssd"):
            assert variant[mode]["cpu_side_vs_floor"] > 0 and variant[mode]["active_params_per_step"] > 0
    for mode in ("cpu", "ssd"):
        assert fine["fine_vs_coarse_host"][mode] == pytest.approx(
            fine["fine"][mode]["cpu_side_vs_floor"] / fine["coarse"][mode]["cpu_side_vs_floor"])


def test_disk_probe_moves_its_bytes_and_leaves_nothing(tmp_path):
    bw = measure_disk(tmp_path, 20 << 20)
    assert bw.probe_bytes == 32 << 20  # whole 16 MiB blocks
    assert bw.write_bytes_per_s > 0 and bw.read_bytes_per_s > 0
    assert list(tmp_path.iterdir()) == []
