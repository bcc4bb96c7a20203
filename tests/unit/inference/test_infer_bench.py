"""`moesys bench infer` at a tiny shape: every system (transformers, transformers + accelerate's disk offload,
moesys none/auto/ring) decodes the same greedy tokens, accelerate really offloaded the streamed layers' experts to
its folder, and the ratios the issue targets are reported. No timing is asserted."""

import pytest

from runtime.bench.infer import run_infer_bench

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")

TINY = {"hidden": 128, "ffn": 256, "layers": 4, "experts": 4, "vocab": 512, "heads": 4}


def test_every_system_decodes_the_same_tokens_and_accelerate_offloads_to_disk():
    r = run_infer_bench(ring_slots=2, shape=TINY, new_tokens=6, repeats=1, capped=False, isolate=False)
    systems = r["systems"]
    assert set(systems) == {"transformers", "accelerate_disk", "moesys_none", "moesys_auto", "moesys_ring"}
    for name, result in systems.items():
        assert "error" not in result, (name, result)
        assert result["same_tokens_as_none"] and len(result["tokens"]) == 6, name
        assert result["decode_tokens_per_s"] > 0 and result["disk_read_bytes_per_token"] >= 0
    expert_layer_bytes = 3 * 128 * 256 * 2 * 4  # bf16 w1, w2, w3 of 4 experts
    assert systems["accelerate_disk"]["offload_folder_bytes"] >= 2 * expert_layer_bytes  # layers 2 and 3
    assert systems["moesys_auto"]["placement"] == ["resident", "resident", "inplace", "inplace"]
    for key in ("auto_vs_none", "auto_vs_accelerate", "ring_vs_none"):
        assert r[key] > 0
