"""Router auxiliary losses (ORT MoE "Loss Functions"): Switch load balancing (Switch Transformers eq. 4),
router z-loss (ST-MoE eq. 5), SpeechMoE's sparsity L1 and mean-importance losses (importance as Shazeer 2017
section 4), and the top-2 second-place ratio metric.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.config import ModelConfig
from runtime.moe.router import Routing, expert_counts

LOSS_WEIGHTS = {
    "load_balancing": "aux_loss_weight",
    "z": "z_loss_weight",
    "sparsity": "sparsity_loss_weight",
    "importance": "importance_loss_weight",
}
"""Loss name -> the ModelConfig field that weighs it in aux_loss."""


def load_balancing_loss(probs_TE: Tensor, expert_ids_TK: Tensor) -> Tensor:
    """E * sum_e f_e * P_e: f_e = share of the T*K assignments (before capacity) that go to e, P_e = mean
    router probability of e. Equals 1 under perfectly uniform routing; only P carries a gradient."""
    num_experts = probs_TE.shape[1]
    counts_E = expert_counts(expert_ids_TK, num_experts)
    f_E = counts_E.to(probs_TE.dtype) / max(expert_ids_TK.numel(), 1)
    return num_experts * (f_E * probs_TE.mean(dim=0)).sum()


def z_loss(logits_TE: Tensor) -> Tensor:
    """mean over tokens of logsumexp(logits)^2: keeps router logits small (ST-MoE)."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def sparsity_l1_loss(probs_TE: Tensor, eps: float = 1e-12) -> Tensor:
    """SpeechMoE: mean over tokens of || p / ||p||_2 ||_1 (the L1 norm of softmax itself is always 1).
    Ranges from 1 (one-hot) to sqrt(E) (uniform)."""
    unit_TE = probs_TE / probs_TE.norm(dim=-1, keepdim=True).clamp_min(eps)
    return unit_TE.abs().sum(dim=-1).mean()


def importance_loss(probs_TE: Tensor, eps: float = 1e-12) -> Tensor:
    """CV(importance)^2 with importance_e = sum over tokens of p_e (population variance / mean^2)."""
    importance_E = probs_TE.sum(dim=0)
    return importance_E.var(correction=0) / importance_E.mean().square().clamp_min(eps)


def second_place_ratio(weights_TK: Tensor) -> Tensor:
    """Mean over tokens of weight(2nd choice) / weight(1st choice); NaN when K < 2."""
    if weights_TK.shape[1] < 2:
        return weights_TK.new_full((), float("nan"))
    return (weights_TK[:, 1] / weights_TK[:, 0]).mean()


def router_losses(routing: Routing, cfg: ModelConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """(aux_loss, losses): aux_loss is the config-weighted, differentiable sum; losses are the unweighted,
    detached values by name. Losses with weight 0 are still reported but kept out of the graph."""
    if routing.num_tokens == 0:
        zero = routing.logits_TE.sum()
        return zero, {name: zero.detach() for name in LOSS_WEIGHTS}
    fns = {
        "load_balancing": lambda: load_balancing_loss(routing.probs_TE, routing.expert_ids_TK),
        "z": lambda: z_loss(routing.logits_TE),
        "sparsity": lambda: sparsity_l1_loss(routing.probs_TE),
        "importance": lambda: importance_loss(routing.probs_TE),
    }
    aux = routing.logits_TE.new_zeros(())
    losses: dict[str, Tensor] = {}
    for name, fn in fns.items():
        weight = getattr(cfg, LOSS_WEIGHTS[name])
        if weight > 0:
            value = fn()
            aux = aux + weight * value
            losses[name] = value.detach()
        else:
            with torch.no_grad():
                losses[name] = fn()
    return aux, losses
