"""Ring-memory offloading against resident inference: identical tokens and logits, byte budgets, the ring's
schedule and recovery, and the expert store."""

import copy

import pytest
import torch

from runtime.config import ModelConfig
from runtime.inference.generate import generate
from runtime.inference.errors import InferError
from runtime.inference.expert_source import ExpertSource
from runtime.inference.offload import LayerStore
from runtime.inference.offloaders import make_offloader
from runtime.inference.ring import RingOffloader
from runtime.model.transformer import Transformer

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5], [3, 1]]

GPT = ModelConfig(hidden_size=32, num_layers=3, num_heads=4, vocab_size=64, ffn_hidden_size=64, num_experts=4,
                  top_k=2, max_seq_len=32)
MIXTRAL = ModelConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=64, ffn_hidden_size=48,
                      num_experts=4, top_k=2, expert_type="swiglu", norm="rmsnorm", bias=False, position="rope",
                      tie_embeddings=False, max_seq_len=32, moe_layer_freq=2)


def _model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # larger router weights than the init so different experts win per token
        for layer in model.moe_layers():
            layer.router.gate.weight.normal_(0, 1.0)
    return model


def _run(base, mode, slots=2, tmp_path=None, **kw):
    model = copy.deepcopy(base)
    off = make_offloader(model, mode, CPU, slots, cache_dir=tmp_path / f"{mode}{slots}" if tmp_path else None)
    try:
        gen = generate(model, PROMPTS, 6, offloader=off, keep_logits=True, **kw)
        return gen, off.stats()
    finally:
        off.close()


@pytest.mark.parametrize("cfg", [GPT, MIXTRAL], ids=["gpt-gelu", "mixtral-swiglu-freq2"])
def test_ring_and_ondemand_match_resident_for_every_k(cfg, tmp_path):
    base = _model(cfg)
    ref, ref_stats = _run(base, "none")
    n = cfg.num_moe_layers
    runs = [("ondemand", 1)] + [("ring", k) for k in range(1, n + 1)]
    for mode, k in runs:
        gen, stats = _run(base, mode, k, tmp_path)
        assert gen.tokens == ref.tokens, (mode, k)
        for a, b in zip(gen.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert stats["expert_device_bytes"] * n == ref_stats["expert_device_bytes"] * (k if mode == "ring" else 1)
        assert stats["expert_host_bytes"] == ref_stats["expert_device_bytes"]
    # the batch grouped by length gave tokens that differ across prompts (a non-degenerate comparison)
    assert len({tuple(t) for t in ref.tokens}) > 1


def test_sampling_matches_too(tmp_path):
    base = _model(GPT, seed=3)
    ref, _ = _run(base, "none", temperature=0.9, top_k=8, seed=11)
    gen, _ = _run(base, "ring", 2, tmp_path, temperature=0.9, top_k=8, seed=11)
    assert gen.tokens == ref.tokens


def test_ring_copies_one_layer_per_use_and_none_when_k_equals_n(tmp_path):
    base = _model(GPT)
    n = GPT.num_moe_layers
    forwards = 6  # one prompt length group of 6 new tokens ... plus the other group
    groups = len({len(p) for p in PROMPTS})
    _, full = _run(base, "ring", n, tmp_path)
    assert full["copies"] == n  # primed once, then every layer keeps its slot
    _, ring = _run(base, "ring", 2, tmp_path)
    uses = n * forwards * groups
    assert ring["copies"] == 2 + uses  # primed 2 slots, then one prefetch after each use
    _, ondemand = _run(base, "ondemand", 1, tmp_path)
    assert ondemand["copies"] == uses
    assert ondemand["copy_hidden_share"] == 0.0  # synchronous copies hide nothing
    assert 0.0 <= ring["copy_hidden_share"] <= 1.0


def test_bad_ring_sizes_are_one_line_errors():
    base = _model(GPT)
    for k in (0, GPT.num_moe_layers + 1):
        with pytest.raises(InferError, match=r"infer.ring_slots=.* between 1 and the model's 3 MoE layers") as exc:
            make_offloader(copy.deepcopy(base), "ring", CPU, k)
        assert "\n" not in str(exc.value)
    dense = Transformer(ModelConfig(hidden_size=16, num_layers=2, num_heads=2, num_experts=0, max_seq_len=16))
    with pytest.raises(InferError, match="no MoE layers"):
        make_offloader(dense, "ring", CPU, 1)
    with pytest.raises(InferError, match="not one of"):
        make_offloader(copy.deepcopy(base), "lazy", CPU, 1)


def test_ring_recovers_after_a_forward_fails_half_way(tmp_path):
    base = _model(GPT)
    ref, _ = _run(base, "none")
    model = copy.deepcopy(base)
    off = make_offloader(model, "ring", CPU, 2, cache_dir=tmp_path)
    assert isinstance(off, RingOffloader)

    def boom(module, args):
        raise KeyboardInterrupt

    hook = model.layers[2].register_forward_pre_hook(boom)
    with pytest.raises(KeyboardInterrupt):
        model(torch.tensor([PROMPTS[0]]))
    hook.remove()
    assert off.use % GPT.num_moe_layers != 0  # the ring stopped after two of three layers
    gen = generate(model, PROMPTS, 6, offloader=off)
    off.close()
    assert gen.tokens == ref.tokens


def test_expert_store_is_memory_mapped_and_reused(tmp_path):
    base = _model(GPT)
    layers = [layer.experts for layer in base.moe_layers()]
    LayerStore.export(ExpertSource.from_model(base), tmp_path, fingerprint="v1")
    mtime = (tmp_path / "layer0.safetensors").stat().st_mtime_ns
    LayerStore.export(ExpertSource.from_model(base), tmp_path, fingerprint="v1")
    assert (tmp_path / "layer0.safetensors").stat().st_mtime_ns == mtime  # same fingerprint: not rewritten
    store = LayerStore(tmp_path, len(layers))
    assert store.host_bytes == sum(p.numel() * 4 for e in layers for p in e.parameters())
    for m, experts in enumerate(layers):
        views = store.views(store.regions[m])
        for name, weight in experts.weights().items():
            if weight is not None:
                assert torch.equal(views[name], weight.detach())
    with open(tmp_path / "layer1.safetensors", "rb") as f:  # the region reads the file's bytes, not a copy
        data = f.read()
    assert bytes(store.regions[1][:16].tolist()) in data
