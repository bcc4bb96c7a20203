"""The dense path captured as static graphs, one set per (batch, sequence) bucket (after the paper's "Graph
Optimization", figure 3, where the dense part of an exported model is converted to a static graph and the sparse
part stays dynamic). The tests capture a model, and an exported checkpoint, with it to check that the dense path
is capturable by `torch.export` and gives the eager logits; `moesys infer` and `moesys serve` run the eager model
and the static decode step instead (runtime/inference/decode.py), so it is not part of runtime/.

For each (batch, sequence) bucket, `torch.export` captures, with the shapes fixed:
- the embedding (token, plus learned positions for GPT-style models),
- per block, attention with its pre-norm and residual, and the FFN's pre-norm (one graph returning both),
- per dense block, the dense FFN with its residual,
- the final norm and the output head.
What stays eager: each MoE layer (routing, top-k, expert dispatch and the grouped expert GEMMs), whose row counts
per expert depend on the data, and the KV cache (captured graphs run whole sequences, as in prefill or scoring).
A sequence whose shape is not a bucket runs the eager model. Outputs equal the eager model's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.model.attention import rope_cos_sin
from runtime.model.transformer import Block, Transformer


class _Embedding(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.tok, self.pos = model.tok_embeddings, model.pos_embeddings

    def forward(self, tokens_BS: Tensor) -> Tensor:
        h = self.tok(tokens_BS)
        if self.pos is not None:
            h = h + self.pos(torch.arange(tokens_BS.shape[1], device=tokens_BS.device))
        return h


class _AttentionPart(nn.Module):
    """h = x + attention(norm(x)); also the FFN's input ffn_norm(h)."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, x: Tensor, cos: Optional[Tensor], sin: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        rope = None if cos is None else (cos, sin)
        h = x + self.block.attention(self.block.attention_norm(x), rope, None, 0)
        return h, self.block.ffn_norm(h)


class _DenseFFNPart(nn.Module):
    def __init__(self, block: Block):
        super().__init__()
        self.ffn = block.ffn

    def forward(self, h: Tensor, normed: Tensor) -> Tensor:
        return h + self.ffn(normed)


class _Head(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.norm, self.output, self.tok = model.norm, model.output, model.tok_embeddings

    def forward(self, h: Tensor) -> Tensor:
        h = self.norm(h)
        return self.output(h) if self.output is not None else F.linear(h, self.tok.weight)


class _Captured:
    """The exported graphs of one bucket."""

    def __init__(self, model: Transformer, batch: int, seq: int):
        device = model.tok_embeddings.weight.device
        dtype = model.tok_embeddings.weight.dtype
        cfg = model.cfg
        tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
        x = torch.zeros(batch, seq, cfg.hidden_size, dtype=dtype, device=device)
        self.rope = None if model.pos_embeddings is not None else rope_cos_sin(
            torch.arange(seq, device=device), cfg.head_width, cfg.rope_theta)
        cos, sin = self.rope if self.rope is not None else (None, None)
        self.embedding = _export(_Embedding(model), (tokens,))
        self.attention = [_export(_AttentionPart(b), (x, cos, sin)) for b in model.layers]
        # two distinct example tensors: one passed twice would be captured as one aliased input
        self.dense_ffn = [None if b.is_moe else _export(_DenseFFNPart(b), (x, x.clone())) for b in model.layers]
        self.head = _export(_Head(model), (x,))


def _export(module: nn.Module, args: tuple) -> nn.Module:
    with torch.no_grad():
        return torch.export.export(module.eval(), args, strict=False).module()


class StaticDenseModel:
    """A model whose dense path runs as captured graphs for the given (batch, sequence) buckets; logits [B, S, V]."""

    def __init__(self, model: Transformer, buckets: list[tuple[int, int]]):
        if model.training:
            raise ValueError("capture a model in eval mode (dropout and router noise are training-only)")
        self.model = model
        self.graphs = {(b, s): _Captured(model, b, s) for b, s in buckets}

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return list(self.graphs)

    @torch.no_grad()
    def __call__(self, tokens_BS: Tensor) -> Tensor:
        graphs = self.graphs.get(tuple(tokens_BS.shape))
        if graphs is None:  # not a bucket: the eager model
            return self.model(tokens_BS).logits
        cos, sin = graphs.rope if graphs.rope is not None else (None, None)
        h = graphs.embedding(tokens_BS)
        for block, attention, dense_ffn in zip(self.model.layers, graphs.attention, graphs.dense_ffn):
            h, normed = attention(h, cos, sin)
            if dense_ffn is not None:
                h = dense_ffn(h, normed)
            else:
                y, _ = block.ffn(normed)  # MoE: routing and expert dispatch stay eager
                h = h + y
        return graphs.head(h)
