"""The transformer: parameter names and shapes, causality, KV-cache decoding, forward + backward, init."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig
from runtime.model.transformer import ModelOutput, Transformer
from tests.references import KVCache

GPT = dict(hidden_size=32, num_layers=2, num_heads=4, vocab_size=64, ffn_hidden_size=48, num_experts=4, top_k=2,
           max_seq_len=32)
MIXTRAL = dict(GPT, num_kv_heads=2, position="rope", norm="rmsnorm", expert_type="swiglu", bias=False,
               tie_embeddings=False, rope_theta=1e4)

CONFIGS = {
    "gpt": ModelConfig(**GPT),
    "mixtral_gqa": ModelConfig(**MIXTRAL),
    "swiglu_rms_nobias_untied_learned": ModelConfig(**dict(GPT, norm="rmsnorm", expert_type="swiglu", bias=False,
                                                           tie_embeddings=False)),
    "moe_every_2nd": ModelConfig(**dict(GPT, num_layers=4, moe_layer_freq=2)),
    "mixtral_moe_every_2nd_bias": ModelConfig(**dict(MIXTRAL, num_layers=4, moe_layer_freq=2, bias=True)),
    "dense_only": ModelConfig(**dict(MIXTRAL, num_experts=0)),
}


def expected_params(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The parameter set the parameter counter assumes, written out from the spec."""
    D, V, F, E, H, KV, hd = (cfg.hidden_size, cfg.vocab_size, cfg.ffn_size, cfg.num_experts, cfg.num_heads,
                             cfg.kv_heads, cfg.head_width)
    swiglu = cfg.expert_type == "swiglu"
    out = {"tok_embeddings.weight": (V, D)}
    if cfg.position == "learned":
        out["pos_embeddings.weight"] = (cfg.max_seq_len, D)

    def norm(prefix):
        out[f"{prefix}.weight"] = (D,)
        if cfg.norm == "layernorm" and cfg.bias:
            out[f"{prefix}.bias"] = (D,)

    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        norm(f"{p}.attention_norm")
        norm(f"{p}.ffn_norm")
        for name, rows in (("wq", H * hd), ("wk", KV * hd), ("wv", KV * hd)):
            out[f"{p}.attention.{name}.weight"] = (rows, D)
            if cfg.bias:
                out[f"{p}.attention.{name}.bias"] = (rows,)
        out[f"{p}.attention.wo.weight"] = (D, H * hd)
        if cfg.bias:
            out[f"{p}.attention.wo.bias"] = (D,)
        if cfg.is_moe_layer(i):
            out[f"{p}.ffn.router.gate.weight"] = (E, D)
            out[f"{p}.ffn.experts.w1"] = (E, F, D)
            out[f"{p}.ffn.experts.w2"] = (E, D, F)
            if swiglu:
                out[f"{p}.ffn.experts.w3"] = (E, F, D)
            if cfg.bias:
                out[f"{p}.ffn.experts.b1"] = (E, F)
                out[f"{p}.ffn.experts.b2"] = (E, D)
                if swiglu:
                    out[f"{p}.ffn.experts.b3"] = (E, F)
        else:
            out[f"{p}.ffn.w1.weight"] = (F, D)
            out[f"{p}.ffn.w2.weight"] = (D, F)
            if swiglu:
                out[f"{p}.ffn.w3.weight"] = (F, D)
            if cfg.bias:
                out[f"{p}.ffn.w1.bias"] = (F,)
                out[f"{p}.ffn.w2.bias"] = (D,)
                if swiglu:
                    out[f"{p}.ffn.w3.bias"] = (F,)
    norm("norm")
    if not cfg.tie_embeddings:
        out["output.weight"] = (V, D)
    return out


def build(name: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CONFIGS[name]).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_names_and_shapes_match_the_spec(name):
    model = build(name)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert got == expected_params(CONFIGS[name])
    assert len(model.moe_layers()) == CONFIGS[name].num_moe_layers
    assert model.blocks is model.layers


@pytest.mark.parametrize("name", ["gpt", "mixtral_gqa", "mixtral_moe_every_2nd_bias", "dense_only"])
def test_static_decode_step_equals_full_forward(name):
    """Transformer.decode (position a tensor, the static cache's whole buffers under a mask, experts gathered by
    index) gives the full forward's logits at every position, after a prefill into the same static cache."""
    model = build(name)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(tokens).logits
        cache = model.new_static_cache(batch=2, capacity=16)
        steps = [model(tokens[:, :5], cache=cache).logits[:, -1]]
        steps += [model.decode(tokens[:, t:t + 1], torch.tensor([t]), cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt", "mixtral_moe_every_2nd_bias"])
def test_prefill_is_the_forward_without_moe_stats(name):
    """Transformer.prefill fills the cache and gives the forward's last logits bit for bit, with no MoE losses or
    metrics computed (forward with moe_stats=False: aux_loss 0, no stats)."""
    model = build(name)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache_a, cache_b = model.new_static_cache(2, 16), model.new_static_cache(2, 16)
        full = model(tokens, cache_a, 0)
        lean = model(tokens, cache_b, 0, moe_stats=False)
        assert torch.equal(model.prefill(tokens, model.new_static_cache(2, 16)), full.logits[:, -1])
    assert torch.equal(lean.logits, full.logits) and all(torch.equal(a, b) for a, b in zip(cache_a.keys, cache_b.keys))
    assert full.moe_stats and not lean.moe_stats and float(lean.aux_loss) == 0.0


@pytest.mark.parametrize("name", ["gpt", "mixtral_gqa", "moe_every_2nd"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(name):
    model = build(name)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens).logits, model(changed).logits
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["gpt", "mixtral_gqa", "mixtral_moe_every_2nd_bias"])
def test_incremental_kv_cache_decoding_equals_full_forward(name):
    model = build(name)
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens).logits
        cache = KVCache(len(model.layers))
        pieces = [model(tokens[:, :4], cache=cache).logits]           # prefill
        pieces.append(model(tokens[:, 4:7], cache=cache, start_pos=4).logits)  # chunk after a prefix
        for t in range(7, 10):                                           # one token at a time
            pieces.append(model(tokens[:, t:t + 1], cache=cache, start_pos=t).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_preallocated_cache_matches_growing_cache():
    model = build("mixtral_gqa")
    tokens = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    outs = []
    with torch.no_grad():
        for cache in (KVCache(len(model.layers)), KVCache(len(model.layers), max_len=32)):
            model(tokens[:, :1], cache=cache)
            outs.append(torch.cat([model(tokens[:, t:t + 1], cache=cache, start_pos=t).logits
                                   for t in range(1, 6)], dim=1))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt", "mixtral_gqa", "moe_every_2nd"])
def test_forward_and_backward_reach_every_dense_parameter(name):
    model = build(name).train()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(4))
    out = model(tokens)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (4, 16, 64)
    assert out.aux_loss.dim() == 0 and len(out.moe_stats) == CONFIGS[name].num_moe_layers
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1))
    (loss + out.aux_loss).backward()
    assert torch.isfinite(loss)
    for n, p in model.named_parameters():
        if ".experts." not in n:  # an expert that received no token legitimately has no gradient
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
    gate = [p for n, p in model.named_parameters() if n.endswith("router.gate.weight")]
    assert all(g.grad.abs().sum() > 0 for g in gate)


def test_initialisation_is_deterministic_and_gpt2_style():
    a, b = build("gpt", seed=7), build("gpt", seed=7)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    sd = dict(a.named_parameters())
    assert abs(sd["tok_embeddings.weight"].std().item() - 0.02) < 2e-3
    assert abs(sd["layers.0.attention.wq.weight"].std().item() - 0.02) < 3e-3
    assert torch.count_nonzero(sd["layers.0.attention.wq.bias"]) == 0
    assert torch.equal(sd["layers.1.ffn_norm.weight"], torch.ones(32))
    assert torch.count_nonzero(sd["norm.bias"]) == 0
    assert abs(sd["layers.0.ffn.experts.w2"].std().item() - 0.02) < 2e-3
    assert abs(sd["layers.1.ffn.router.gate.weight"].std().item() - 0.02) < 6e-3
    assert torch.count_nonzero(sd["layers.0.ffn.experts.b1"]) == 0
    assert not torch.equal(build("gpt", seed=8).tok_embeddings.weight, sd["tok_embeddings.weight"])


def test_tied_head_uses_the_embedding_and_positions_beyond_max_seq_len_are_refused():
    model = build("gpt")
    tokens = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        model.tok_embeddings.weight[3].zero_()
        assert torch.all(model(tokens).logits[..., 3] == 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))
