"""Process groups of moesys: data, expert, expert-data, intra-node and inter-node (the paper's "MoESys Design" and
"Resource-Aware Communication").

Layout: expert-parallel groups are consecutive ranks, expert-data-parallel groups are ranks with equal
rank % ep, the data-parallel group is every rank; nodes hold nproc_per_node consecutive ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None when the world is a single process


@dataclass(frozen=True)
class RankLayout:
    """Which ranks share each group with `rank`; pure data, no torch.distributed needed."""

    world_size: int
    rank: int
    ep_size: int
    nproc_per_node: int
    ep_ranks: list[int]
    edp_ranks: list[int]
    dp_ranks: list[int]
    intra_node_ranks: list[int]
    inter_node_ranks: list[int]
    ep_inter_node_ranks: list[int]

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.nproc_per_node

    @property
    def node(self) -> int:
        return self.rank // self.nproc_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.nproc_per_node


def all_group_ranks(world_size: int, expert_parallel: int, nproc_per_node: int) -> dict[str, list[list[int]]]:
    """Every group of every kind, in the order every rank must create them."""
    check_layout(world_size, expert_parallel, nproc_per_node)
    w, ep, npn = world_size, expert_parallel, nproc_per_node
    ep_groups = [list(range(s, s + ep)) for s in range(0, w, ep)]
    edp_groups = [list(range(i, w, ep)) for i in range(ep)]
    intra = [list(range(s, s + npn)) for s in range(0, w, npn)]
    inter = [list(range(i, w, npn)) for i in range(npn)]
    # Ranks with the same local rank inside one expert-parallel group: the inter-node step of the
    # hierarchical AlltoAll over that group (equal to `inter` when ep == world_size).
    ep_inter: list[list[int]] = []
    for g in ep_groups:
        by_local: dict[int, list[int]] = {}
        for r in g:
            by_local.setdefault(r % npn, []).append(r)
        ep_inter.extend(by_local.values())
    return {"ep": ep_groups, "edp": edp_groups, "dp": [list(range(w))], "intra_node": intra,
            "inter_node": inter, "ep_inter_node": ep_inter}


def check_layout(world_size: int, expert_parallel: int, nproc_per_node: int) -> None:
    """Raise ValueError unless the sizes tile the world."""
    if world_size < 1 or expert_parallel < 1 or nproc_per_node < 1:
        raise ValueError(f"sizes must be positive (world_size={world_size}, expert_parallel={expert_parallel}, "
                         f"nproc_per_node={nproc_per_node})")
    if world_size % expert_parallel:
        raise ValueError(f"topology.expert_parallel={expert_parallel} must divide the world size {world_size}")
    if world_size % nproc_per_node:
        raise ValueError(f"topology.nproc_per_node={nproc_per_node} must divide the world size {world_size}")


def rank_layout(world_size: int, rank: int, expert_parallel: int, nproc_per_node: int) -> RankLayout:
    """The groups `rank` belongs to, as rank lists."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    groups = all_group_ranks(world_size, expert_parallel, nproc_per_node)
    mine = {kind: next(g for g in gs if rank in g) for kind, gs in groups.items()}
    return RankLayout(
        world_size=world_size, rank=rank, ep_size=expert_parallel, nproc_per_node=nproc_per_node,
        ep_ranks=mine["ep"], edp_ranks=mine["edp"], dp_ranks=mine["dp"], intra_node_ranks=mine["intra_node"],
        inter_node_ranks=mine["inter_node"], ep_inter_node_ranks=mine["ep_inter_node"])


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups and their rank lists. Groups are None in a single-process world."""

    world_size: int
    rank: int
    ep_size: int
    ep_rank: int
    ep_group: ProcessGroup
    ep_ranks: list[int]
    edp_group: ProcessGroup
    edp_ranks: list[int]
    dp_group: ProcessGroup
    dp_ranks: list[int]
    nproc_per_node: int
    node: int
    local_rank: int
    intra_node_group: ProcessGroup
    intra_node_ranks: list[int]
    inter_node_group: ProcessGroup
    inter_node_ranks: list[int]
    ep_inter_node_group: ProcessGroup
    """Ranks with this local rank inside this rank's expert-parallel group (hierarchical AlltoAll)."""
    ep_inter_node_ranks: list[int]

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.nproc_per_node

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)

    @property
    def edp_rank(self) -> int:
        return self.edp_ranks.index(self.rank)

    @property
    def dp_size(self) -> int:
        return self.world_size


def build_groups(world_size: int, rank: int, expert_parallel: int, nproc_per_node: int) -> ParallelGroups:
    """Create every process group on every rank in one fixed order; call after init_process_group.

    Groups with the same rank set share one process group. With world_size 1 no group is created.
    """
    layout = rank_layout(world_size, rank, expert_parallel, nproc_per_node)
    handles: dict[tuple[int, ...], ProcessGroup] = {}
    if world_size > 1:
        if not dist.is_initialized():
            raise RuntimeError("build_groups needs torch.distributed initialised for a world of "
                               f"{world_size} processes")
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(f"build_groups(world_size={world_size}, rank={rank}) disagrees with "
                             f"torch.distributed (world {dist.get_world_size()}, rank {dist.get_rank()})")
        handles[tuple(range(world_size))] = dist.group.WORLD
        for kind_groups in all_group_ranks(world_size, expert_parallel, nproc_per_node).values():
            for ranks in kind_groups:
                if tuple(ranks) not in handles:
                    handles[tuple(ranks)] = dist.new_group(ranks)

    def group(ranks: list[int]) -> ProcessGroup | None:
        return handles.get(tuple(ranks))

    return ParallelGroups(
        world_size=world_size, rank=rank, ep_size=expert_parallel, ep_rank=layout.ep_ranks.index(rank),
        ep_group=group(layout.ep_ranks), ep_ranks=layout.ep_ranks,
        edp_group=group(layout.edp_ranks), edp_ranks=layout.edp_ranks,
        dp_group=group(layout.dp_ranks), dp_ranks=layout.dp_ranks,
        nproc_per_node=nproc_per_node, node=layout.node, local_rank=layout.local_rank,
        intra_node_group=group(layout.intra_node_ranks), intra_node_ranks=layout.intra_node_ranks,
        inter_node_group=group(layout.inter_node_ranks), inter_node_ranks=layout.inter_node_ranks,
        ep_inter_node_group=group(layout.ep_inter_node_ranks), ep_inter_node_ranks=layout.ep_inter_node_ranks)


def group_size(group: ProcessGroup) -> int:
    """Processes in `group`; 1 for None when torch.distributed is not initialised."""
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    """This process's rank inside `group`; 0 for None when torch.distributed is not initialised."""
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)
