"""Decoder-only transformer for both families (GPT: learned positions, LayerNorm, gelu, tied head; Mixtral: RoPE,
RMSNorm, SwiGLU, GQA), with MoE blocks where cfg.is_moe_layer says (the paper's "Experiment"; Mixtral of Experts)
and the parts released families add, each chosen by the config (q/k norms, shared experts, a router score bias)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig
from runtime.model import cpu_gemv
from runtime.model.attention import Attention, StaticKVCache, rope_cos_sin, segment_mask
from runtime.model.ffn import DenseFFN
from runtime.model.init import draw_seed, init_parameters
from runtime.model.norms import build_norm
from runtime.moe.layer import MoELayer
from runtime.moe.losses import model_aux_loss


@dataclass
class ModelOutput:
    """logits [B, S, V]; aux_loss: weighted MoE losses summed over MoE layers (scalar); moe_stats: one per MoE layer."""

    logits: torch.Tensor
    aux_loss: torch.Tensor
    moe_stats: list[Any] = field(default_factory=list)


class Block(nn.Module):
    """Pre-norm block: x + attention(attention_norm(x)), then h + ffn(ffn_norm(h)); ffn is DenseFFN or MoELayer."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.is_moe = cfg.is_moe_layer(index)
        self.attention_norm = build_norm(cfg)
        self.attention = Attention(cfg, index)
        self.ffn_norm = build_norm(cfg)
        self.ffn = MoELayer(cfg) if self.is_moe else DenseFFN(cfg)

    def forward(self, x, rope=None, cache: StaticKVCache | None = None, start_pos: int = 0, moe_stats: bool = True,
                mask: torch.Tensor | None = None):
        """x [B, S, D] -> (y [B, S, D], MoEStats or None); mask: the attention's (Attention.forward)."""
        h = x + self.attention(self.attention_norm(x), rope, cache, start_pos, mask)
        if self.is_moe:
            y, stats = self.ffn(self.ffn_norm(h), stats=moe_stats)
            return h + y, stats
        return h + self.ffn(self.ffn_norm(h)), None

    def decode(self, x, rope, cache: StaticKVCache, pos_1: torch.Tensor, mask_1L: torch.Tensor):
        """forward for one new position per row against a static cache (Transformer.decode); x [B, 1, D]."""
        h = x + self.attention.decode(self.attention_norm(x), rope, cache, pos_1, mask_1L)
        normed = self.ffn_norm(h)
        return h + (self.ffn.decode(normed) if isinstance(self.ffn, MoELayer) else self.ffn(normed))


class Transformer(nn.Module):
    """tokens [B, S] -> ModelOutput; one code path for every ModelConfig, single device."""

    def __init__(self, cfg: ModelConfig, seed: int | None = None):
        """Built under `torch.device("meta")` nothing is allocated or initialized: the caller materializes what
        this rank holds (runtime/train/build.py)."""
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embeddings = (
            nn.Embedding(cfg.max_seq_len, cfg.hidden_size) if cfg.position == "learned" else None
        )
        if cfg.position not in ("learned", "rope"):
            raise ValueError(f"model.position={cfg.position!r} is not one of learned, rope")
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = build_norm(cfg)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if not self.tok_embeddings.weight.is_meta:
            self.reset_parameters(seed)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers in block order (their dispatcher or experts can be swapped from outside)."""
        return [block.ffn for block in self.layers if isinstance(block.ffn, MoELayer)]

    def new_static_cache(self, batch: int, capacity: int) -> StaticKVCache:
        """A zeroed static KV cache of `capacity` positions for `batch` rows, in this model's dtype and device."""
        weight = self.tok_embeddings.weight
        theta = self.cfg.rope_theta if self.pos_embeddings is None else None
        return StaticKVCache(len(self.layers), batch, self.cfg.kv_heads, capacity, self.cfg.head_width, weight.dtype,
                             weight.device, rope_theta=theta)

    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2 style init (runtime/model/init.py), each tensor and each expert from its own (seed, name, expert)
        generator; without a seed, one is drawn from torch's global RNG."""
        init_parameters(self, draw_seed() if seed is None else seed)

    def forward(self, tokens: torch.Tensor, cache: StaticKVCache | None = None, start_pos: int = 0,
                moe_stats: bool = True, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> ModelOutput:
        """tokens [B, S] at positions start_pos..start_pos+S-1 (start_pos > 0 needs the cache of the prefix).
        moe_stats=False leaves the MoE layers' losses and metrics out (aux_loss 0, moe_stats empty).
        Rows of packed samples (training, no cache): positions [B, S] restart in each sample and segments [B, S]
        number the samples, which attention does not cross."""
        B, S = tokens.shape
        end = start_pos + S if positions is None else int(positions.max()) + 1
        if end > self.cfg.max_seq_len:
            raise ValueError(f"positions up to {end} exceed model.max_seq_len={self.cfg.max_seq_len}")
        if start_pos and cache is None:
            raise ValueError("start_pos > 0 needs the KV cache of the earlier positions")
        if positions is None:
            positions = torch.arange(start_pos, end, device=tokens.device)
        h = self.tok_embeddings(tokens)
        rope = None
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions)
        else:
            cos, sin = rope_cos_sin(positions, self.cfg.head_width, self.cfg.rope_theta)
            rope = (cos, sin) if positions.dim() == 1 else (cos[:, None], sin[:, None])  # [B, 1, S, hd]: per row
        mask = segment_mask(segments) if segments is not None else None
        stats = []
        for block in self.layers:
            h, layer_stats = block(h, rope, cache, start_pos, moe_stats, mask)
            if layer_stats is not None:
                stats.append(layer_stats)
        h = self.norm(h)
        logits = self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)
        aux = model_aux_loss([s.aux_loss for s in stats], [s.load for s in stats if s.load is not None], self.cfg,
                             h.new_zeros(()))
        return ModelOutput(logits=logits, aux_loss=aux, moe_stats=stats)

    def prefill(self, tokens_BS: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """A prompt's forward into an empty cache -> the last position's next-token logits [B, V]; no MoE losses
        or metrics (inference has no use for them)."""
        return self(tokens_BS, cache, 0, moe_stats=False).logits[:, -1]

    def decode(self, tokens_B1: torch.Tensor, pos_1: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """The decode step: tokens [B, 1] at position pos_1 (a one-element device tensor, below the cache's
        capacity; the prefix is in `cache`) -> next-token logits [B, V]. Static shapes, no host read, MoE layers
        through `MoELayer.decode`: the step `torch.compile` captures whole. With a position per row instead (pos_B
        of B entries: continuous batching), row b is at pos_B[b] of cache row b."""
        h = self.tokens_at(tokens_B1, pos_1)
        rope = None if self.pos_embeddings is not None else cache.rope(pos_1)
        mask_1L = cache.mask(pos_1)
        if pos_1.numel() > 1:  # one position per row: broadcast over heads (and query rows) per row
            rope = None if rope is None else (rope[0][:, None, None], rope[1][:, None, None])
            mask_1L = mask_1L[:, None, None]
        for block in self.layers:
            h = cast(Block, block).decode(h, rope, cache, pos_1, mask_1L)
        h = self.norm(h)[:, 0]
        head = self.output.weight if self.output is not None else self.tok_embeddings.weight
        return cpu_gemv.linear(h, head, None if self.output is None else self.output.bias)

    def tokens_at(self, tokens_B1: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, 1, D] of tokens at positions `pos` (one for every row, or one per row), with the learned
        position embedding where the model has one."""
        h = self.tok_embeddings(tokens_B1)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(pos).view(pos.numel(), 1, -1)
        return h
