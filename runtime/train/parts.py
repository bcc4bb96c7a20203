"""A training step is an objective (what the step computes) and a list of parts. Each part owns some parameters and
their optimizer state and takes part in a step through one small interface, so the loop, the gradient norm and the
checkpoint writer iterate over parts and name no feature (as torchtitan's model converters and optimizer hooks).

Legend of a step: objective.forward_backward (each micro-batch but the last inside part.accumulating) ->
part.after_backward -> global norm from part.grad_sq ->
part.scale_grads (clipping) -> part.before_optimizer_step -> optimizer.step; checkpoints: part.held_params are
left to part.save / part.load.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from runtime.files.checkpoint_format import STATE_KEYS, CheckpointError, CheckpointReader, tensor_key
from runtime.files.paths import DENSE_SHARDED
from runtime.files.tensorfile import save_tensors
from runtime.parallel.dense_shard import DenseShard
from runtime.parallel.embedding_partition import gather_columns, partitioned_grad_sq, partitioned_parameters, shard_of
from runtime.parallel.grad_buckets import GradBucketReducer
from runtime.parallel.groups import ParallelGroups, group_size
from runtime.storage.offload_checkpoint import load_offloaded, save_offloaded
from runtime.storage.offload_engine import OffloadEngine
from runtime.storage.optim import square_sum

GradSq = tuple[torch.Tensor, object]
"""(a local sum of squared gradients, the process group whose ranks hold disjoint shares of it; None: global)."""


class Part:
    """Does nothing by default; a part overrides the steps it takes part in."""

    def accumulating(self) -> contextlib.AbstractContextManager:
        """The context of a micro-batch before the last of an optimizer step (train.grad_accum_steps): its gradients
        add up where they are made, nothing is reduced or sent anywhere until the last micro-batch's backward."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Finish this part's gradient reductions; gradients are complete afterwards."""

    def grad_sq(self) -> list[GradSq]:
        return []

    def scale_grads(self, coef: float) -> None:
        """Multiply this part's gradients by the clip coefficient."""

    def before_optimizer_step(self, step: int, lr: float, coef: float | None) -> None:
        """Run right before the resident optimizer steps: lr of this step, and what every gradient is multiplied by
        (the clip coefficient, over the loss scale with fp16), or None."""

    def skip_step(self) -> None:
        """This step's gradients are dropped (fp16 overflow): nothing is applied."""

    def metrics(self) -> dict:
        return {}

    def disk_bytes(self) -> int:
        """Bytes this part keeps on disk outside checkpoints (measured beside memory per rank)."""
        return 0

    def held_params(self) -> dict[str, torch.Size]:
        """Model parameter names this part saves and loads itself (the checkpoint writer skips them)."""
        return {}

    def save(self, directory: Path, step: int) -> list[Path]:
        """Write this part's files into the checkpoint being assembled (may be collective)."""
        return []

    def load(self, reader: CheckpointReader, step: int) -> None:
        """Restore this part's state from a checkpoint."""

    def close(self) -> None:
        """Stop background work; also called when a step raised."""


def _scale(params, coef) -> None:
    """Multiply the gradients by `coef` (a float, or a 0-d tensor on their device: no host read), in one foreach call
    (each gradient times the coefficient rounded to its dtype, as a Python float multiplies it)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype) if isinstance(coef, torch.Tensor) else coef)


def _sq(params) -> torch.Tensor:
    return sum((square_sum(p.grad) for p in params if p.grad is not None), torch.zeros(())).reshape(1)


class Replicated(Part):
    """The plain data + expert parallel reduction: dense gradients averaged over every rank in fixed-size buckets
    as backward produces them; an expert's gradient summed over the ranks that routed to it (the AlltoAll
    backward does that), divided by the EP size and averaged over its replicas."""

    def __init__(self, dense: list[nn.Parameter], experts: list[nn.Parameter], groups: ParallelGroups,
                 bucket_bytes: int):
        self.dense, self.experts, self.groups = dense, experts, groups
        self.dense_reducer = GradBucketReducer(dense, groups.dp_group, bucket_bytes)
        self.expert_reducer = GradBucketReducer(experts, groups.edp_group, bucket_bytes)

    def accumulating(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(self.dense_reducer.no_sync())
        stack.enter_context(self.expert_reducer.no_sync())
        return stack

    def after_backward(self) -> None:
        self.dense_reducer.finish()
        self.expert_reducer.finish()
        if self.groups.ep_size > 1:
            for p in self.experts:
                if p.grad is not None:
                    p.grad.div_(self.groups.ep_size)

    def grad_sq(self) -> list[GradSq]:
        ep_group = self.groups.ep_group if self.groups.ep_size > 1 else None
        return [(_sq(self.dense), None), (_sq(self.experts), ep_group)]

    def scale_grads(self, coef: float) -> None:
        _scale(self.dense, coef)
        _scale(self.experts, coef)


class PartitionedEmbeddingPart(Part):
    """model.embedding_partition: [V, H/N] column shards whose gradients are complete after the AlltoAll backward
    (the paper's "Embedding Partition in Data Parallelism"); they are in neither reducer."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = [p for _, p in partitioned_parameters(model)]

    def grad_sq(self) -> list[GradSq]:
        return [(partitioned_grad_sq(self.model).reshape(1), None)]

    # A checkpoint holds the whole [V, H] table (and its moments), so that any data-parallel size loads it.

    @staticmethod
    def full_shape(local_shape: tuple[int, ...], groups: ParallelGroups) -> tuple[int, ...]:
        return (local_shape[0], local_shape[1] * group_size(groups.dp_group))

    @staticmethod
    def full(local_VC: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
        """Collective: every data-parallel rank's columns gathered into the whole table."""
        return gather_columns(local_VC, groups.dp_group)

    @staticmethod
    def local(full_VH: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
        """This rank's columns of the whole table."""
        return shard_of(full_VH, groups.dp_ranks.index(groups.rank), groups.dp_size)

    def scale_grads(self, coef: float) -> None:
        _scale(self.params, coef)


class ShardedDense(Part):
    """storage.dense_shard (Algorithm 1): 1/N of the dense parameters and their AdamW states per rank, gathered per
    layer, gradients reduce-scattered; checkpoints hold the full tensors under the unsharded names."""

    def __init__(self, shard: DenseShard, optimizer: torch.optim.Optimizer, groups: ParallelGroups):
        self.shard, self.optimizer, self.groups = shard, optimizer, groups

    def after_backward(self) -> None:
        self.shard.finish()

    def grad_sq(self) -> list[GradSq]:
        return [(self.shard.grad_sq(), None)]

    def scale_grads(self, coef: float) -> None:
        self.shard.scale_grads(coef)

    def metrics(self) -> dict:
        return self.shard.step_metrics()

    def held_params(self) -> dict[str, torch.Size]:
        return self.shard.param_shapes()

    def save(self, directory: Path, step: int) -> list[Path]:
        full = self.shard.full_state(self.optimizer)  # collective
        if self.groups.rank != 0:
            return []
        tensors = {tensor_key(kind, n): t.contiguous() for n, kinds in full.items() for kind, t in kinds.items()}
        return [save_tensors(Path(directory) / DENSE_SHARDED, tensors)]

    def load(self, reader: CheckpointReader, step: int) -> None:
        held = self.held_params()
        full = {name: {kind: reader.get(tensor_key(kind, name)) for kind in ("model", *STATE_KEYS, "step")}
                for name in held}
        for name, shape in held.items():
            if full[name]["model"].shape != shape:
                raise CheckpointError(f"{name} has shape {tuple(full[name]['model'].shape)} in {reader.path}, "
                                      f"the model expects {tuple(shape)}")
        self.shard.load_full_state(full, self.optimizer)


class OffloadedExperts(Part):
    """storage.offload=cpu|ssd: expert states off the device, moved when routed to, stepped by a CPU AdamW that
    overlaps the backward and the next step (runtime/storage/offload_engine.py)."""

    def __init__(self, engine: OffloadEngine, groups: ParallelGroups):
        self.engine, self.groups = engine, groups

    def accumulating(self) -> contextlib.AbstractContextManager:
        return self.engine.accumulate()

    def after_backward(self) -> None:
        self.engine.finish_backward()

    def grad_sq(self) -> list[GradSq]:  # summed with the resident experts' share before the EP all-reduce
        return [(self.engine.grad_sq().reshape(1), self.groups.ep_group if self.groups.ep_size > 1 else None)]

    def before_optimizer_step(self, step: int, lr: float, coef) -> None:
        self.engine.step(lr, None if coef is None else float(coef))  # scaled inside the CPU kernel, on the host

    def skip_step(self) -> None:
        self.engine.skip_step()

    def metrics(self) -> dict:
        return self.engine.step_metrics()

    def disk_bytes(self) -> int:
        store = getattr(self.engine.home, "store", None)
        return store.disk_bytes() if store is not None else 0

    def save(self, directory: Path, step: int) -> list[Path]:
        return save_offloaded(self.engine, directory, step)

    def load(self, reader: CheckpointReader, step: int) -> None:
        load_offloaded(self.engine, reader, step)

    def close(self) -> None:
        self.engine.close()


def global_grad_norm(parts: list[Part], device: torch.device | None = None) -> torch.Tensor:
    """L2 norm of every gradient counted once, a float64 0-d tensor on `device` (nothing read back to the host):
    shares of one group are summed in fp32 and all-reduced together (one collective per group, in the parts' order,
    so every rank issues the same ones), the groups' sums added in float64."""
    device = device or torch.device("cpu")
    shares: dict[int, list] = {}
    for part in parts:
        for sq, group in part.grad_sq():
            key = id(group) if group is not None else 0
            entry = shares.setdefault(key, [group, torch.zeros(1, device=device)])
            entry[1] = entry[1] + sq.detach().float().reshape(1).to(device, non_blocking=True)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group, sq in shares.values():
        if group is not None:
            dist.all_reduce(sq, group=group)
        total = total + sq.double().reshape(())
    return total.sqrt()


class TaskHeads(Part):
    """Multi-task heads (the paper's "Elastic MoE Training"): synchronised only among their task's ranks, each saved
    once (runtime/train/tasks.py's TaskHeadState, stepped by the resident optimizer)."""

    def __init__(self, state, optimizer: torch.optim.Optimizer):
        self.state, self.optimizer = state, optimizer

    def after_backward(self) -> None:
        self.state.finish_heads()

    def grad_sq(self) -> list[GradSq]:
        return [(torch.tensor([self.state.grad_sq()]), None)]  # collective inside; each head counted once

    def scale_grads(self, coef: float) -> None:
        _scale(self.state.parameters(), coef)

    def save(self, directory: Path, step: int) -> list[Path]:
        return self.state.save(directory, self.optimizer)

    def load(self, reader: CheckpointReader, step: int) -> None:
        self.state.load(reader, self.optimizer)
