"""Embedding partition in data parallelism (the paper's "Embedding Partition in Data Parallelism", Fig. 9): the [V, H]
table split column-wise into [V, H/N] shards over the N data-parallel ranks; AlltoAll of ids and of lookups forward, of
gradients backward.

Legend: T tokens of this rank, A tokens of all ranks together, V vocabulary, H hidden, C = H/N columns per shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.parallel.alltoall import all_to_all_rows, exchange_counts
from runtime.parallel.groups import ProcessGroup, group_rank, group_size
from runtime.plan.embedding_bytes import check_divisible
from runtime.storage.optim import square_sum


def shard_of(full_VH: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Columns [rank*H/n, (rank+1)*H/n) of a full table (or of its optimizer state), as a contiguous copy."""
    check_divisible(full_VH.shape[1], n)
    cols = full_VH.shape[1] // n
    return full_VH[:, rank * cols:(rank + 1) * cols].contiguous()


def full_table_from_shards(shards_VC: list[torch.Tensor]) -> torch.Tensor:
    """The [V, H] table from the shards of ranks 0..N-1 (column blocks in rank order)."""
    return torch.cat(list(shards_VC), dim=1)


def gather_columns(shard_VC: torch.Tensor, group: ProcessGroup = None) -> torch.Tensor:
    """Collective, not differentiable: every rank's shard of `group`, concatenated into the full [V, H] table."""
    n = group_size(group)
    if n == 1:
        return shard_VC.detach().clone()
    parts = [torch.empty_like(shard_VC) for _ in range(n)]
    dist.all_gather(parts, shard_VC.detach().contiguous(), group=group)
    return full_table_from_shards(parts)


class _GatherColumns(torch.autograd.Function):
    """Forward: all-gather the shards into [V, H]. Backward: reduce-scatter the [V, H] gradient to this rank's
    columns (summed over ranks), written as one AlltoAll of column blocks so it runs on gloo and NCCL alike."""

    @staticmethod
    def forward(ctx, shard_VC: torch.Tensor, group: ProcessGroup, n: int):
        ctx.group, ctx.n = group, n
        return gather_columns(shard_VC, group)

    @staticmethod
    def backward(ctx, grad_VH: torch.Tensor):
        v, h = grad_VH.shape
        blocks_NVC = grad_VH.reshape(v, ctx.n, h // ctx.n).permute(1, 0, 2).contiguous()
        recv_NVC = torch.empty_like(blocks_NVC)
        dist.all_to_all_single(recv_NVC, blocks_NVC, group=ctx.group)
        return recv_NVC.sum(0), None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` (turns the sum over ranks into the DP average)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class PartitionedEmbedding(nn.Module):
    """Holds columns [r*H/N, (r+1)*H/N) of a [V, H] embedding; forward returns full [*, H] rows for local ids.

    Every rank of `group` must call forward (with any number of tokens, zero included). The shard's gradient is
    complete locally after backward (every rank's tokens contribute through the reverse AlltoAll), so it must not
    be all-reduced: leave `partitioned_parameters(model)` out of the dense reducer. With average_grads it is the
    data-parallel average (sum over ranks / N), like the dense parameters after their all-reduce.
    """

    def __init__(self, vocab: int, hidden: int, group: ProcessGroup = None, average_grads: bool = True,
                 weight_VC: torch.Tensor | None = None):
        super().__init__()
        self.n = group_size(group)
        check_divisible(hidden, self.n)
        self.group, self.rank = group, group_rank(group)
        self.vocab, self.hidden, self.cols = vocab, hidden, hidden // self.n
        self.grad_scale = 1.0 / self.n if average_grads else 1.0
        if weight_VC is None:
            weight_VC = torch.empty(vocab, self.cols)
            nn.init.normal_(weight_VC, 0.0, 0.02)
        if tuple(weight_VC.shape) != (vocab, self.cols):
            raise ValueError(f"embedding shard has shape {tuple(weight_VC.shape)}, expected {(vocab, self.cols)}")
        self.weight = nn.Parameter(weight_VC.detach().clone())

    @classmethod
    def from_full(cls, full_VH: torch.Tensor, group: ProcessGroup = None, average_grads: bool = True):
        """This rank's partition of a full table that every rank holds (e.g. after a seeded init)."""
        n, rank = group_size(group), group_rank(group)
        check_divisible(full_VH.shape[1], n)
        return cls(full_VH.shape[0], full_VH.shape[1], group, average_grads, shard_of(full_VH, rank, n))

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, hidden={self.hidden}, shard_columns={self.cols}, ranks={self.n}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [*] -> [*, H]. Three AlltoAlls in all: ids out, lookups back, and (in backward) their gradients."""
        ids_T = ids.reshape(-1)
        t = ids_T.shape[0]
        if self.n == 1:
            return F.embedding(ids_T, _ScaleGrad.apply(self.weight, self.grad_scale)).view(*ids.shape, self.hidden)
        # AlltoAll 1 (after a tiny one of the lengths): every rank sends all its ids to every rank.
        counts_N = exchange_counts([t] * self.n, self.group, ids.device).tolist()
        all_ids_A, _ = all_to_all_rows(ids_T.repeat(self.n), [t] * self.n, self.group, recv_counts=counts_N)
        rows_AC = _ScaleGrad.apply(F.embedding(all_ids_A, self.weight), self.grad_scale)
        # AlltoAll 2: rank s gets back its tokens' columns of this shard; the reverse exchange is the backward one.
        blocks_NTC, _ = all_to_all_rows(rows_AC, counts_N, self.group, recv_counts=[t] * self.n)
        return blocks_NTC.view(self.n, t, self.cols).permute(1, 0, 2).reshape(*ids.shape, self.hidden)


class PartitionedTiedHead(nn.Module):
    """logits = h @ W^T for the tied output head, W gathered from the shards of a PartitionedEmbedding.

    Trade-off: all-gather of the table forward and an AlltoAll reduce-scatter of its gradient backward, each
    V*H*(N-1)/N elements per rank, and a transient [V, H] table plus its [V, H] gradient alive from the head's
    forward to its backward (8 bytes per element in fp32). The persistent state (weight, gradient, Adam moments:
    16 bytes per element) stays [V, H/N]. The alternative, partial logits from column blocks of h, would need an
    AlltoAll of h and one of [T, V] partial logits: cheaper only when the tokens per rank T are fewer than H.
    """

    def __init__(self, embedding: PartitionedEmbedding):
        super().__init__()
        self._embedding = (embedding,)  # a tuple, so the shard is not registered twice

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        emb = self._embedding[0]
        w = _ScaleGrad.apply(emb.weight, emb.grad_scale)
        if emb.n > 1:
            w = _GatherColumns.apply(w, emb.group, emb.n)
        return F.linear(h, w)


def partition_embedding(model: nn.Module, group: ProcessGroup = None, average_grads: bool = True) -> nn.Module:
    """Replace model.tok_embeddings (nn.Embedding [V, H], same on every rank) by this rank's partition of it;
    when the head is tied (model.output is None), install a PartitionedTiedHead on it. Returns the model."""
    table = model.tok_embeddings
    if not isinstance(table, nn.Embedding):
        raise TypeError(f"tok_embeddings is {type(table).__name__}, expected nn.Embedding (already partitioned?)")
    emb = PartitionedEmbedding.from_full(table.weight.detach(), group, average_grads).to(table.weight.device)
    model.tok_embeddings = emb
    if getattr(model, "output", None) is None:
        model.output = PartitionedTiedHead(emb)
    return model


def partitioned_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, shard) of every partitioned table: keep these out of the dense all-reduce and reshard on load."""
    return [(f"{name}.weight" if name else "weight", m.weight) for name, m in model.named_modules()
            if isinstance(m, PartitionedEmbedding)]


def partitioned_grad_sq(model: nn.Module) -> torch.Tensor:
    """Collective: squared L2 norm of the partitioned gradients over all columns (add it to a global grad norm)."""
    total = torch.zeros(())
    for m in model.modules():
        if isinstance(m, PartitionedEmbedding):
            g = m.weight.grad
            sq = (square_sum(g) if g is not None else torch.zeros((), device=m.weight.device)).reshape(1)
            if m.n > 1:
                dist.all_reduce(sq, group=m.group)
            total = total + sq.cpu()[0]
    return total
