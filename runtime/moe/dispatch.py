"""Sort-based dispatch and combine (a pair of inverse functions, as in DeepSpeed-MoE / Tutel / torchtitan):
token->expert assignments are grouped by one stable argsort of expert ids, never a one-hot T x E x C tensor
(GShard section 2.2 computes the same dispatch with einsums over a one-hot mask).

Legend: T tokens, D model dim, E experts, K top-k, R routed rows (kept assignments), e local experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.moe.router import Routing, expert_counts


@dataclass(frozen=True)
class DispatchMeta:
    """What combine needs to undo dispatch. Assignment n = t * K + k is token t's k-th choice."""

    token_idx_R: Tensor
    """Source token of each routed row (int64), rows grouped by expert, token order inside a group."""
    slot_of_row_R: Tensor
    """Assignment n of each routed row (the kept prefix of the stable argsort)."""
    row_of_slot_TK: Tensor
    """Routed row of each assignment; 0 (any valid row) for a dropped one, whose weight is 0."""
    weights_TK: Tensor
    """Combine weights (differentiable back to the router), zero where dropped."""
    dropless: bool
    """Every assignment was kept, so each token has exactly K rows."""

    @property
    def num_tokens(self) -> int:
        return self.weights_TK.shape[0]


class _GatherRows(torch.autograd.Function):
    """out = src[index] whose backward is a gather too: row s of src was copied to the rows inverse_SN[s]
    (exactly N of them; or fewer, with the others' gradient known to be 0). Gathers parallelise where the
    scatter-add of index_select's own backward does not; embedding_bag gathers and sums in one pass."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor, inverse_SN: Tensor) -> Tensor:
        ctx.save_for_backward(inverse_SN)
        return src.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        (inverse_SN,) = ctx.saved_tensors
        return F.embedding_bag(inverse_SN, grad, mode="sum"), None, None


class _WeightedSumRows(torch.autograd.Function):
    """out_TD[t] = sum_k weights_TK[t, k] * rows_RD[row_TK[t, k]]: the combine, one embedding_bag pass instead of
    a gather into [T, K, D] and a batched [1, K] x [K, D] product. Backward: row r of rows came from token
    token_R[r] (assignment slot_R[r]), so its gradient is a gather scaled by its weight, and each weight's
    gradient a row dot product; assignments with no row (dropped) get 0."""

    @staticmethod
    def forward(ctx, rows_RD: Tensor, weights_TK: Tensor, row_TK: Tensor, token_R: Tensor, slot_R: Tensor) -> Tensor:
        ctx.save_for_backward(rows_RD, weights_TK, token_R, slot_R)
        with torch.autocast(rows_RD.device.type, enabled=False):  # in the rows' dtype, as the experts computed
            return F.embedding_bag(row_TK, rows_RD, mode="sum", per_sample_weights=weights_TK)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_TD: Tensor):
        rows_RD, weights_TK, token_R, slot_R = ctx.saved_tensors
        grad_RD = grad_TD.index_select(0, token_R)
        grad_w_TK = None
        if ctx.needs_input_grad[1]:
            grad_w_N = weights_TK.new_zeros(weights_TK.numel())
            grad_w_N[slot_R] = torch.linalg.vecdot(grad_RD, rows_RD)
            grad_w_TK = grad_w_N.view_as(weights_TK)
        grad_RD.mul_(weights_TK.reshape(-1)[slot_R].unsqueeze(1))
        return grad_RD, grad_w_TK, None, None, None


class LocalDispatcher:
    """Dispatch to and combine from the experts of this process.

    Extension points (the experts, router and layer never change):
    - expert parallelism: subclass, call `super().dispatch(...)` to get rows grouped by *global* expert with
      `tokens_per_expert_E`, exchange them with an AlltoAll (split sizes = per-rank sums of tokens_per_expert_E),
      permute the received rows so they are grouped by *local* expert, and return
      `(x_Re, tokens_per_expert_e, YourMeta(local=meta, ...))`; `combine` does the reverse AlltoAll and then
      `super().combine(y_RD, meta.local)`.
    - offloading: the layer calls `experts(x_RD, tokens_per_expert_e)` between dispatch and combine; experts
      with zero rows need not be fetched (the ZeRO-3 offloading thesis), and `expert_ffn` runs on weights handed in.
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: Tensor, routing: Routing,
                 keep_TK: Tensor | None = None) -> tuple[Tensor, Tensor, Any]:
        """Rows of x_TD grouped by expert: (x_RD, tokens_per_expert_E, meta). Dropped assignments (keep False)
        are left out. meta is opaque to the layer, which hands it back to `combine`: a DispatchMeta here, a
        subclass's own type there."""
        return self.permute(x_TD, routing.expert_ids_TK, routing.weights_TK, keep_TK)

    def combine(self, y_RD: Tensor, meta: Any) -> Tensor:
        """y_TD[t] = sum of weight * y over t's kept rows; a token whose assignments were all dropped gets 0."""
        return self.unpermute(y_RD, meta)

    def permute(self, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor,
                keep_TK: Tensor | None = None) -> tuple[Tensor, Tensor, DispatchMeta]:
        """The local sort: one stable argsort of the flat [T*K] expert ids (dropped ones sort last)."""
        num_tokens, top_k = expert_ids_TK.shape
        ids_N = expert_ids_TK.reshape(-1)
        dropless = keep_TK is None or bool(keep_TK.all())
        if keep_TK is not None and not dropless:
            ids_N = ids_N.masked_fill(~keep_TK.reshape(-1), self.num_experts)
            weights_TK = weights_TK * keep_TK
        order_N = torch.argsort(ids_N, stable=True)
        tokens_per_expert_E = expert_counts(ids_N, self.num_experts + 1)[: self.num_experts]
        rows = ids_N.numel() if dropless else int(tokens_per_expert_E.sum())
        row_of_slot_N = torch.empty_like(order_N)
        row_of_slot_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
        slot_of_row_R = order_N[:rows]
        token_idx_R = slot_of_row_R // top_k if top_k > 1 else slot_of_row_R
        if dropless and not torch.compiler.is_compiling():  # compiled: the plain gather, which it differentiates
            x_RD = _GatherRows.apply(x_TD, token_idx_R, row_of_slot_N.view(num_tokens, top_k))
        else:
            x_RD = x_TD.index_select(0, token_idx_R)
            if not dropless:
                row_of_slot_N = row_of_slot_N.masked_fill(row_of_slot_N >= rows, 0)
        meta = DispatchMeta(token_idx_R, slot_of_row_R, row_of_slot_N.view(num_tokens, top_k), weights_TK,
                            dropless)
        return x_RD, tokens_per_expert_E, meta

    def unpermute(self, y_RD: Tensor, meta: DispatchMeta) -> Tensor:
        """The inverse of permute: each token's weighted sum of its K rows."""
        if y_RD.shape[0] == 0:
            return y_RD.new_zeros(meta.num_tokens, y_RD.shape[1])
        if torch.compiler.is_compiling():  # the plain gather and weighted sum, which it differentiates and fuses
            y_TKD = y_RD.index_select(0, meta.row_of_slot_TK.reshape(-1)).view(*meta.row_of_slot_TK.shape, -1)
            return (y_TKD * meta.weights_TK.to(y_RD.dtype).unsqueeze(-1)).sum(1)
        return _WeightedSumRows.apply(y_RD, meta.weights_TK.to(y_RD.dtype), meta.row_of_slot_TK, meta.token_idx_R,
                                      meta.slot_of_row_R)
