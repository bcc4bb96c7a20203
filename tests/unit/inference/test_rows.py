"""decode_rows: a batch of rows at different positions gives each row exactly the logits of its own lone decode
step (Transformer.decode at batch 1, over a cache of its own size), for both model families, grouped-query
attention, dense layers, experts grouped across rows and the parts of released families (q/k norms, shared
experts, a router score bias), in fp32 (one-row products batched) and bf16 (one product over all rows, where the
CPU's kernel is batch-invariant)."""

import pytest
import torch

from runtime.config import ModelConfig
from runtime.inference.decode import CACHE_BUCKET, DecodeStep
from runtime.inference.rows import decode_rows
from runtime.model.transformer import Transformer

GPT = dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=256, ffn_hidden_size=128, num_experts=4, top_k=2,
           max_seq_len=128, position="learned", norm="layernorm", bias=True, tie_embeddings=True, expert_type="gelu")
MIXTRAL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=256, ffn_hidden_size=128,
               num_experts=4, top_k=2, max_seq_len=128, position="rope", norm="rmsnorm", bias=False,
               tie_embeddings=False, expert_type="swiglu", moe_layer_freq=2)
PARTS = dict(MIXTRAL, moe_layer_freq=1, moe_layers=[1], qk_norm="head", head_dim=32, attention_bias="qkv",
             dense_ffn_hidden_size=96, shared_expert_hidden_size=80, shared_expert_gate=True, router_score_bias=True)


def _lone(model, prompt, token):
    """The logits of `token` after `prompt`, as `generate` computes them: prefill, then one decode step."""
    step = DecodeStep(model)
    cache = step.cache_for(1, CACHE_BUCKET)
    step.prefill(torch.tensor([prompt]), cache)
    return step(torch.tensor([[token]]), torch.tensor([len(prompt)]), cache)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", [GPT, MIXTRAL, PARTS], ids=["gpt", "mixtral-gqa-dense", "qk-norm-shared-bias"])
@torch.no_grad()
def test_each_row_is_its_lone_decode_step_bit_for_bit(family, dtype):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**family)).eval().to(dtype)
    for layer in model.moe_layers():  # a score bias that moves some choices
        if layer.router.score_bias is not None:
            layer.router.score_bias.normal_(0, 0.1)
    prompts = [[(7 * i + j) % 256 for j in range(1 + 5 * i)] for i in range(6)]
    tokens = [11 * i + 3 for i in range(6)]
    cache = model.new_static_cache(len(prompts), 128)
    for row, prompt in enumerate(prompts):
        alone = model.new_static_cache(1, CACHE_BUCKET)
        model(torch.tensor([prompt]), alone, 0)
        for mine, its in zip(cache.keys + cache.values, alone.keys + alone.values):
            mine[row, :, :len(prompt)] = its[0, :, :len(prompt)]
    # each row over the 64 slots of its lone cache; the batch's cache is larger
    logits = decode_rows(model, torch.tensor(tokens), torch.tensor([len(p) for p in prompts]), cache, [64] * 6)
    for row, (prompt, token) in enumerate(zip(prompts, tokens)):
        assert torch.equal(logits[row], _lone(model, prompt, token))
