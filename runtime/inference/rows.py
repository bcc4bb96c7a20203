"""A decode step over independent requests at once (continuous batching): each row has its own position and
cache row, and is computed with the arithmetic of a lone decode step (`Transformer.decode` at batch 1), so its
logits, and hence its tokens, equal that request's lone run bit for bit.

A matrix product over B rows is not, in general, B products of one row: a BLAS picks other kernels (and other
summation orders) for other row counts. So every product runs in the cheapest form found to give a lone step's rows
for its shape (`row_linear`): one product over all rows where the kernel is batch-invariant, else B one-row
products in one batched call, else row by row; the experts grouped by expert, read in place. The attention runs
the rows of one span in one call where that gives lone calls' bits, else row by row with a lone step's very calls;
norms and activations are per row anyway.

Legend: B rows, D model dim, L cache slots, K top-k, E experts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.inference.cpu_bandwidth import decode_kernels
from runtime.model.attention import Attention, StaticKVCache, rotate
from runtime.model.ffn import DenseFFN
from runtime.model.transformer import Block, Transformer
from runtime.moe.experts import GroupedExperts, RoutedExperts
from runtime.moe.grouped_mm_op import grouped_mm_in_place
from runtime.moe.layer import MoELayer
from runtime.moe.routed import combine_choices, sort_by_expert, sorted_ffn
from runtime.moe.shared import SharedExperts


def row_linear(x_B1D: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear of each row alone, [B, 1, D] -> [B, 1, N]: the very numbers a lone step's call gives, in the
    cheapest form that gives them for this shape, dtype and device (`_form`)."""
    return _form(x_B1D.shape[0], weight, bias)(x_B1D, weight, bias)


def _one_product(x_B1D: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x_B1D, weight, bias)


def _batched_rows(x_B1D: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    B = x_B1D.shape[0]
    weight_BDN = weight.t().expand(B, *weight.t().shape)
    if bias is None:
        return torch.bmm(x_B1D, weight_BDN)
    return torch.baddbmm(bias.expand(B, 1, bias.shape[-1]), x_B1D, weight_BDN)


def _one_by_one(x_B1D: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.cat([F.linear(x_B1D[b:b + 1], weight, bias) for b in range(x_B1D.shape[0])])


def _kernels() -> bool:
    """Which kernels products take now (oneDNN on or off, `decode_kernels`): part of every probe's key."""
    return torch._C._get_mkldnn_enabled()


FORMS = (_one_product, _batched_rows, _one_by_one)
"""Cheapest first: one product over all rows reads the weight once (a GEMM; its rows are lone rows where the
kernel is batch-invariant, as oneDNN's bf16 GEMM is on CPU); one batched call of B one-row products reads it B
times; one call per row is the lone step itself."""
_FORM: dict[tuple, Callable] = {}


def _form(rows: int, weight: Tensor, bias: Tensor | None) -> Callable:
    """The first of FORMS whose rows equal F.linear's one row at a time, bit for bit, for this shape, dtype and
    device: tried once on random rows (which kernel runs, and so the summation order, depends on the shape, not on
    the values)."""
    key = (rows, tuple(weight.shape), weight.dtype, weight.device, bias is not None, _kernels())
    if key not in _FORM:
        x = torch.randn(rows, 1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
        lone = _one_by_one(x, weight, bias)
        _FORM[key] = next(form for form in FORMS if torch.equal(form(x, weight, bias), lone))
    return _FORM[key]


def _expert_linear(x_R1D: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """One expert's product of R one-row matrices: each row as `gathered_ffn`'s per-token product computes it (a
    one-row product, then the bias; tests/unit/inference/test_rows.py checks it bit for bit)."""
    y = row_linear(x_R1D, weight)
    return y if bias is None else y + bias


def _attention(att: Attention, x_B1D: Tensor, cache: StaticKVCache, pos_B: Tensor, rows_B: Tensor,
               rope: tuple[Tensor, Tensor] | None, mask_BL: Tensor, spans: list[int]) -> Tensor:
    """Attention.decode with a position per row, against rows 0..B-1 of the cache. Row b attends over its first
    spans[b] slots, the size of its lone run's cache: rows of one span in one call where that gives lone calls'
    bits (probed per shape: the CPU kernel's fp32 arithmetic depends on the batch and the mask's shape, its
    bf16 arithmetic does not), else row by row with a lone step's shapes."""
    B = x_B1D.shape[0]
    KV, hd = att.num_kv_heads, att.head_dim
    group = att.num_heads // KV
    q, k = att.norm_qk(row_linear(x_B1D, att.wq.weight, att.wq.bias), row_linear(x_B1D, att.wk.weight, att.wk.bias))
    q, k = q.view(B, KV, group, hd), k.view(B, KV, 1, hd)
    v = row_linear(x_B1D, att.wv.weight, att.wv.bias).view(B, KV, 1, hd)
    if att.rope:
        assert rope is not None, "rotary attention decodes with its rope tables"
        q, k = rotate(torch.cat((q, k), dim=2), *rope).split((group, 1), dim=2)
    buf_k, buf_v = cache.keys[att.layer_index], cache.values[att.layer_index]
    buf_k[rows_B, :, pos_B] = k[:, :, 0]
    buf_v[rows_B, :, pos_B] = v[:, :, 0]
    out = q.new_empty(q.shape)
    by_span: dict[int, list[int]] = {}
    for b, n in enumerate(spans):
        by_span.setdefault(n, []).append(b)
    for n, rows in by_span.items():
        if len(rows) > 1 and _attention_is_row_wise(len(rows), q.shape[1:], n, q.dtype, q.device):
            idx = torch.tensor(rows, device=q.device)
            out.index_copy_(0, idx, F.scaled_dot_product_attention(
                q.index_select(0, idx), buf_k[:, :, :n].index_select(0, idx), buf_v[:, :, :n].index_select(0, idx),
                attn_mask=mask_BL[:, :n].index_select(0, idx)[:, None, None]))
        else:
            for b in rows:
                out[b:b + 1] = _lone_attention(q[b:b + 1], buf_k[b:b + 1, :, :n], buf_v[b:b + 1, :, :n],
                                               mask_BL[b:b + 1, :n])
    return row_linear(out.reshape(B, 1, att.num_heads * hd), att.wo.weight, att.wo.bias)


def _lone_attention(q_1KGH: Tensor, k_1KLH: Tensor, v_1KLH: Tensor, mask_1L: Tensor) -> Tensor:
    """A lone decode step's attention call, with its shapes."""
    return F.scaled_dot_product_attention(q_1KGH, k_1KLH, v_1KLH, attn_mask=mask_1L)


_ATTENTION: dict[tuple, bool] = {}


def _attention_is_row_wise(rows: int, q_shape: torch.Size, slots: int, dtype: torch.dtype,
                           device: torch.device) -> bool:
    """Whether one attention call over `rows` rows (a [rows, 1, 1, slots] mask) gives each row a lone call's
    bits, for these shapes, dtype and device: tried once on random rows."""
    key = (rows, tuple(q_shape), slots, dtype, device, _kernels())
    if key not in _ATTENTION:
        gen = torch.Generator().manual_seed(0)
        KV, _, hd = q_shape
        q = torch.randn(rows, *q_shape, generator=gen).to(device, dtype)
        k, v = (torch.randn(rows, KV, slots, hd, generator=gen).to(device, dtype) for _ in range(2))
        mask = torch.arange(slots)[None] <= torch.randint(0, slots, (rows, 1), generator=gen)
        mask = mask.to(device)
        lone = torch.cat([_lone_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1]) for b in range(rows)])
        _ATTENTION[key] = torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None]), lone)
    return _ATTENTION[key]


def _dense(ffn: DenseFFN, x: Tensor) -> Tensor:
    def lin(layer, a):
        return row_linear(a, layer.weight, layer.bias)

    if ffn.swiglu:
        return lin(ffn.w2, F.silu(lin(ffn.w1, x)) * lin(ffn.w3, x))
    return lin(ffn.w2, F.gelu(lin(ffn.w1, x)))


def _grouped_ffn(x_B1D: Tensor, ids_B1K: Tensor, weights_B1K: Tensor, experts: GroupedExperts) -> Tensor:
    """`gathered_ffn`'s arithmetic, grouped by expert: each (row, choice) a one-row product with its expert's
    weights, read in place; then each row's choices combined as gathered_ffn combines them. All rows in one grouped
    GEMM per projection where its groups' rows are one-row products' (`_grouped_is_row_wise`), else expert by
    expert."""
    B, _, K = ids_B1K.shape
    w = experts.weights()
    w1, w2 = w["w1"], w["w2"]
    assert w1 is not None and w2 is not None, "every expert kind has w1 and w2"
    if grouped_mm_in_place(w1, w2, w["w3"]) and _grouped_is_row_wise(B * K, w1, w2):
        y_RD = _all_grouped(x_B1D.view(B, -1), ids_B1K.reshape(-1), K, w, experts.expert_type)
    else:
        y_RD = _expert_by_expert(x_B1D.view(B, -1), ids_B1K.reshape(-1), K, w, experts.expert_type)
    return combine_choices(y_RD.view(B, 1, K, -1), weights_B1K)


def _all_grouped(x_BD: Tensor, ids_R: Tensor, K: int, w: dict, kind: str) -> Tensor:
    """y_RD for the R = B*K (row, choice) pairs: pairs sorted by expert, one grouped GEMM per projection."""
    sorted_ids, order_R, offs_e = sort_by_expert(ids_R, w["w1"].shape[0])
    y_sorted = sorted_ffn(x_BD.index_select(0, order_R // K), sorted_ids, offs_e, **w, kind=kind)
    return torch.empty_like(y_sorted).index_copy_(0, order_R, y_sorted)


def _row(t: Tensor | None, e: int) -> Tensor | None:
    return None if t is None else t[e]


def _expert_by_expert(x_BD: Tensor, ids_R: Tensor, K: int, w: dict, kind: str) -> Tensor:
    """y_RD for the R = B*K (row, choice) pairs, expert by expert, each expert's rows in `row_linear`'s form."""
    by_expert: dict[int, list[int]] = {}
    for i, e in enumerate(ids_R.tolist()):
        by_expert.setdefault(e, []).append(i)
    y_RD = x_BD.new_empty(ids_R.shape[0], x_BD.shape[1])
    for e, pairs in by_expert.items():
        idx = torch.tensor(pairs, device=x_BD.device)
        x_r = x_BD.index_select(0, idx // K)[:, None]
        h = _expert_linear(x_r, w["w1"][e], _row(w["b1"], e))
        h = F.gelu(h) if kind == "gelu" else F.silu(h) * _expert_linear(x_r, w["w3"][e], _row(w["b3"], e))
        y_RD.index_copy_(0, idx, _expert_linear(h, w["w2"][e], _row(w["b2"], e))[:, 0])
    return y_RD


_GROUPED: dict[tuple, bool] = {}


def _grouped_is_row_wise(rows: int, w1: Tensor, w2: Tensor) -> bool:
    """Whether `_all_grouped` gives each pair a one-row product's bits for up to `rows` pairs, for weights the
    grouped GEMM takes (`grouped_mm_in_place`): one product over m rows gives one-row products for every
    m <= rows (`_form`), and the grouped GEMM gives each group a product's numbers (probed once on random rows in
    uneven groups)."""
    key = (rows, tuple(w1.shape), tuple(w2.shape), w1.dtype, w1.device, _kernels())
    if key not in _GROUPED:
        ok = all(_form(m, t[0], None) is _one_product for m in range(1, rows + 1) for t in (w1, w2))
        if ok:
            E = w1.shape[0]
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(0, max(1, E // 2), (rows,), generator=gen).to(w1.device)  # uneven, some empty
            x = torch.randn(rows, w1.shape[2], generator=gen).to(w1)
            _, _, offs = sort_by_expert(ids, E)
            got = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            bounds = [0] + offs.tolist()
            ok = all(torch.equal(got[a:b], F.linear(x[a:b], w1[e])) for e, (a, b) in
                     enumerate(itertools.pairwise(bounds)) if b > a)
        _GROUPED[key] = ok
    return _GROUPED[key]


def _moe(layer: MoELayer, x_B1D: Tensor) -> Tensor:
    """MoELayer.decode per row: routing with one-row products, then the routed experts."""
    router = layer.router
    x32 = x_B1D if x_B1D.dtype == torch.float32 else x_B1D.float()
    logits = row_linear(x32, router.gate.weight.float())
    B = x_B1D.shape[0]
    logits_TE = logits.view(B, -1)
    probs_TE = torch.softmax(logits_TE, dim=-1)
    ids_TK, weights_TK = router.choose(logits_TE, probs_TE)
    ids_B1K, weights_B1K = ids_TK.view(B, 1, -1), weights_TK.view(B, 1, -1)
    if isinstance(layer.experts, GroupedExperts):
        y = _grouped_ffn(x_B1D, ids_B1K, weights_B1K, layer.experts)
    else:
        stand_in = cast(RoutedExperts, layer.experts)  # an offloader's stand-in: per token already
        y = stand_in.routed(x_B1D, ids_B1K, weights_B1K)
    return y if layer.shared_experts is None else y + _shared(layer.shared_experts, x_B1D)


def _shared(shared: SharedExperts, x_B1D: Tensor) -> Tensor:
    """SharedExperts.forward per row: its FFN as `_dense`, times the per-row gate when it has one."""
    y = _dense(shared, x_B1D)
    return y if shared.gate is None else torch.sigmoid(row_linear(x_B1D, shared.gate.weight)) * y


def _block(block: Block, x: Tensor, cache: StaticKVCache, pos_B: Tensor, rows_B: Tensor, rope, mask,
           spans: list[int]) -> Tensor:
    h = x + _attention(block.attention, block.attention_norm(x), cache, pos_B, rows_B, rope, mask, spans)
    normed = block.ffn_norm(h)
    return h + (_moe(block.ffn, normed) if isinstance(block.ffn, MoELayer) else _dense(block.ffn, normed))


@torch.no_grad()
def decode_rows(model: Transformer, tokens_B: Tensor, pos_B: Tensor, cache: StaticKVCache,
                spans: list[int] | None = None) -> Tensor:
    """Next-token logits [B, V] for token tokens_B[b] at position pos_B[b] of cache row b (rows 0..B-1; each row's
    earlier positions already in its cache row). spans[b]: the slots row b attends over, the capacity of the cache
    its lone run would use (default: the whole cache)."""
    with decode_kernels(tokens_B.device):
        return _decode_rows(model, tokens_B, pos_B, cache, spans)


def _decode_rows(model: Transformer, tokens_B: Tensor, pos_B: Tensor, cache: StaticKVCache,
                 spans: list[int] | None) -> Tensor:
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
        h = _block(cast(Block, block), h, cache, pos_B, rows_B, rope, mask, spans)
    h = model.norm(h)
    out = model.output.weight if model.output is not None else model.tok_embeddings.weight
    return row_linear(h, out)[:, 0]
