"""Build what a training worker needs: the expert-parallel model, AdamW, gradient reducers and data.

The model is first built on the meta device (shapes only) and cut to this rank's block of experts (the paper's "MoE
Training and Inference Systems": expert + data parallelism); offloaded experts are then created straight into their
store, and only what stays resident is allocated. Initial values are a function of (train.seed, name, global expert), so
expert g starts the same for any expert-parallel size and any tier (runtime/model/init.py), and no rank ever holds the
whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from runtime.config import MoesysConfig
from runtime.data.chat_records import is_chat
from runtime.data.chat_source import open_chat_dataset
from runtime.data.dataset import open_dataset
from runtime.data.tokenizer import run_tokenizer
from runtime.model.init import init_parameters
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param
from runtime.parallel.alltoall import make_all_to_all
from runtime.parallel.dense_shard import DenseShard
from runtime.parallel.embedding_partition import partition_embedding, partitioned_parameters
from runtime.parallel.expert_parallel import shard_experts
from runtime.parallel.groups import ParallelGroups
from runtime.plan.placement import Placement, decide
from runtime.storage.offload_engine import OffloadEngine
from runtime.storage.offload_install import offload_from_config
from runtime.storage.optim import ADAMW_BETAS, ADAMW_EPS
from runtime.train.compiled import compile_blocks
from runtime.train.distill import Distillation
from runtime.train.freeze import freeze
from runtime.train.init_from import InitialWeights
from runtime.train.objective import ChatLanguageModel, LanguageModel, Objective
from runtime.train.parts import OffloadedExperts, Part, PartitionedEmbeddingPart, Replicated, ShardedDense, TaskHeads
from runtime.train.recompute import apply_recompute
from runtime.train.tasks import MultiTask, add_heads_to_optimizer, build_multitask

MB = 2**20


@dataclass
class Components:
    """What a worker trains: the model, its resident optimizer, the objective and the parts of a step. The loop
    uses only model, optimizer, objective and parts; the named handles serve tests and benchmarks."""

    model: Transformer
    optimizer: torch.optim.Optimizer
    objective: Objective
    parts: list[Part]
    dense_params: list[nn.Parameter] = field(default_factory=list)
    expert_params: list[nn.Parameter] = field(default_factory=list)
    offload: OffloadEngine | None = None
    dense_shard: DenseShard | None = None
    tasks: MultiTask | None = None


def model_skeleton(cfg: MoesysConfig, groups: ParallelGroups) -> Transformer:
    """The model on the meta device with only this rank's block of experts in each MoE layer: nothing allocated."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    shard_experts(model, groups.ep_size, groups.ep_rank, groups.ep_group,
                  make_all_to_all(cfg.parallel.alltoall, groups))
    return model


def materialize(model: Transformer, cfg: MoesysConfig, groups: ParallelGroups, device: torch.device,
                initial: InitialWeights | None = None) -> Transformer:
    """Allocate the skeleton's parameters on `device` and initialize them from train.seed, or copy them from
    `initial` (train.init_from); then cut the embedding into this rank's columns when asked (the paper's "Embedding
    Partition in Data Parallelism")."""
    model.to_empty(device=device)
    if initial is not None:
        initial.copy_into(model)
    else:
        init_parameters(model, cfg.train.seed)
    if cfg.model.embedding_partition:  # [V, H/N] column shard per data-parallel rank
        partition_embedding(model, groups.dp_group)
    return model


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) parameters, in registration order; partitioned embedding shards are in neither (their
    gradient is complete after backward and must not be all-reduced)."""
    dense: list[nn.Parameter] = []
    experts: list[nn.Parameter] = []
    shards = dict(partitioned_parameters(model))
    for name, p in model.named_parameters():
        if name not in shards:
            (experts if is_expert_param(name) else dense).append(p)
    return dense, experts


def build_optimizer(model: nn.Module, cfg: MoesysConfig) -> torch.optim.Optimizer:
    """AdamW on the fp32 parameters (the master weights); no decay on biases, norms and other 1-D tensors. torch's
    fused kernel, on the CPU too: several times the single-tensor loop's speed, and the kernel offloaded experts'
    CPU AdamW runs (runtime/storage/optim.py), so both train to the same numbers."""
    trained = [p for p in model.parameters() if p.requires_grad]  # frozen parameters get no optimizer state
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, fused=True)


def build_sharded_optimizer(model: nn.Module, shard: DenseShard, cfg: MoesysConfig) -> torch.optim.Optimizer:
    """build_optimizer's AdamW over the parameters `shard` does not hold and its flat dense shards (same decay rule)."""
    sharded = {id(p) for u in shard.units for p in u.params}
    rest = [p for p in model.parameters() if id(p) not in sharded and p.requires_grad]
    decay = [p for p in rest if p.dim() >= 2] + shard.decay_params
    no_decay = [p for p in rest if p.dim() < 2] + shard.no_decay_params
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, fused=True)


def build_components(cfg: MoesysConfig, groups: ParallelGroups, device: torch.device,
                     placement: Placement | None = None, resuming: bool = False,
                     initial: InitialWeights | None = None) -> Components:
    """Build the model, swap in what the config asks for (offloaded experts, task heads, sharded dense states)
    before the optimizer exists, then the parts that take part in each step. `placement`: the run's recorded
    plan (RUN_DIR/plan.json); None decides it here, as single-process tests do. `resuming`: a checkpoint will be
    loaded, so offloaded experts are not initialized in their store (the checkpoint rebuilds it). `initial`: the
    weights of train.init_from, streamed into this rank's part (offloaded experts straight into their home)."""
    placement = placement or decide(cfg)[0]
    model = model_skeleton(cfg, groups)
    offload = None
    if placement.offload.offloaded:  # experts created in their home, before anything is allocated
        offload = offload_from_config(model, cfg, groups, device, placement, write_initial=not resuming,
                                      initial=initial.expert if initial is not None else None,
                                      trainable="experts" not in cfg.train.freeze)
    materialize(model, cfg, groups, device, initial)
    tasks = None
    if cfg.tasks:  # task heads replace model.output
        tasks = build_multitask(cfg, model, groups, device, placement.task_gpus)
    freeze(model, cfg.train.freeze)  # before the reducers, the dense shard and the optimizer take the parameters
    apply_recompute(model, cfg.train.recompute, offload)  # model converters: before the optimizer exists
    if cfg.train.compile:
        compile_blocks(model)
    dense, experts = split_params(model)
    dense_shard = None
    if cfg.storage.dense_shard:  # Algorithm 1: replaces the dense all-reduce and the replicated dense states
        dense_shard = DenseShard(model, dense, groups.dp_group, cfg.storage.prefetch_depth)
        optimizer = build_sharded_optimizer(model, dense_shard, cfg)
    else:
        optimizer = build_optimizer(model, cfg)
    if tasks:
        add_heads_to_optimizer(optimizer, tasks, cfg)
    parts: list[Part] = [Replicated([] if dense_shard else dense, experts, groups, int(cfg.parallel.bucket_mb * MB))]
    if cfg.model.embedding_partition:
        parts.append(PartitionedEmbeddingPart(model))
    if dense_shard:
        parts.append(ShardedDense(dense_shard, optimizer, groups))
    if offload:
        parts.append(OffloadedExperts(offload, groups))
    if tasks:
        parts.append(TaskHeads(tasks.head_state, optimizer))
    objective: Objective
    if tasks:
        objective = tasks
    elif cfg.distill.teacher:  # moesys distill: the student also matches a frozen teacher's soft targets
        objective = Distillation.from_config(cfg, groups, device)
    elif cfg.train.data is not None and is_chat(cfg.train.data, cfg.train.data_format):  # assistant's tokens, packed
        objective = ChatLanguageModel(open_chat_dataset(cfg, run_tokenizer(cfg), "train.data", cfg.train.data),
                                      groups, cfg.train.micro_batch_size, cfg.train.seq_len,
                                      max(1, cfg.train.grad_accum_steps))
    else:
        objective = LanguageModel(open_dataset(cfg, run_tokenizer(cfg), "train.data", cfg.train.data),
                                  groups, cfg.train.micro_batch_size, cfg.train.seq_len,
                                  max(1, cfg.train.grad_accum_steps))
    return Components(model=model, optimizer=optimizer, objective=objective, parts=parts, dense_params=dense,
                      expert_params=experts, offload=offload, dense_shard=dense_shard, tasks=tasks)
