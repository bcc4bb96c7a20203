"""Tensor names both ways: each moesys parameter (each expert of a stacked expert tensor apart) and the Hugging Face
tensor it is, in the classic layout `save_pretrained` writes (per-expert gate/up/down projections), with the
conversions between the two (ERNIE's interleaved RoPE halves, the score bias's [1, E] shape). Transformers 5's
module layout (fused experts gate_up_proj [E, 2F, D] and down_proj [E, D, F]) is read too (checkpoint.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.config import ModelConfig
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param

PROJECTIONS = ("gate_proj", "down_proj", "up_proj")
"""The Llama-style names of w1 (gate), w2 (down) and w3 (up)."""


@dataclass(frozen=True)
class TensorLayout:
    """Where a family keeps its MoE block's tensors (the rest is Llama's layout, shared by all)."""

    moe: str = "mlp"
    """The MoE block's module in the classic layout (Mixtral: block_sparse_moe)."""
    experts: tuple[str, str, str] = PROJECTIONS
    """Classic names of each expert's w1, w2 and w3."""
    shared: str | None = None
    """The shared experts' module (shared_expert, shared_experts), under the MoE block."""
    shared_gate: str | None = None
    """The shared experts' sigmoid gate's module, under the MoE block."""
    score_bias: str = "moe_statics.e_score_correction_bias"
    """The router's score bias, under the MoE block, stored [1, E]."""
    aliases: tuple[tuple[str, str], ...] = ()
    """(classic fragment, the fragment in transformers 5's module names): tried where the classic name is missing."""
    interleaved_rope: bool = False
    """RoPE rotates pairs (2i, 2i+1) (ERNIE) where moesys rotates (i, i + hd/2): query and key rows are permuted
    within each head on the way in and back on the way out, which leaves every attention score as it was."""


@dataclass(frozen=True)
class TensorName:
    """One Hugging Face tensor and the moesys parameter (or expert row of one) it is."""

    hf: str
    ours: str
    expert: int | None
    shape: tuple[int, ...]
    """The moesys shape (one expert's, for expert tensors)."""
    hf_shape: tuple[int, ...]
    rope_heads: int = 0
    """Heads whose rows are permuted between RoPE conventions (TensorLayout.interleaved_rope); 0: none."""
    head_dim: int = 0


def _rules(layout: TensorLayout) -> list[tuple[str, str]]:
    """(moesys regex, Hugging Face template) for every parameter but the experts, first match wins."""
    moe, dense = r"model.layers.\1." + layout.moe, r"model.layers.\1.mlp"
    w = {str(i + 1): proj for i, proj in enumerate(PROJECTIONS)}
    rules = [
        (r"tok_embeddings\.weight", "model.embed_tokens.weight"), (r"norm\.weight", "model.norm.weight"),
        (r"output\.weight", "lm_head.weight"),
        (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
        (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
        (r"layers\.(\d+)\.attention\.w([qkvo])\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
        (r"layers\.(\d+)\.attention\.([qk])_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
        (r"layers\.(\d+)\.ffn\.router\.gate\.weight", moe + ".gate.weight"),
        (r"layers\.(\d+)\.ffn\.router\.score_bias", f"{moe}.{layout.score_bias}"),
        (r"layers\.(\d+)\.ffn\.shared_experts\.gate\.weight", f"{moe}.{layout.shared_gate}.weight"),
    ]
    for i, proj in w.items():
        rules += [(rf"layers\.(\d+)\.ffn\.shared_experts\.w{i}\.(weight|bias)", rf"{moe}.{layout.shared}.{proj}.\2"),
                  (rf"layers\.(\d+)\.ffn\.w{i}\.(weight|bias)", rf"{dense}.{proj}.\2")]
    return rules


def _hf_name(name: str, rules: list[tuple[str, str]]) -> str:
    for pattern, template in rules:
        match = re.fullmatch(pattern, name)
        if match:
            return match.expand(template)
    raise ValueError(f"moesys parameter {name} has no Hugging Face name")


def _rope_heads(name: str, cfg: ModelConfig, layout: TensorLayout) -> int:
    """Heads of a query/key tensor whose rows follow the RoPE convention (0 for every other tensor)."""
    if not layout.interleaved_rope:
        return 0
    if re.search(r"attention\.(wq\.|q_norm)", name):
        return 1 if cfg.qk_norm == "head" else cfg.num_heads
    if re.search(r"attention\.(wk\.|k_norm)", name):
        return 1 if cfg.qk_norm == "head" else cfg.kv_heads
    return 0


def tensor_names(cfg: ModelConfig, layout: TensorLayout) -> list[TensorName]:
    """Every tensor of cfg's model in the classic layout, in the model's parameter order (each MoE layer's experts
    one after another, each expert's w1, w2, w3)."""
    with torch.device("meta"):
        params = list(Transformer(cfg).named_parameters())
    rules, out = _rules(layout), []
    expert_names = dict(zip(("w1", "w2", "w3"), layout.experts, strict=True))
    for name, p in params:
        if is_expert_param(name):
            continue
        hf_shape = (1, p.shape[0]) if name.endswith("router.score_bias") else tuple(p.shape)
        out.append(TensorName(_hf_name(name, rules), name, None, tuple(p.shape), hf_shape,
                              _rope_heads(name, cfg, layout), cfg.head_width))
    for name, p in params:  # experts last: the dense weights are what a loader needs first
        if is_expert_param(name):
            layer = re.fullmatch(r"layers\.(\d+)\.ffn\.experts\.(w[123])", name)
            if layer is None:
                raise ValueError(f"{name}: an expert parameter named otherwise than layers.N.ffn.experts.wK")
            prefix = f"model.layers.{layer[1]}.{layout.moe}.experts"
            out += [TensorName(f"{prefix}.{j}.{expert_names[layer[2]]}.weight", name, j, tuple(p.shape[1:]),
                               tuple(p.shape[1:])) for j in range(p.shape[0])]
    return out


def _rope_order(head_dim: int) -> Tensor:
    """moesys row r of a head is interleaved row order[r]: the even rows (first of each pair), then the odd ones."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def to_moesys(entry: TensorName, t: Tensor) -> Tensor:
    """A stored Hugging Face tensor as moesys holds it (the tensor itself when the layouts agree)."""
    if entry.rope_heads:
        return t.unflatten(0, (entry.rope_heads, entry.head_dim))[:, _rope_order(entry.head_dim)].flatten(0, 1)
    return t.reshape(entry.shape) if entry.hf_shape != entry.shape else t


def to_hf(entry: TensorName, t: Tensor) -> Tensor:
    """A moesys tensor as the Hugging Face layout stores it (the tensor itself when the layouts agree)."""
    if entry.rope_heads:
        back = torch.argsort(_rope_order(entry.head_dim))
        return t.unflatten(0, (entry.rope_heads, entry.head_dim))[:, back].flatten(0, 1)
    return t.reshape(entry.hf_shape) if entry.hf_shape != entry.shape else t
