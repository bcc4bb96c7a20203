"""A random Hugging Face Mixtral checkpoint written layer by layer (never the whole model in memory), as shards
with a model.safetensors.index.json: what the offloaded-inference tests and benchmarks serve, at any size. Every
file is written atomically; shards are numbered from 1, as Hugging Face names them."""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from runtime.files.tensorfile import save_tensors
from runtime.hf.files import INDEX
from runtime.host.io import atomic_write_json
from runtime.host.topology import usable_cpus


def write_random_mixtral(path: Path, hidden: int, ffn: int, layers: int, experts: int, vocab: int, heads: int = 8,
                         kv_heads: int | None = None, top_k: int = 2, dtype: torch.dtype = torch.bfloat16,
                         seed: int = 0, max_seq_len: int = 4096) -> int:
    """Write config.json and one shard per decoder layer (plus one for embeddings and head) in the classic
    per-expert layout; returns the bytes of tensor data written. Weights are N(0, 0.02), norms 1."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kv_heads = kv_heads or heads
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": hidden,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "num_local_experts": experts,
              "num_experts_per_tok": top_k, "max_position_embeddings": max_seq_len, "rms_norm_eps": 1e-5,
              "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu",
              "torch_dtype": str(dtype).removeprefix("torch.")}
    drawn = itertools.count()
    pool = ThreadPoolExecutor(max_workers=usable_cpus(), thread_name_prefix="moesys-random-weights")

    def rand(*shape: int) -> Future:
        """N(0, 0.02) drawn on the pool from a generator of the tensor's own (seed, draw number): the CPUs draw a
        shard's tensors at once, with the same values whatever their number."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + next(drawn))
        return pool.submit(lambda: torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=generator))

    weight_map: dict[str, str] = {}
    written = 0

    def shard(index: int, pending: dict[str, torch.Tensor | Future]) -> None:
        nonlocal written
        tensors = {k: v.result() if isinstance(v, Future) else v for k, v in pending.items()}
        name = f"model-{index:05d}-of-{layers + 1:05d}.safetensors"
        save_tensors(path / name, tensors, {"format": "pt"})  # streamed, atomic; transformers needs "format"
        weight_map.update(dict.fromkeys(tensors, name))
        written += sum(t.numel() * t.element_size() for t in tensors.values())

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=dtype)

    with pool:
        _shards(shard, rand, ones, hidden, ffn, layers, experts, vocab, heads, kv_heads)
    atomic_write_json(path / INDEX, {"metadata": {"total_size": written}, "weight_map": weight_map})
    atomic_write_json(path / "config.json", config)
    return written


def _shards(shard, rand, ones, hidden: int, ffn: int, layers: int, experts: int, vocab: int, heads: int,
            kv_heads: int) -> None:
    """The embeddings and head, then one shard per decoder layer, in Hugging Face Mixtral's names."""
    shard(1, {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
              "model.norm.weight": ones()})
    head_dim = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors = {f"{p}.input_layernorm.weight": ones(), f"{p}.post_attention_layernorm.weight": ones(),
                   f"{p}.self_attn.q_proj.weight": rand(hidden, hidden),
                   f"{p}.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                   f"{p}.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                   f"{p}.self_attn.o_proj.weight": rand(hidden, hidden),
                   f"{p}.block_sparse_moe.gate.weight": rand(experts, hidden)}
        for j in range(experts):
            e = f"{p}.block_sparse_moe.experts.{j}"
            tensors.update({f"{e}.w1.weight": rand(ffn, hidden), f"{e}.w3.weight": rand(ffn, hidden),
                            f"{e}.w2.weight": rand(hidden, ffn)})
        shard(i + 2, tensors)
