"""Router auxiliary losses (ORT MoE "Loss Functions"): Switch load balancing (Switch Transformers eq. 4) per layer or
pooled over the layers (transformers' load_balancing_loss_func), router z-loss (ST-MoE eq. 5), SpeechMoE's sparsity
L1 and mean-importance losses (importance as Shazeer 2017 section 4), and the top-2 second-place ratio metric.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ExpertLoad:
    """One layer's share of the pooled load-balancing loss: what transformers' load_balancing_loss_func sums over
    layers before it normalises."""

    counts_E: Tensor
    """Top-k choices of the unbiased softmax per expert (fp32, detached): the choices the function recomputes."""
    prob_sum_E: Tensor
    """Router probabilities summed over the layer's tokens (fp32, differentiable)."""
    tokens: int


def expert_load(probs_TE: Tensor, top_k: int) -> ExpertLoad:
    """The layer's ExpertLoad from its router probabilities."""
    with torch.no_grad():
        counts_E = expert_counts(torch.topk(probs_TE, top_k, dim=-1).indices, probs_TE.shape[1]).float()
    return ExpertLoad(counts_E, probs_TE.float().sum(dim=0), probs_TE.shape[0])


def pooled_load_balancing_loss(loads: Sequence[ExpertLoad]) -> Tensor:
    """E * sum_e f_e * P_e with f_e = choices of e per token and P_e = mean probability of e, both over the tokens of
    every layer together (transformers pools all layers' router logits; 1 x top_k under uniform routing). Not the
    mean of per-layer Switch losses: a layer's imbalance can offset another's."""
    tokens = sum(load.tokens for load in loads)
    f_E = torch.stack([load.counts_E for load in loads]).sum(0) / tokens
    p_E = torch.stack([load.prob_sum_E for load in loads]).sum(0) / tokens
    return f_E.shape[0] * (f_E * p_E).sum()


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
    detached values by name. Losses with weight 0 are still reported but kept out of the graph, as is the layer's
    Switch loss when cfg.load_balancing=pooled (the model adds the pooled one: `model_aux_loss`)."""
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
        if name == "load_balancing" and cfg.load_balancing == "pooled":
            weight = 0.0
        if weight > 0:
            value = fn()
            aux = aux + weight * value
            losses[name] = value.detach()
        else:
            with torch.no_grad():
                losses[name] = fn()
    return aux, losses


def model_aux_loss(layer_losses: Sequence[Tensor], loads: Sequence[ExpertLoad], cfg: ModelConfig,
                   zero: Tensor) -> Tensor:
    """The model's aux loss: its MoE layers' weighted losses summed, plus aux_loss_weight times the pooled
    load-balancing loss of their `loads` when cfg.load_balancing=pooled. `zero`: the scalar to start from."""
    aux = sum(layer_losses, zero)
    if cfg.load_balancing == "pooled" and cfg.aux_loss_weight > 0 and loads:
        aux = aux + cfg.aux_loss_weight * pooled_load_balancing_loss(loads)
    return aux
