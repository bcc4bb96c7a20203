"""Expert parallelism: the local dispatcher plus an AlltoAll of token rows to the ranks that own the experts (the
paper's "MoE Training and Inference Systems"; GShard section 3.2). Experts of a layer are split into contiguous blocks
of e = E / ep.

Legend: T tokens, D model dim, E global experts, e local experts, P ranks of the expert-parallel group,
R rows grouped by global expert (sent), Q rows grouped by local expert (received).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from runtime.moe.dispatch import DispatchMeta, LocalDispatcher
from runtime.moe.experts import GroupedExperts
from runtime.moe.layer import MoELayer
from runtime.moe.router import Routing
from runtime.parallel.alltoall import AllToAll, chunk_transpose_index, exchange_counts


@dataclass(frozen=True)
class ExpertParallelMeta:
    local: DispatchMeta
    """The local sort, undone last by combine."""
    send_counts: list[int]
    """Rows this rank sent to each rank of the group (forward)."""
    recv_counts: list[int]
    """Rows this rank received from each rank of the group (forward)."""
    by_expert_Q: Tensor
    """Row index that regroups received rows from (source rank, local expert) to (local expert, source rank)."""
    by_source_Q: Tensor
    """Its inverse."""


class ExpertParallelDispatcher(LocalDispatcher):
    """Sort locally by global expert, AlltoAll rows to the expert's owner, regroup by local expert."""

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, ep_group, all_to_all: AllToAll):
        super().__init__(num_experts)
        self.ep_size, self.ep_rank, self.ep_group = ep_size, ep_rank, ep_group
        self.local_experts = num_experts // ep_size
        self.all_to_all = all_to_all
        self.host_reads = 0
        """Reads of device data on the host so far: one a forward, the split sizes of both AlltoAlls (combine and
        both backwards reuse them)."""

    def dispatch(self, x_TD: Tensor, routing: Routing,
                 keep_TK: Tensor | None = None) -> tuple[Tensor, Tensor, ExpertParallelMeta]:
        x_RD, tokens_per_expert_E, local = super().dispatch(x_TD, routing, keep_TK)
        counts_Pe = tokens_per_expert_E.view(self.ep_size, self.local_experts)
        # recv_Pe[p, j]: rows rank p sends for this rank's local expert j (counts exchanged before the rows); the
        # rows each rank sends, and these, come to the host in one read
        recv_Pe = exchange_counts(counts_Pe, self.ep_group, x_TD.device)
        both = torch.cat([counts_Pe.sum(1), recv_Pe.reshape(-1)]).cpu()
        self.host_reads += 1
        send_counts, recv_Pe = both[:self.ep_size].tolist(), both[self.ep_size:].view(self.ep_size, -1)
        x_recv_QD, recv_counts = self.all_to_all(x_RD, send_counts, recv_Pe.sum(1))
        by_expert_Q = chunk_transpose_index(recv_Pe).to(x_TD.device)
        by_source_Q = torch.empty_like(by_expert_Q)
        by_source_Q[by_expert_Q] = torch.arange(by_expert_Q.numel(), device=x_TD.device)
        x_QD = x_recv_QD.index_select(0, by_expert_Q)
        meta = ExpertParallelMeta(local, send_counts, list(recv_counts), by_expert_Q, by_source_Q)
        return x_QD, recv_Pe.sum(0), meta

    def combine(self, y_QD: Tensor, meta: ExpertParallelMeta) -> Tensor:
        y_back_RD, _ = self.all_to_all(y_QD.index_select(0, meta.by_source_Q), meta.recv_counts, meta.send_counts)
        return super().combine(y_back_RD, meta.local)


def shard_experts(model: nn.Module, ep_size: int, ep_rank: int, ep_group, all_to_all: AllToAll) -> None:
    """Keep only this rank's block of experts in every MoE layer and give each layer an EP dispatcher.

    On a model still on the meta device this allocates nothing; initialization then draws each kept expert from
    its global index (runtime/model/init.py), so expert g starts the same whatever the expert-parallel size.
    """
    if ep_size == 1:
        return
    for layer in model.modules():
        if not isinstance(layer, MoELayer):
            continue
        experts, num = layer.experts, layer.cfg.num_experts
        if not isinstance(experts, GroupedExperts):
            raise TypeError(f"expert parallelism shards a layer's own GroupedExperts, not a {type(experts).__name__}")
        local = num // ep_size
        block = slice(ep_rank * local, (ep_rank + 1) * local)
        for name, param in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(param.detach()[block].clone()))
        experts.num_experts = local
        experts.first_expert = ep_rank * local
        layer.dispatcher = ExpertParallelDispatcher(num, ep_size, ep_rank, ep_group, all_to_all)
