"""The MoE layer: router -> capacity -> dispatch -> experts -> combine, plus the shared experts beside them, aux
losses and gate metrics (GShard section 2.2; Switch Transformers section 2; the production feature list of ORT MoE).

Legend: T tokens, D model dim, E experts, e local experts, K top-k, R routed rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, nn

from runtime.config import ModelConfig
from runtime.moe.capacity import expert_capacity, keep_mask
from runtime.moe.dispatch import LocalDispatcher
from runtime.moe.experts import Experts, GroupedExperts, RoutedExperts
from runtime.moe.losses import ExpertLoad, expert_load, router_losses
from runtime.moe.metrics import gate_metrics
from runtime.moe.router import Router
from runtime.moe.shared import shared_experts

EXPERT_PARAM_NAMES = ("w1", "w2", "w3", "b1", "b2", "b3")


@dataclass(frozen=True)
class MoEStats:
    """What one MoE layer reports besides its output."""

    aux_loss: Tensor
    """Config-weighted sum of the router losses: a differentiable scalar to add to the training loss."""
    losses: dict[str, Tensor] = field(default_factory=dict)
    """Unweighted, detached router losses by name (load_balancing, z, sparsity, importance)."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Detached gate metrics by name (see runtime.moe.metrics.gate_metrics)."""
    load: ExpertLoad | None = None
    """The layer's part of the pooled load-balancing loss (model.load_balancing=pooled), else None."""


class MoELayer(nn.Module):
    """A drop-in FFN replacement: x [..., D] -> (y [..., D], MoEStats); y is the routed experts' combined output plus
    the shared experts' (cfg.shared_expert_hidden_size), which see every token where they are.

    num_local_experts: experts held by this process (default: all E); fewer needs an expert-parallel
    dispatcher that returns rows for those experts only.
    """

    def __init__(self, cfg: ModelConfig, num_local_experts: int | None = None, dispatcher=None):
        super().__init__()
        if cfg.num_experts <= 0:
            raise ValueError(f"model.num_experts must be positive for an MoE layer (got {cfg.num_experts})")
        local = cfg.num_experts if num_local_experts is None else num_local_experts
        if dispatcher is None and local != cfg.num_experts:
            raise ValueError(f"num_local_experts={local} != model.num_experts={cfg.num_experts} needs an "
                             "expert-parallel dispatcher")
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts: Experts = GroupedExperts(local, cfg.hidden_size, cfg.ffn_size, cfg.expert_type, cfg.bias)
        self.dispatcher = LocalDispatcher(cfg.num_experts) if dispatcher is None else dispatcher
        self.shared_experts = shared_experts(cfg)

    def forward(self, x: Tensor, generator: torch.Generator | None = None,
                stats: bool = True) -> tuple[Tensor, MoEStats | None]:
        """generator seeds the router noise and the random drop policy (global RNG when None). stats=False skips
        the router losses and gate metrics (None), which a prompt's forward at inference does not use."""
        cfg = self.cfg
        x_TD = x.reshape(-1, x.shape[-1])
        routing = self.router(x_TD, generator)
        capacity = expert_capacity(x_TD.shape[0], cfg.num_experts, cfg.top_k, cfg.capacity_factor)
        keep_TK = None
        if capacity is not None:
            keep_TK = keep_mask(routing.expert_ids_TK, routing.weights_TK, cfg.num_experts, capacity,
                                cfg.drop_policy, generator)
        x_RD, tokens_per_expert, meta = self.dispatcher.dispatch(x_TD, routing, keep_TK)
        y_RD = self.experts(x_RD, tokens_per_expert)
        y_TD = self.dispatcher.combine(y_RD, meta)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        if not stats:
            return y_TD.view(x.shape), None
        aux_loss, losses = router_losses(routing, cfg)
        load = expert_load(routing.probs_TE, cfg.top_k) if cfg.load_balancing == "pooled" else None
        return y_TD.view(x.shape), MoEStats(aux_loss, losses, gate_metrics(routing, keep_TK), load)

    def decode(self, x: Tensor) -> Tensor:
        """x [..., D] -> y [..., D] for a few tokens at inference (a decode step): the routed experts computed by
        `experts.routed` (a RoutedExperts), no sort, no host read, no losses or metrics. The same outputs as
        forward up to float rounding, as long as no assignment can be dropped: with a capacity below the token
        count it is forward's."""
        cfg = self.cfg
        tokens = x.numel() // x.shape[-1]
        capacity = expert_capacity(tokens, cfg.num_experts, cfg.top_k, cfg.capacity_factor)
        if self.training or (capacity is not None and capacity < tokens):
            return self.forward(x)[0]
        routing = self.router(x)
        y = cast(RoutedExperts, self.experts).routed(x, routing.expert_ids_TK, routing.weights_TK)
        return y if self.shared_experts is None else y + self.shared_experts(x)


def is_expert_param(name: str) -> bool:
    """True for a parameter name (from named_parameters) of a GroupedExperts module held as `experts`."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in EXPERT_PARAM_NAMES


def expert_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) for every parameter that belongs to a GroupedExperts inside module."""
    for mod_name, mod in module.named_modules():
        if isinstance(mod, GroupedExperts):
            for name, param in mod.named_parameters(recurse=False):
                yield (f"{mod_name}.{name}" if mod_name else name), param
