"""`moesys bench infer` at a tiny shape: every system (transformers' default generate and its static cache,
transformers + accelerate's disk offload, moesys none/auto/ring and none through the forward per token) decodes the
same greedy tokens, accelerate really offloaded the streamed layers' experts to its folder, the targeted ratios
are reported, and so are each moesys mode's profiler counts, the bytes its token reads and every system's
bandwidth bound at its thread count, on one thread and on all. No timing is asserted."""

import pytest

from runtime.bench.infer import run_infer_bench

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")

TINY = {"hidden": 128, "ffn": 256, "layers": 4, "experts": 4, "vocab": 512, "heads": 4, "kv_heads": 2}


@pytest.mark.extended
def test_every_system_decodes_the_same_tokens_and_accelerate_offloads_to_disk():
    r = run_infer_bench(ring_slots=2, shape=TINY, new_tokens=6, repeats=1, capped=False, isolate=False)
    systems = r["systems"]
    assert set(systems) == {"transformers", "transformers_static", "accelerate_disk", "moesys_none", "moesys_auto",
                            "moesys_ring", "moesys_none_forward"}
    for name, result in systems.items():
        assert "error" not in result, (name, result)
        assert len(result["tokens"]) == 6 and 0 <= result["matching_prefix"] <= 6, name
        assert result["decode_tokens_per_s"] > 0 and result["disk_read_bytes_per_token"] >= 0
    # moesys's modes decode none's tokens; the peers decode transformers' (this tiny random model's bf16 logits are
    # nearly uniform, so two libraries' kernels break the ties apart from the first token: the families' fp32 parity
    # is checked against transformers in tests/unit/inference/test_hf_mixtral.py and tests/hf_families.py)
    assert all(systems[name]["same_tokens_as_none"] for name in systems if name.startswith("moesys_"))
    assert systems["transformers_static"]["tokens"] == systems["accelerate_disk"]["tokens"] == \
        systems["transformers"]["tokens"]
    expert_layer_bytes = 3 * 128 * 256 * 2 * 4  # bf16 w1, w2, w3 of 4 experts
    assert systems["accelerate_disk"]["offload_folder_bytes"] >= 2 * expert_layer_bytes  # layers 2 and 3
    assert systems["moesys_auto"]["placement"] == ["resident", "resident", "inplace", "inplace"]
    for key in ("auto_vs_none", "auto_vs_accelerate", "ring_vs_none", "none_vs_none_forward"):
        assert r[key] > 0
    none = systems["moesys_none"]  # the static step against the forward path: alternating, in one process
    assert r["none_vs_none_forward"] == none["same_process_vs_forward"]
    assert len(none["same_process_tokens_per_s"]) == len(none["same_process_forward_tokens_per_s"]) == 5
    # the resident step and the ring's slots need nothing on the host; auto reads each streamed layer's routing once
    syncs = {mode: systems[f"moesys_{mode}"]["host_syncs_per_token"] for mode in ("none", "ring", "auto")}
    assert syncs == {"none": 0, "ring": 0, "auto": 2}
    assert 20 <= systems["moesys_none"]["ops_per_layer_token"] <= 40
    forward = systems["moesys_none_forward"]  # the baseline: a token through the prompt's forward reads the host
    assert forward["host_syncs_per_token"] >= 4 and forward["ops_per_layer_token"] > 2 * 40
    routed = 2 * 3 * 128 * 256 * 2  # top-2 experts of a layer, bf16
    auto = systems["moesys_auto"]
    assert none["device_read_bytes_per_token"] - auto["device_read_bytes_per_token"] == 2 * routed
    assert none["host_read_bytes_per_token"] == 0 < auto["host_read_bytes_per_token"]
    for name, result in systems.items():
        assert 0 < result["bandwidth_bound_tokens_per_s"] < float("inf"), name
        assert result["threads"] == r["threads"] and f"{name}@{r['threads']}" in r["bound_table"], name
    assert r["bandwidth"]["host_read_bytes_per_s"] > 0
    # the bytes a token reads, by part: 4 layers' top-2 experts, the static cache of 64 slots (2 KV heads of 32)
    assert none["token_bytes"]["routed_experts"] == 4 * routed
    assert auto["token_bytes"]["streamed_experts"] == 2 * routed and auto["host_read_bytes_per_token"] > 0
    assert none["kv_cache_bytes_per_token"] == 2 * 4 * 2 * 64 * 32 * 2
    assert auto["bound"]["streamed_path"] == "cpu_compute" and none["bound"]["streamed_path"] is None
    assert none["bound"]["binding"] == r["bound_table"][f"moesys_none@{r['threads']}"]["binding"] == "device_read"
    static = systems["transformers_static"]
    assert static["eager_tokens_per_s"] > 0 and static["compiled_tokens_per_s"] > 0
    # every thread count beside the best of transformers' two rows, each against the bandwidth at its count
    counts = sorted({1, r["threads"]})
    assert sorted(int(t) for t in r["by_threads"]) == counts == sorted(int(t) for t in r["bandwidth"]["by_threads"])
    for t, rows in r["by_threads"].items():
        assert rows["moesys_none"]["threads"] == int(t) and rows["transformers_static"]["threads"] == int(t)
        assert rows["none_vs_transformers"] > 0 and f"moesys_none@{t}" in r["bound_table"]
        assert rows["moesys_none"]["same_tokens_as_none"]


def test_the_binding_term_is_the_one_that_takes_longer():
    from runtime.bench.infer_bounds import binding_term

    assert binding_term(100, 10, 0, 0) == "device_read"  # nothing streamed
    assert binding_term(100, 10, 50, 10) == "device_read"
    assert binding_term(100, 10, 50, 1) == "streamed"
