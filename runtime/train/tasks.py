"""Multi-task training (the paper's "Elastic MoE Training", UFO): ranks run tasks by the elastic allocation, each task
has its own output head kept in sync only among its ranks, shared weights and experts stay synchronised over all ranks.

Objective: the mean loss over every sample of every task in the step, whatever the allocation. Rank r scales its
tasks' mean losses L_tr by W * n_tr / N (n_tr its samples of task t, N all samples, W ranks): the world average of
the rank losses (what the dense and expert reducers compute) is then the global mean, and a rank hosting several
tasks sums their weighted losses. Head gradients are averaged over the task's k ranks and scaled by k / W.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.config import MoesysConfig
from runtime.data.dataset import TokenDataset, build_task_datasets, task_seed
from runtime.data.tokenizer import run_tokenizer
from runtime.elastic.allocation import AllocationError, Workload
from runtime.elastic.workload import workload_from_config
from runtime.files.checkpoint_format import STATE_KEYS, CheckpointError, CheckpointReader
from runtime.files.paths import TASKS, heads_file
from runtime.files.tensorfile import save_tensors
from runtime.host.io import atomic_write_json
from runtime.model.transformer import ModelOutput
from runtime.parallel.grad_buckets import GradBucketReducer
from runtime.parallel.groups import ParallelGroups
from runtime.plan.rebalance import task_gpu_counts

HEAD_INIT_STD = 0.02


@dataclass(frozen=True)
class TaskLayout:
    """Which ranks run each task and how many of the task's samples per step each of them takes."""

    world_size: int
    ranks: dict[str, list[int]]
    """Ranks of each task, in configured task order; a packed rank appears under every task it hosts."""
    batch: dict[str, list[int]]
    """Samples per step of each task on each of its ranks (aligned with ranks)."""

    @property
    def tasks(self) -> list[str]:
        return list(self.ranks)

    @property
    def total_samples(self) -> int:
        return sum(sum(b) for b in self.batch.values())

    def tasks_of(self, rank: int) -> list[str]:
        return [t for t, rs in self.ranks.items() if rank in rs]

    def samples(self, task: str, rank: int) -> int:
        return self.batch[task][self.ranks[task].index(rank)]

    def offset(self, task: str, rank: int) -> int:
        """First sample of `rank`'s slice of the task's batch: ranks split it in rank order."""
        return sum(self.batch[task][:self.ranks[task].index(rank)])

    def rank_samples(self, rank: int) -> int:
        return sum(self.samples(t, rank) for t in self.tasks_of(rank))


def _split(batch: int, k: int) -> list[int]:
    return [batch // k + (1 if i < batch % k else 0) for i in range(k)]


def _rank_load(w: Workload, k: int) -> float:
    return -(-w[0] // k) * w[1]


def layout_from_counts(workload: Mapping[str, Workload], counts: Mapping[str, int], world: int) -> TaskLayout:
    """Lay tasks with `counts` ranks each onto `world` ranks: a task on k > 1 ranks gets k dedicated ranks; the
    1-rank tasks take the ranks left, packed (heaviest first onto the least loaded rank) when they outnumber them.
    Ranks still left over go, one by one, to the task with the largest per-rank load, so no rank idles."""
    names = list(workload)
    if set(counts) != set(names) or any(counts[n] < 1 for n in names):
        raise AllocationError(f"every task needs a positive GPU count (got {dict(counts)})")
    counts = dict(counts)
    while True:
        dedicated = sum(counts[n] for n in names if counts[n] > 1)
        singles = [n for n in names if counts[n] == 1]
        free = world - dedicated
        if free < (1 if singles else 0):
            raise AllocationError(f"tasks.*.gpus {counts} need more than the job's {world} processes; rerun "
                                  f"`moesys rebalance` for this topology")
        if free <= len(singles):
            break
        grow = [n for n in names if counts[n] < workload[n][0]]
        if not grow:
            raise AllocationError(f"{world} processes are more than the {sum(b for b, _ in workload.values())} "
                                  f"samples per step of all tasks together")
        counts[max(grow, key=lambda n: _rank_load(workload[n], counts[n]))] += 1
    parts: list[tuple[list[str], int]] = [([n], counts[n]) for n in names if counts[n] > 1]
    bins: list[list[str]] = [[] for _ in range(free)]
    for n in sorted(singles, key=lambda n: -workload[n][0] * workload[n][1]):
        min(bins, key=lambda b: sum(workload[m][0] * workload[m][1] for m in b)).append(n)
    parts += [(b, 1) for b in bins if b]
    parts.sort(key=lambda p: names.index(p[0][0]))
    ranks: dict[str, list[int]] = {}
    batch: dict[str, list[int]] = {}
    nxt = 0
    for members, k in parts:
        for n in members:
            ranks[n] = list(range(nxt, nxt + k))
            batch[n] = _split(workload[n][0], k)
        nxt += k
    return TaskLayout(world, {n: ranks[n] for n in names}, {n: batch[n] for n in names})


def task_layout(cfg: MoesysConfig, world: int, counts: Mapping[str, int] | None = None) -> TaskLayout:
    """The layout of `counts` ranks per task (the run's recorded plan), or of task_gpu_counts when None."""
    counts = dict(counts) if counts else task_gpu_counts(cfg, world)
    return layout_from_counts(workload_from_config(cfg.tasks), counts, world)


def new_head(cfg: MoesysConfig, task: str) -> nn.Linear:
    """Output head [V, D] of a task, initialised from (seed, task) so every rank of the task starts equal."""
    head = nn.Linear(cfg.model.hidden_size, cfg.model.vocab_size, bias=False)
    gen = torch.Generator().manual_seed(task_seed(cfg.train.seed, task))
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * HEAD_INIT_STD)
    return head


class TaskHeadState:
    """Each local task's output head: its gradients averaged only over the task's ranks, its checkpoint file
    written once (by the task's first rank) and read by whichever ranks run the task."""

    def __init__(self, cfg: MoesysConfig, layout: TaskLayout, groups: ParallelGroups, device: torch.device,
                 local: list[str]):
        self.layout, self.rank, self.world, self.local = layout, groups.rank, groups.world_size, local
        self.heads = nn.ModuleDict({t: new_head(cfg, t) for t in local}).to(device)
        bucket = int(cfg.parallel.bucket_mb * 2**20)
        self.reducers: dict[str, GradBucketReducer] = {}
        for t in layout.tasks:  # every rank creates every group, in task order
            rs = layout.ranks[t]
            if self.world > 1 and len(rs) > 1:
                handle = dist.new_group(rs)
                if t in local:
                    self.reducers[t] = GradBucketReducer(self.heads[t].parameters(), handle, bucket)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.heads.parameters())

    def finish_heads(self) -> None:
        """Average head gradients over each task's ranks, then scale by k / W (see the module docstring)."""
        for t in self.local:
            reducer = self.reducers.get(t)
            if reducer is not None:
                reducer.finish()
            k = len(self.layout.ranks[t])
            for p in self.heads[t].parameters():
                if p.grad is not None:
                    p.grad.mul_(k / self.world)

    def grad_sq(self) -> float:
        """Squared norm of every task's head gradient, each counted once (by the task's first rank); collective."""
        sq = torch.zeros(1, dtype=torch.float64)
        for t in self.local:
            if self.layout.ranks[t][0] == self.rank:
                for p in self.heads[t].parameters():
                    if p.grad is not None:
                        sq += p.grad.detach().double().pow(2).sum().cpu()
        if self.world > 1:
            dist.all_reduce(sq)
        return float(sq)

    # ---- checkpoints: each head saved once (by its task's first rank), loaded by whichever ranks run it ----

    def save(self, ckpt_dir: Path, optimizer: torch.optim.Optimizer) -> list[Path]:
        """Write heads-TASK.safetensors for the tasks this rank leads (and tasks.json on rank 0) into ckpt_dir."""
        files = []
        for t in self.local:
            if self.layout.ranks[t][0] != self.rank:
                continue
            tensors = {}
            for name, p in self.heads[t].named_parameters():
                state = optimizer.state.get(p, {})
                tensors[f"model.task_heads.{t}.{name}"] = p.detach().cpu().contiguous()
                for key in STATE_KEYS:
                    tensors[f"{key}.task_heads.{t}.{name}"] = (state[key] if key in state else
                                                               torch.zeros_like(p)).detach().cpu().contiguous()
                tensors[f"step.task_heads.{t}.{name}"] = torch.as_tensor(
                    state.get("step", torch.tensor(0.0)), dtype=torch.float32).reshape(1)
            files.append(save_tensors(Path(ckpt_dir) / heads_file(t), tensors))
        if self.rank == 0:
            atomic_write_json(Path(ckpt_dir) / TASKS, {"ranks": self.layout.ranks, "batch": self.layout.batch})
        return files

    def load(self, checkpoint: Path | CheckpointReader, optimizer: torch.optim.Optimizer | None) -> None:
        """Load this rank's heads (and their AdamW states) from a checkpoint written by any allocation (a directory,
        or the reader the checkpoint loader already opened)."""
        reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(Path(checkpoint))
        for t in self.local:
            if any(f"model.task_heads.{t}.{name}" not in reader for name, _ in self.heads[t].named_parameters()):
                raise CheckpointError(f"{reader.path} has no head for task {t!r} (was it written by a run without "
                                      f"that task?)")
            for name, p in self.heads[t].named_parameters():
                value = reader.get(f"model.task_heads.{t}.{name}")
                if value.shape != p.shape:
                    raise CheckpointError(f"task head {t}.{name} has shape {tuple(value.shape)} in "
                                          f"{reader.path / heads_file(t)}, the model expects {tuple(p.shape)}")
                with torch.no_grad():
                    p.copy_(value)
                step = reader.get(f"step.task_heads.{t}.{name}")
                if optimizer is not None and float(step) > 0:
                    optimizer.state[p] = {"step": step.reshape(()).to(p.device, copy=True), **{
                        k: reader.get(f"{k}.task_heads.{t}.{name}").to(p.device, p.dtype) for k in STATE_KEYS}}


class MultiTask:
    """The multi-task objective of this rank's tasks: their data, one forward of the shared model, each task's
    rows through its head (`head_state`), per-task losses and timing."""

    def __init__(self, cfg: MoesysConfig, layout: TaskLayout, groups: ParallelGroups, device: torch.device):
        self.cfg, self.layout, self.rank, self.world = cfg, layout, groups.rank, groups.world_size
        self.local = layout.tasks_of(self.rank)
        if not self.local:
            raise AllocationError(f"rank {self.rank} has no task in the layout {layout.ranks}")
        self.head_state = TaskHeadState(cfg, layout, groups, device, self.local)
        self.data: dict[str, TokenDataset] = build_task_datasets(
            {t: cfg.tasks[t].data for t in self.local}, cfg.train.seq_len, cfg.train.seed, cfg, run_tokenizer(cfg))
        self.last_losses: dict[str, torch.Tensor] = {}
        self.last_compute_s = 0.0

    @property
    def heads(self) -> nn.ModuleDict:
        return self.head_state.heads

    def parameters(self) -> list[nn.Parameter]:
        return self.head_state.parameters()

    def load(self, checkpoint: Path | CheckpointReader, optimizer: torch.optim.Optimizer | None) -> None:
        """The heads from a checkpoint (TaskHeadState.load)."""
        self.head_state.load(checkpoint, optimizer)

    @property
    def tokens_per_step(self) -> int:
        return self.layout.total_samples * self.cfg.train.seq_len

    def records(self, step: int) -> tuple[dict, list[dict]]:
        return self.step_records(step)

    def rank_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str, int]]]:
        """(inputs, targets) [n_r, S] of this rank's tasks at `step`, and (task, rows) in order."""
        seqs, rows = [], []
        for t in self.local:
            n, off = self.layout.samples(t, self.rank), self.layout.offset(t, self.rank)
            batch = sum(self.layout.batch[t])
            seqs.append(self.data[t].windows(step * batch + off, n))
            rows.append((t, n))
        s = torch.cat(seqs)
        return s[:, :-1], s[:, 1:], rows

    def forward_backward(self, model: nn.Module, step: int, device: torch.device, autocast,
                         scaler=None) -> tuple[torch.Tensor, ModelOutput]:
        """Forward this rank's samples once through the shared model, each task's rows through its head; backward.
        Returns (this rank's scaled loss, model output); the time until here is the rank's compute time."""
        began = time.perf_counter()
        inputs, targets, rows = self.rank_batch(step)
        inputs, targets = inputs.to(device), targets.to(device)
        scale = self.world / self.layout.total_samples
        with autocast:
            out = model(inputs)  # model.output is Identity: logits hold the final-norm hidden states [B, S, D]
        hidden, start = out.logits, 0
        loss = torch.zeros((), device=device)
        self.last_losses = {}
        for t, n in rows:
            with autocast:
                logits = self.heads[t](hidden[start:start + n])
            task_loss = F.cross_entropy(logits.float().flatten(0, 1), targets[start:start + n].flatten())
            self.last_losses[t] = task_loss.detach()
            loss = loss + task_loss * (scale * n)
            start += n
        total = loss + out.aux_loss.float()
        (scaler.scale(total) if scaler else total).backward()
        self.last_compute_s = time.perf_counter() - began
        return loss.detach(), out

    def step_records(self, step: int) -> tuple[dict, list[dict]]:
        """({"task_loss": {task: mean loss}}, one {"step", "rank", "task", "samples_per_s"} line per rank and
        task); collective. samples_per_s is the rank's samples (all its tasks) over its compute time before the
        gradient sync. With expert_parallel > 1 that time includes waiting for slower ranks in every MoE layer's
        AlltoAll, which hides imbalance; measure workloads for `moesys rebalance --from-run` with
        topology.expert_parallel=1."""
        tasks, w = self.layout.tasks, self.world
        flat = torch.zeros(len(tasks) + w, dtype=torch.float64)
        for t, loss in self.last_losses.items():
            flat[tasks.index(t)] = float(loss) * self.layout.samples(t, self.rank)
        flat[len(tasks) + self.rank] = self.last_compute_s
        if w > 1:
            dist.all_reduce(flat)
        values = flat.tolist()
        task_loss = {t: values[i] / sum(self.layout.batch[t]) for i, t in enumerate(tasks)}
        lines = []
        for r in range(w):
            compute = max(values[len(tasks) + r], 1e-9)
            speed = self.layout.rank_samples(r) / compute
            lines += [{"step": step, "rank": r, "task": t, "samples": self.layout.samples(t, r),
                       "compute_s": compute, "samples_per_s": speed} for t in self.layout.tasks_of(r)]
        return {"task_loss": task_loss}, lines


def build_multitask(cfg: MoesysConfig, model: nn.Module, groups: ParallelGroups, device: torch.device,
                    counts: Mapping[str, int] | None = None) -> MultiTask:
    """Lay out the tasks (`counts`: ranks per task from the recorded plan), give the model an identity output (the
    task heads project instead), build the heads."""
    layout = task_layout(cfg, groups.world_size, counts)
    model.output = nn.Identity()
    return MultiTask(cfg, layout, groups, device)


def add_heads_to_optimizer(optimizer: torch.optim.Optimizer, tasks: MultiTask, cfg: MoesysConfig) -> None:
    optimizer.add_param_group({"params": tasks.parameters(), "weight_decay": cfg.train.weight_decay})
