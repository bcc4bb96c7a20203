"""Per-layer gate metrics for logging (ORT MoE "Gate Metrics"): entropy, chosen-expert
probability, routed fraction, per-expert assignment shares before and after capacity. All detached.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.moe.losses import second_place_ratio
from runtime.moe.router import Routing, expert_counts


@torch.no_grad()
def gate_metrics(routing: Routing, keep_TK: Tensor | None = None) -> dict[str, Tensor]:
    """gate_entropy: mean over tokens of -sum_e p log p.
    gate_probability: mean router probability of the chosen experts (over all T*K assignments).
    gate_routed: share of the T*K assignments kept by capacity (1 when dropless).
    expert_fraction [E]: share of the T*K assignments per expert before capacity (sums to 1).
    expert_routed_fraction [E]: share of the T*K assignments per expert after capacity (sums to gate_routed).
    second_place_ratio: mean weight(2nd) / weight(1st), NaN for top-1.
    """
    ids_TK, probs_TE = routing.expert_ids_TK, routing.probs_TE.detach()
    num_experts, total = routing.num_experts, max(ids_TK.numel(), 1)
    log_probs_TE = torch.log_softmax(routing.logits_TE.detach(), dim=-1)
    entropy = -(probs_TE * log_probs_TE).sum(dim=-1).mean()
    chosen = probs_TE.gather(1, ids_TK).mean()
    before_E = expert_counts(ids_TK, num_experts).float() / total
    if keep_TK is None:
        after_E, routed = before_E.clone(), probs_TE.new_ones(())
    else:
        after_E = expert_counts(ids_TK[keep_TK], num_experts).float() / total
        routed = keep_TK.float().sum() / total
    return {
        "gate_entropy": entropy,
        "gate_probability": chosen,
        "gate_routed": routed,
        "expert_fraction": before_E,
        "expert_routed_fraction": after_E,
        "second_place_ratio": second_place_ratio(routing.weights_TK.detach()),
    }
