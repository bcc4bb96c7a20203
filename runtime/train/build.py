"""Build what a training worker needs: the expert-parallel model, AdamW, gradient reducers and data.

Every rank builds the full model from one seed and then keeps its block of experts, so expert g starts with
the same weights for any expert-parallel size (seed 004 section 2: expert + data parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from runtime.config import MoesysConfig
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param
from runtime.optim import ADAMW_BETAS, ADAMW_EPS
from runtime.parallel.alltoall import make_all_to_all
from runtime.parallel.dense_shard import DenseShard
from runtime.parallel.embedding_partition import partition_embedding, partitioned_parameters
from runtime.parallel.expert_parallel import shard_experts
from runtime.parallel.grad_buckets import GradBucketReducer
from runtime.parallel.groups import ParallelGroups
from runtime.storage.offload import OffloadManager, offload_from_config
from runtime.train.data import TokenDataset
from runtime.train.tasks import MultiTask, add_heads_to_optimizer, build_multitask

MB = 2**20


@dataclass
class Components:
    model: Transformer
    optimizer: torch.optim.Optimizer
    dense_params: list[nn.Parameter]
    expert_params: list[nn.Parameter]
    dense_reducer: GradBucketReducer
    """Averages dense gradients over all data-parallel ranks."""
    expert_reducer: GradBucketReducer
    """Averages expert gradients over the replicas of the same experts only."""
    data: TokenDataset
    offload: OffloadManager | None = None
    """Expert states off the device (storage.offload cpu/ssd/auto): fetched, stepped and checkpointed by it."""
    dense_shard: DenseShard | None = None
    """storage.dense_shard: 1/N of the dense states per rank, gathered per layer, gradients reduce-scattered."""
    tasks: MultiTask | None = None
    """Multi-task training (cfg.tasks): this rank's tasks, their heads, groups and data."""


def build_model(cfg: MoesysConfig, groups: ParallelGroups, device: torch.device) -> Transformer:
    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model)
    shard_experts(model, groups.ep_size, groups.ep_rank, groups.ep_group,
                  make_all_to_all(cfg.parallel.alltoall, groups))
    if cfg.model.embedding_partition:  # seed 004 section 4.3: [V, H/N] column shard per data-parallel rank
        partition_embedding(model, groups.dp_group)
    return model.to(device)


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) parameters, in registration order; partitioned embedding shards are in neither (their
    gradient is complete after backward and must not be all-reduced)."""
    dense, experts = [], []
    shards = dict(partitioned_parameters(model))
    for name, p in model.named_parameters():
        if name not in shards:
            (experts if is_expert_param(name) else dense).append(p)
    return dense, experts


def build_optimizer(model: nn.Module, cfg: MoesysConfig) -> torch.optim.Optimizer:
    """AdamW on the fp32 parameters (the master weights); no decay on biases, norms and other 1-D tensors."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS)


def build_sharded_optimizer(model: nn.Module, shard: DenseShard, cfg: MoesysConfig) -> torch.optim.Optimizer:
    """build_optimizer's AdamW over the parameters `shard` does not hold and its flat dense shards (same decay rule)."""
    sharded = {id(p) for u in shard.units for p in u.params}
    rest = [p for p in model.parameters() if id(p) not in sharded]
    decay = [p for p in rest if p.dim() >= 2] + shard.decay_params
    no_decay = [p for p in rest if p.dim() < 2] + shard.no_decay_params
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS)


def build_components(cfg: MoesysConfig, groups: ParallelGroups, device: torch.device) -> Components:
    model = build_model(cfg, groups, device)
    offload = None
    if cfg.storage.offload in ("cpu", "ssd", "auto"):
        offload = offload_from_config(model, cfg, groups, device)  # replaces the experts before the optimizer
    tasks = build_multitask(cfg, model, groups, device) if cfg.tasks else None  # task heads replace model.output
    dense, experts = split_params(model)
    bucket = int(cfg.parallel.bucket_mb * MB)
    data = TokenDataset.from_path(Path(cfg.train.data) if cfg.train.data else None, cfg.train.seq_len,
                                  cfg.train.seed)
    dense_shard = None
    if cfg.storage.dense_shard:  # Algorithm 1: replaces the dense all-reduce and the replicated dense states
        dense_shard = DenseShard(model, dense, groups.dp_group, cfg.storage.prefetch_depth)
        optimizer = build_sharded_optimizer(model, dense_shard, cfg)
    else:
        optimizer = build_optimizer(model, cfg)
    if tasks:
        add_heads_to_optimizer(optimizer, tasks, cfg)
    return Components(
        model=model, optimizer=optimizer, dense_params=dense, expert_params=experts,
        dense_reducer=GradBucketReducer([] if dense_shard else dense, groups.dp_group, bucket),
        dense_shard=dense_shard,
        expert_reducer=GradBucketReducer(experts, groups.edp_group, bucket),
        data=data, offload=offload, tasks=tasks,
    )
