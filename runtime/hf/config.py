"""config.json <-> the model section: the keys every Llama-style MoE family shares (width, heads, RoPE, norms,
vocabulary, the router loss), read as the Hub writes them and as transformers saves them, and written as transformers
reads them; what moesys cannot run (another activation, RoPE scaling, sliding windows) is refused in one line."""

from __future__ import annotations

from typing import Any

import torch

from runtime.config import ModelConfig
from runtime.hf.files import HFCheckpointError

_MISSING = object()
CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""Keys of the source's config.json an export writes back as they were (the tokenizer's special ids)."""


def pick(hf: dict, names: tuple[str, ...], source: str, default: Any = _MISSING) -> Any:
    """The value of the first of `names` that config.json sets (not null): the Hub's name and the ones transformers
    saves under (its config class's attribute_map); `default` when none is set, else an error naming the first."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if default is _MISSING:
        raise HFCheckpointError(f"{source}: missing key {names[0]!r}")
    return default


def refuse(source: str, key: str, value: Any, why: str) -> HFCheckpointError:
    return HFCheckpointError(f"{source}: {key}={value!r} is not supported ({why})")


def read_common(hf: dict, source: str, defaults: dict) -> dict:
    """ModelConfig fields from the keys every family shares; `defaults`: the family's config class defaults of
    rope_theta, rms_norm_eps, max_position_embeddings, tie_word_embeddings and router_aux_loss_coef."""
    hidden = pick(hf, ("hidden_size",), source)
    heads = pick(hf, ("num_attention_heads",), source)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(source, "hidden_act", act, "moesys's experts are SwiGLU: silu only")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise refuse(source, "rope_type", rope_type, "only default RoPE")
    head_dim = hf.get("head_dim")
    if head_dim is not None and hidden % heads == 0 and head_dim == hidden // heads:
        head_dim = None  # the width moesys derives anyway
    coef = pick(hf, ("router_aux_loss_coef",), source, defaults["router_aux_loss_coef"])
    return dict(
        hidden_size=hidden, num_layers=pick(hf, ("num_hidden_layers",), source), num_heads=heads,
        num_kv_heads=pick(hf, ("num_key_value_heads",), source, heads), head_dim=head_dim,
        vocab_size=pick(hf, ("vocab_size",), source), expert_type="swiglu", norm="rmsnorm",
        norm_eps=float(pick(hf, ("rms_norm_eps",), source, defaults["rms_norm_eps"])), bias=False, position="rope",
        rope_theta=float(rope.get("rope_theta", pick(hf, ("rope_theta",), source, defaults["rope_theta"]))),
        max_seq_len=pick(hf, ("max_position_embeddings",), source, defaults["max_position_embeddings"]),
        tie_embeddings=bool(pick(hf, ("tie_word_embeddings",), source, defaults["tie_word_embeddings"])),
        capacity_factor=0.0, load_balancing="pooled",
        # transformers adds coef x its pooled loss only when output_router_logits is on
        aux_loss_weight=float(coef) if hf.get("output_router_logits") else 0.0,
    )


def write_common(cfg: ModelConfig, model_type: str, architecture: str, default_coef: float, dtype: torch.dtype,
                 source: dict | None = None) -> dict:
    """The config.json keys every family shares; `source`: the config.json the model was read from, whose
    CARRIED_KEYS are written back."""
    theta = cfg.rope_theta
    out = {
        "architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_width, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": theta, "rope_parameters": {"rope_theta": theta,
                                                                              "rope_type": "default"},
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "output_router_logits": cfg.aux_loss_weight > 0,
        "router_aux_loss_coef": cfg.aux_loss_weight if cfg.aux_loss_weight > 0 else default_coef,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    for key in CARRIED_KEYS:
        if source and key in source:
            out[key] = source[key]
    return out


def moe_layers_of(num_layers: int, is_moe) -> list[int] | None:
    """model.moe_layers for a family's rule `is_moe(i)`: None when every block is an MoE block."""
    layers = [i for i in range(num_layers) if is_moe(i)]
    return None if len(layers) == num_layers else layers
