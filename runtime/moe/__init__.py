"""The MoE layer: router, capacity, sort-based dispatch/combine, merged experts, aux losses, gate metrics."""

from runtime.moe.capacity import expert_capacity, keep_mask
from runtime.moe.dispatch import DispatchMeta, LocalDispatcher
from runtime.moe.experts import GroupedExperts, expert_ffn, reference_moe_forward
from runtime.moe.layer import MoELayer, MoEStats, expert_parameters, is_expert_param
from runtime.moe.router import Router, Routing

__all__ = [
    "DispatchMeta", "GroupedExperts", "LocalDispatcher", "MoELayer", "MoEStats", "Router", "Routing",
    "expert_capacity", "expert_ffn", "expert_parameters", "is_expert_param", "keep_mask",
    "reference_moe_forward",
]
