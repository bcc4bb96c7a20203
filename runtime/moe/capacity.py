"""Expert capacity and token dropping: GShard (Lepikhin et al. 2020, section 2.2, Algorithm 1) capacity
ceil(factor * T * K / E), Switch Transformers section 2.2 overflow, and ORT MoE's cut / random / routing_weight
drop policies (ORT MoE). Factor 0 is dropless.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from runtime.moe.router import expert_counts

DROP_POLICIES = ("cut", "random", "routing_weight")


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int | None:
    """Most assignments one expert accepts (GShard: ceil(factor * T * K / E)); None when dropless."""
    if capacity_factor <= 0:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def priority_order(expert_ids_TK: Tensor, weights_TK: Tensor, policy: str,
                   generator: torch.Generator | None = None) -> Tensor:
    """Flat assignment indices (t * K + k) sorted by expert, each expert's run in keep-first order.

    cut: token order, so the latest tokens are dropped (ORT MoE "cut the sequence tail").
    random: a random permutation drawn from `generator` (the global RNG when None).
    routing_weight: largest routing weight first (ties by token order).
    """
    ids_N = expert_ids_TK.reshape(-1)
    if policy == "cut":
        return torch.argsort(ids_N, stable=True)
    if policy == "random":
        pre_N = torch.randperm(ids_N.numel(), device=ids_N.device, generator=generator)
    elif policy == "routing_weight":
        pre_N = torch.argsort(weights_TK.detach().reshape(-1), descending=True, stable=True)
    else:
        raise ValueError(f"model.drop_policy={policy!r} is not one of {', '.join(DROP_POLICIES)}")
    return pre_N[torch.argsort(ids_N[pre_N], stable=True)]


def keep_mask(expert_ids_TK: Tensor, weights_TK: Tensor, num_experts: int, capacity: int | None,
              policy: str = "cut", generator: torch.Generator | None = None) -> Tensor:
    """Bool [T, K]: which assignments an expert accepts; each expert keeps its first `capacity` in priority
    order. All True when capacity is None (dropless)."""
    if capacity is None:
        return torch.ones_like(expert_ids_TK, dtype=torch.bool)
    order_N = priority_order(expert_ids_TK, weights_TK, policy, generator)
    ids_N = expert_ids_TK.reshape(-1)
    counts_E = expert_counts(ids_N, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_N = torch.arange(ids_N.numel(), device=ids_N.device) - starts_E[ids_N[order_N]]
    keep_N = torch.empty_like(ids_N, dtype=torch.bool)
    keep_N[order_N] = rank_N < capacity
    return keep_N.view_as(expert_ids_TK)
