"""A decode step over independent requests at once (continuous batching): each row has its own position and
cache row, and is computed with the arithmetic of a lone decode step (`Transformer.decode` at batch 1), so its
logits, and hence its tokens, equal that request's lone run bit for bit.

A matrix product over B rows is not, in general, B products of one row: a BLAS picks other kernels (and other
summation orders) for other row counts. So every product runs as B one-row products: the dense ones in one batched
call with their weight broadcast where that gives a lone step's rows for the shape (else row by row), the experts
grouped by expert, read in place; the attention runs row by row with a lone step's very calls, and norms and
activations are per row anyway.

Legend: B rows, D model dim, L cache slots, K top-k, E experts.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.model.attention import Attention, StaticKVCache, rotate
from runtime.model.ffn import DenseFFN
from runtime.model.transformer import Block, Transformer
from runtime.moe.experts import GroupedExperts
from runtime.moe.layer import MoELayer
from runtime.moe.router import routing_weights, select_top_k


def row_linear(x_B1D: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear of each row alone, [B, 1, D] -> [B, 1, N]: the very numbers a lone step's call gives. In one
    batched call of B one-row products with the weight broadcast where that call gives them for this shape (the
    BLAS picks its kernel by shape; probed once per shape), else one call per row."""
    if _batched_is_row_wise(x_B1D.shape[0], weight, bias):
        return _batched_rows(x_B1D, weight, bias)
    return _one_by_one(x_B1D, weight, bias)


def _one_by_one(x_B1D: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return torch.cat([F.linear(x_B1D[b:b + 1], weight, bias) for b in range(x_B1D.shape[0])])


def _batched_rows(x_B1D: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    B = x_B1D.shape[0]
    weight_BDN = weight.t().expand(B, *weight.t().shape)
    if bias is None:
        return torch.bmm(x_B1D, weight_BDN)
    return torch.baddbmm(bias.expand(B, 1, bias.shape[-1]), x_B1D, weight_BDN)


_ROW_WISE: dict[tuple, bool] = {}


def _batched_is_row_wise(rows: int, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether the batched call's rows equal F.linear's one row at a time, bit for bit, for this shape, dtype and
    device: tried once on random rows (which kernel runs, and so the summation order, depends on the shape, not on
    the values)."""
    key = (rows, tuple(weight.shape), weight.dtype, weight.device, bias is not None)
    if key not in _ROW_WISE:
        x = torch.randn(rows, 1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
        _ROW_WISE[key] = torch.equal(_batched_rows(x, weight, bias), _one_by_one(x, weight, bias))
    return _ROW_WISE[key]


def _expert_linear(x_R1D: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """One expert's product of R one-row matrices at once (bmm with the weight broadcast): each row as
    `gathered_ffn`'s per-token product computes it (tests/unit/inference/test_rows.py checks it bit for bit)."""
    y = torch.bmm(x_R1D, weight.t().expand(x_R1D.shape[0], *weight.t().shape))
    return y if bias is None else y + bias


def _attention(att: Attention, x_B1D: Tensor, cache: StaticKVCache, pos_B: Tensor, rows_B: Tensor,
               rope: Optional[tuple[Tensor, Tensor]], mask_BL: Tensor, spans: list[int]) -> Tensor:
    """Attention.decode with a position per row, against rows 0..B-1 of the cache. The attention itself runs row
    by row with a lone step's shapes (row b over its first spans[b] slots, the size of its lone run's cache): the
    CPU kernel's arithmetic depends on the batch, the mask's shape and the number of slots."""
    B = x_B1D.shape[0]
    KV, hd = att.num_kv_heads, att.head_dim
    group = att.num_heads // KV
    q = row_linear(x_B1D, att.wq.weight, att.wq.bias).view(B, KV, group, hd)
    k = row_linear(x_B1D, att.wk.weight, att.wk.bias).view(B, KV, 1, hd)
    v = row_linear(x_B1D, att.wv.weight, att.wv.bias).view(B, KV, 1, hd)
    if att.rope:
        q, k = rotate(torch.cat((q, k), dim=2), *rope).split((group, 1), dim=2)
    buf_k, buf_v = cache.keys[att.layer_index], cache.values[att.layer_index]
    buf_k[rows_B, :, pos_B] = k[:, :, 0]
    buf_v[rows_B, :, pos_B] = v[:, :, 0]
    out = torch.cat([F.scaled_dot_product_attention(q[b:b + 1], buf_k[b:b + 1, :, :n], buf_v[b:b + 1, :, :n],
                                                    attn_mask=mask_BL[b:b + 1, :n]) for b, n in enumerate(spans)])
    return row_linear(out.reshape(B, 1, att.num_heads * hd), att.wo.weight, att.wo.bias)


def _dense(ffn: DenseFFN, x: Tensor) -> Tensor:
    def lin(layer, a):
        return row_linear(a, layer.weight, layer.bias)

    if ffn.swiglu:
        return lin(ffn.w2, F.silu(lin(ffn.w1, x)) * lin(ffn.w3, x))
    return lin(ffn.w2, F.gelu(lin(ffn.w1, x)))


def _grouped_ffn(x_B1D: Tensor, ids_B1K: Tensor, weights_B1K: Tensor, experts: GroupedExperts) -> Tensor:
    """`gathered_ffn`'s arithmetic, grouped by expert: each (row, choice) a one-row product with its expert's
    weights, read in place; then each row's choices combined as gathered_ffn combines them."""
    B, _, K = ids_B1K.shape
    D = experts.hidden
    w = experts.weights()
    flat_ids = ids_B1K.reshape(-1).tolist()
    by_expert: dict[int, list[int]] = {}
    for i, e in enumerate(flat_ids):
        by_expert.setdefault(e, []).append(i)
    x_RD = x_B1D.expand(B, K, D).reshape(B * K, 1, D)
    y_R1D = x_B1D.new_empty(B * K, 1, D)
    for e, rows in by_expert.items():
        idx = torch.tensor(rows, device=x_B1D.device)
        x_r = x_RD.index_select(0, idx)
        pick = lambda name: None if w[name] is None else w[name][e]  # noqa: E731
        h = _expert_linear(x_r, w["w1"][e], pick("b1"))
        if experts.expert_type == "gelu":
            h = F.gelu(h)
        else:
            h = F.silu(h) * _expert_linear(x_r, w["w3"][e], pick("b3"))
        y_R1D.index_copy_(0, idx, _expert_linear(h, w["w2"][e], pick("b2")))
    y_B1KD = y_R1D.view(B, 1, K, D)
    return torch.einsum("...kd,...k->...d", y_B1KD, weights_B1K.to(y_B1KD.dtype))


def _moe(layer: MoELayer, x_B1D: Tensor) -> Tensor:
    """MoELayer.decode per row: routing with one-row products, then the routed experts."""
    router = layer.router
    x32 = x_B1D if x_B1D.dtype == torch.float32 else x_B1D.float()
    logits = row_linear(x32, router.gate.weight.float())
    B = x_B1D.shape[0]
    logits_TE = logits.view(B, -1)
    probs_TE = torch.softmax(logits_TE, dim=-1)
    ids_TK = select_top_k(logits_TE, router.top_k)
    weights_TK = routing_weights(probs_TE, ids_TK, router.normalize_top_k)
    ids_B1K, weights_B1K = ids_TK.view(B, 1, -1), weights_TK.view(B, 1, -1)
    if isinstance(layer.experts, GroupedExperts):
        return _grouped_ffn(x_B1D, ids_B1K, weights_B1K, layer.experts)
    return layer.experts.routed(x_B1D, ids_B1K, weights_B1K)  # an offloader's stand-in: per token already


def _block(block: Block, x: Tensor, cache: StaticKVCache, pos_B: Tensor, rows_B: Tensor, rope, mask,
           spans: list[int]) -> Tensor:
    h = x + _attention(block.attention, block.attention_norm(x), cache, pos_B, rows_B, rope, mask, spans)
    normed = block.ffn_norm(h)
    return h + (_moe(block.ffn, normed) if block.is_moe else _dense(block.ffn, normed))


@torch.no_grad()
def decode_rows(model: Transformer, tokens_B: Tensor, pos_B: Tensor, cache: StaticKVCache,
                spans: Optional[list[int]] = None) -> Tensor:
    """Next-token logits [B, V] for token tokens_B[b] at position pos_B[b] of cache row b (rows 0..B-1; each row's
    earlier positions already in its cache row). spans[b]: the slots row b attends over, the capacity of the cache
    its lone run would use (default: the whole cache)."""
    B = tokens_B.shape[0]
    rows_B = torch.arange(B, device=tokens_B.device)
    spans = [cache.capacity] * B if spans is None else spans
    h = model.tok_embeddings(tokens_B[:, None])
    rope = None
    if model.pos_embeddings is not None:
        h = h + model.pos_embeddings(pos_B)[:, None]
    else:
        cos, sin = cache.rope(pos_B)
        rope = (cos[:, None, None], sin[:, None, None])
    mask = cache.mask(pos_B)
    for block in model.layers:
        h = _block(block, h, cache, pos_B, rows_B, rope, mask, spans)
    h = model.norm(h)
    out = model.output.weight if model.output is not None else model.tok_embeddings.weight
    return row_linear(h, out)[:, 0]
