"""Sort-based dispatch and combine (a pair of inverse functions, as in DeepSpeed-MoE / Tutel / torchtitan):
token->expert assignments are grouped by one stable argsort of expert ids, never a one-hot T x E x C tensor
(GShard section 2.2 computes the same dispatch with einsums over a one-hot mask).

Legend: T tokens, D model dim, E experts, K top-k, R routed rows (kept assignments), e local experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.moe.router import Routing


@dataclass(frozen=True)
class DispatchMeta:
    """What combine needs to undo dispatch: row r of x_RD is token token_idx_R[r], weighted by weights_R[r]."""

    token_idx_R: Tensor
    """Source token of each routed row (int64), rows grouped by expert, token order inside a group."""
    weights_R: Tensor
    """Combine weight of each routed row (fp32, differentiable back to the router)."""
    num_tokens: int
    """T, the number of rows combine returns."""


class LocalDispatcher:
    """Dispatch to and combine from the experts of this process.

    Extension points (the experts, router and layer never change):
    - expert parallelism: subclass, call `super().dispatch(...)` to get rows grouped by *global* expert with
      `tokens_per_expert_E`, exchange them with an AlltoAll (split sizes = per-rank sums of tokens_per_expert_E),
      permute the received rows so they are grouped by *local* expert, and return
      `(x_Re, tokens_per_expert_e, YourMeta(local=meta, ...))`; `combine` does the reverse AlltoAll and then
      `super().combine(y_RD, meta.local)`.
    - offloading: the layer calls `experts(x_RD, tokens_per_expert_e)` between dispatch and combine; experts
      with zero rows need not be fetched (seed 002), and `expert_ffn` runs on weights handed in.
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: Tensor, routing: Routing,
                 keep_TK: Tensor | None = None) -> tuple[Tensor, Tensor, DispatchMeta]:
        """Rows of x_TD grouped by expert: (x_RD, tokens_per_expert_E, meta). Dropped assignments (keep False)
        are left out."""
        return self.permute(x_TD, routing.expert_ids_TK, routing.weights_TK, keep_TK)

    def combine(self, y_RD: Tensor, meta: DispatchMeta) -> Tensor:
        """y_TD[t] = sum of weight * y over t's kept rows; a token whose assignments were all dropped gets 0."""
        return self.unpermute(y_RD, meta)

    def permute(self, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor,
                keep_TK: Tensor | None = None) -> tuple[Tensor, Tensor, DispatchMeta]:
        """The local sort: one stable argsort of the flat [T*K] expert ids (dropped ones sort last)."""
        num_tokens, top_k = expert_ids_TK.shape
        ids_N = expert_ids_TK.reshape(-1)
        if keep_TK is not None:
            ids_N = ids_N.masked_fill(~keep_TK.reshape(-1), self.num_experts)
        order_N = torch.argsort(ids_N, stable=True)
        tokens_per_expert_E = torch.bincount(ids_N, minlength=self.num_experts + 1)[: self.num_experts]
        if keep_TK is not None:
            order_N = order_N[: int(tokens_per_expert_E.sum())]
        token_idx_R = order_N // top_k if top_k > 1 else order_N
        x_RD = x_TD.index_select(0, token_idx_R)
        weights_R = weights_TK.reshape(-1).index_select(0, order_N)
        return x_RD, tokens_per_expert_E, DispatchMeta(token_idx_R, weights_R, num_tokens)

    def unpermute(self, y_RD: Tensor, meta: DispatchMeta) -> Tensor:
        """The inverse of permute: one index_add of the weighted rows."""
        weighted_RD = y_RD * meta.weights_R.to(y_RD.dtype).unsqueeze(1)
        out_TD = y_RD.new_zeros(meta.num_tokens, y_RD.shape[1])
        return out_TD.index_add(0, meta.token_idx_R, weighted_RD)
