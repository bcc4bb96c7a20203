"""Eq. 1 of MoESys (the paper's "Hierarchical Storage"): the memory each storage tier needs for D dense and S sparse
parameters.

Per node (the paper's "device", N of them; M_GPU is all GPU memory of one node), with AdamW and fp16 compute:
    GPU: 16 D + 4 a S / L <= M_GPU N      CPU: 16 a S <= M_CPU N      SSD: 12 S <= M_SSD N
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.config import MoesysConfig, StorageConfig
from runtime.plan.modes import TierName
from runtime.plan.params import ParamCounts

GB = 1e9

DENSE_STATE_BYTES = 16
"""fp16 param + fp16 grad + fp32 master, momentum and variance: 2 + 2 + 4 + 4 + 4."""
ACTIVE_SPARSE_BYTES = 4
"""fp16 param + fp16 grad of an expert being computed."""
CACHED_SPARSE_BYTES = 16
"""All states of an expert held in the CPU cache."""
STORED_SPARSE_BYTES = 12
"""fp32 master, momentum and variance of an expert on SSD."""


@dataclass(frozen=True)
class TierRequirement:
    """One inequality of Eq. 1: the bytes a tier must hold against what the nodes give it."""

    required_bytes: int
    capacity_bytes: int
    formula: str

    @property
    def ok(self) -> bool:
        return self.required_bytes <= self.capacity_bytes

    def nodes_needed(self, nodes: int) -> int | None:
        """Smallest N for which this tier holds, given that capacity grows linearly with N; None when no N does
        (the tier has no capacity per node but something to hold)."""
        if self.required_bytes <= 0:
            return 1
        per_node = self.capacity_bytes / nodes
        return None if per_node <= 0 else max(1, math.ceil(self.required_bytes / per_node))


@dataclass(frozen=True)
class Eq1Budget:
    params: ParamCounts
    alpha: float
    layers: int
    """L: the MoE layers whose experts are offloaded (every one unless storage.resident_layers keeps some)."""
    nodes: int
    gpu: TierRequirement
    cpu: TierRequirement
    ssd: TierRequirement

    @property
    def tiers(self) -> dict[TierName, TierRequirement]:
        return {TierName.GPU: self.gpu, TierName.CPU: self.cpu, TierName.SSD: self.ssd}

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tiers.values())

    def failing(self) -> list[TierName]:
        return [name for name, t in self.tiers.items() if not t.ok]

    def unsatisfiable(self) -> list[TierName]:
        """Tiers that hold at no node count: zero capacity per node for a positive requirement."""
        return [name for name, t in self.tiers.items() if t.nodes_needed(self.nodes) is None]

    def min_nodes(self) -> int | None:
        """Fewest nodes for which every tier holds; None when some tier holds at no node count."""
        needed = [t.nodes_needed(self.nodes) for t in self.tiers.values()]
        known = [n for n in needed if n is not None]
        return None if len(known) < len(needed) else max(known)


def chosen_resident_layers(st: StorageConfig) -> int:
    """storage.resident_layers as counted: `auto` (None) is chosen by the schedule (runtime/plan/schedule.py) first."""
    if st.resident_layers is None:
        raise ValueError("storage.resident_layers=auto is counted only once the schedule has chosen it")
    return st.resident_layers


def device_memory_per_node(cfg: MoesysConfig) -> float:
    """M_GPU in bytes. Without GPUs the device tier is a budgeted pool in host RAM, so it is the node's RAM."""
    t = cfg.topology
    if t.gpus_per_node > 0:
        return t.gpus_per_node * t.gpu_memory_gb * GB
    return t.cpu_memory_gb * GB


def eq1_budget(cfg: MoesysConfig, params: ParamCounts) -> Eq1Budget:
    """Eq. 1 for this config. With storage.resident_layers (offloaded modes) the experts of those layers count with
    the dense parameters on the GPU (S_r, 16 bytes each) and S, L are the offloaded experts and layers."""
    st = cfg.storage
    a, n = st.alpha, cfg.topology.nodes
    kept = min(chosen_resident_layers(st), params.moe_layers) if st.offload in ("cpu", "ssd") else 0
    d, s_kept = params.dense, params.sparse * kept // max(params.moe_layers, 1)
    s, layers = params.sparse - s_kept, max(params.moe_layers - kept, 1)
    resident = "16(D + S_r)" if kept else "16D"
    return Eq1Budget(
        params=params, alpha=a, layers=params.moe_layers - kept, nodes=n,
        gpu=TierRequirement(int(DENSE_STATE_BYTES * (d + s_kept) + ACTIVE_SPARSE_BYTES * a * s / layers),
                            int(device_memory_per_node(cfg) * n), f"{resident} + 4aS/L <= M_GPU*N"),
        cpu=TierRequirement(int(CACHED_SPARSE_BYTES * a * s), int(cfg.topology.cpu_memory_gb * GB * n),
                            "16aS <= M_CPU*N"),
        ssd=TierRequirement(int(STORED_SPARSE_BYTES * s), int(cfg.topology.ssd_gb * GB * n), "12S <= M_SSD*N"),
    )
