"""Variable-length AlltoAll of token rows, flat and hierarchical (the paper's "Resource-Aware Communication", Fig. 8),
with autograd.

Rows of x_RD are ordered by destination rank; the result is ordered by source rank. Every rank of the group
must call, also with zero rows to send or receive: the collectives run even when empty, so nothing hangs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from runtime.parallel.groups import ParallelGroups, ProcessGroup, group_size

Counts = Sequence[int] | torch.Tensor
AllToAll = Callable[..., "tuple[torch.Tensor, list[int]]"]
"""(x_RD, send_counts, recv_counts=None) -> (rows received, recv_counts): recv_counts when the caller knows them
(then no count exchange and no host read)."""


class _AllToAllRows(torch.autograd.Function):
    """Rows out by send_counts, rows in by recv_counts; backward is the reverse exchange of gradients."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: ProcessGroup):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        return _exchange(x_RD, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        grad_in = _exchange(grad_RD, ctx.recv_counts, ctx.send_counts, ctx.group)
        return grad_in, None, None, None


def _exchange(x_RD: torch.Tensor, send_counts: list[int], recv_counts: list[int],
              group: ProcessGroup) -> torch.Tensor:
    out = x_RD.new_empty((sum(recv_counts), *x_RD.shape[1:]))
    dist.all_to_all_single(out, x_RD.contiguous(), output_split_sizes=list(recv_counts),
                           input_split_sizes=list(send_counts), group=group)
    return out


def exchange_counts(send_counts: Counts, group: ProcessGroup, device: torch.device) -> torch.Tensor:
    """AlltoAll of int64 counts: entry i of the result is what rank i of the group sends here.

    send_counts may be [n] (one count per peer) or [n, k] (k counts per peer; the result is [n, k]).
    """
    send = torch.as_tensor(send_counts, dtype=torch.int64).to(device).contiguous()
    if group_size(group) == 1:
        return send.clone()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def all_to_all_rows(x_RD: torch.Tensor, send_counts: Counts, group: ProcessGroup = None,
                    recv_counts: Counts | None = None) -> tuple[torch.Tensor, list[int]]:
    """Send send_counts[i] consecutive rows of x_RD to rank i of `group`; return the rows received and counts.

    The received rows are ordered by source rank; recv_counts[i] came from rank i. Differentiable.
    Pass recv_counts when already known (e.g. exchanged with the routing) to skip the count exchange.
    """
    n = group_size(group)
    send = _as_list(send_counts)
    _check_counts(x_RD, send, n)
    if n == 1:
        return x_RD, send
    if recv_counts is None:
        recv = exchange_counts(send, group, x_RD.device).tolist()
    else:
        recv = _as_list(recv_counts)
    return _AllToAllRows.apply(x_RD, send, recv, group), recv


def hierarchical_all_to_all_rows(x_RD: torch.Tensor, send_counts: Counts,
                                 groups: ParallelGroups) -> tuple[torch.Tensor, list[int]]:
    """The resource-aware AlltoAll over the expert-parallel group: intra-node first, then inter-node.

    Step 1 (intra-node): each rank sends local rank q the rows bound for local rank q on every node.
    Step 2 (inter-node): ranks with equal local rank exchange the rows bound for each node.
    The result is exactly flat `all_to_all_rows(x_RD, send_counts, groups.ep_group)`: same rows, order, counts.
    """
    plan = _hierarchy(groups)
    if plan is None:
        return all_to_all_rows(x_RD, send_counts, groups.ep_group)
    num_nodes, per_node = plan
    send = _as_list(send_counts)
    _check_counts(x_RD, send, groups.ep_size)
    device = x_RD.device
    # Destination d = m * per_node + q (node m, local rank q): counts [m, q] reordered to [q, m].
    counts_mq = torch.tensor(send, dtype=torch.int64).view(num_nodes, per_node)
    x_qm = x_RD.index_select(0, chunk_transpose_index(counts_mq).to(device))
    # After step 1 this rank (node n, local rank q) holds, per local source p, the chunks for (m, q).
    counts_pm = exchange_counts(counts_mq.t(), groups.intra_node_group, device).cpu()
    y_pm = _AllToAllRows.apply(x_qm, counts_mq.sum(0).tolist(), counts_pm.sum(1).tolist(),
                               groups.intra_node_group)
    # Step 2 sends node m the chunks [p, m] for every p; what arrives is ordered by (source node, p).
    y_mp = y_pm.index_select(0, chunk_transpose_index(counts_pm).to(device))
    counts_from_mp = exchange_counts(counts_pm.t(), groups.ep_inter_node_group, device).cpu()
    y_RD = _AllToAllRows.apply(y_mp, counts_pm.sum(0).tolist(), counts_from_mp.sum(1).tolist(),
                               groups.ep_inter_node_group)
    return y_RD, counts_from_mp.flatten().tolist()


def chunk_transpose_index(counts_AB: torch.Tensor) -> torch.Tensor:
    """Row index that reorders chunks laid out (a, b) with sizes counts_AB[a, b] into (b, a) order."""
    counts_AB = counts_AB.to(torch.int64)
    sizes = counts_AB.flatten()
    starts_AB = (torch.cumsum(sizes, 0) - sizes).view_as(counts_AB)
    sizes_BA = counts_AB.t().flatten()
    starts_BA = starts_AB.t().flatten()
    total = int(sizes.sum())
    out_starts = torch.cumsum(sizes_BA, 0) - sizes_BA
    within = torch.arange(total) - torch.repeat_interleave(out_starts, sizes_BA, output_size=total)
    return torch.repeat_interleave(starts_BA, sizes_BA, output_size=total) + within


def make_all_to_all(kind: str, groups: ParallelGroups) -> AllToAll:
    """`parallel.alltoall` as a function (x_RD, send_counts) -> (y_RD, recv_counts) over the expert group."""
    if kind == "flat":
        return lambda x_RD, send_counts, recv_counts=None: all_to_all_rows(x_RD, send_counts, groups.ep_group,
                                                                          recv_counts)
    if kind == "hierarchical":
        _hierarchy(groups)  # fail at build time, not at the first MoE layer
        return lambda x_RD, send_counts, recv_counts=None: hierarchical_all_to_all_rows(x_RD, send_counts, groups)
    raise ValueError(f"parallel.alltoall={kind!r} is not one of flat, hierarchical")


def _hierarchy(groups: ParallelGroups) -> tuple[int, int] | None:
    """(nodes, ranks per node) the expert-parallel group spans; None when it lives on one node."""
    nodes = len(groups.ep_inter_node_ranks)
    if nodes == 1:
        return None
    if groups.ep_size % groups.nproc_per_node:
        raise ValueError(f"hierarchical AlltoAll needs topology.expert_parallel={groups.ep_size} to be a "
                         f"multiple of topology.nproc_per_node={groups.nproc_per_node} (whole nodes)")
    return nodes, groups.nproc_per_node


def _as_list(counts: Counts) -> list[int]:
    if isinstance(counts, torch.Tensor):
        return [int(c) for c in counts.tolist()]
    return [int(c) for c in counts]


def _check_counts(x_RD: torch.Tensor, send: list[int], n: int) -> None:
    if len(send) != n:
        raise ValueError(f"send_counts has {len(send)} entries for a group of {n} ranks")
    if any(c < 0 for c in send) or sum(send) != x_RD.shape[0]:
        raise ValueError(f"send_counts {send} must be >= 0 and sum to the {x_RD.shape[0]} rows of the input")
