"""The training loop: the objective's forward and backward, the parts' reductions, the global-norm clip, AdamW,
metrics and checkpoints. The loop names no feature: what differs between runs lives in the parts
(runtime/train/parts.py), so the update equals single-process training on the global batch for every layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.config import MoesysConfig
from runtime.errors import JobError
from runtime.storage.optim import lr_at
from runtime.parallel.groups import ParallelGroups
from runtime.parallel.timeouts import is_timeout, timeout_error
from runtime.plan.placement import read as read_placement
from runtime.train.evaluate import evaluation
from runtime.train.build import Components, build_components
from runtime.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from runtime.train.init_from import InitialWeights
from runtime.train.metrics import MetricsWriter, memory_bytes, start_marks, step_stats
from runtime.train.rank_memory import RankMemory
from runtime.train.parts import global_grad_norm
from runtime.train.loss_scale import DynamicLossScale
from runtime.train.tensorboard import open_tensorboard
from runtime.model.precision import PRECISION_DTYPES



class StopRequest:
    """SIGTERM / SIGINT set a flag; the loop checkpoints at the end of the step and exits cleanly."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, groups: ParallelGroups, diverged: bool = False) -> tuple[bool, bool]:
        """(stop, diverged), true on every rank once any rank was asked to stop or saw a non-finite loss."""
        flags = torch.tensor([float(self.requested), float(diverged)])
        if groups.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])


def _check_finite(step: int, lm_loss: torch.Tensor, aux_loss: torch.Tensor, diverged_anywhere: bool) -> None:
    """Stop every rank at the first step whose loss is not finite, before the optimizer applies it: the last good
    checkpoint stays the newest one, and resuming would only diverge again."""
    if not diverged_anywhere:
        return
    lm, aux = float(lm_loss), float(aux_loss)
    which = ("language-model loss" if not math.isfinite(lm) else "router loss" if not math.isfinite(aux)
             else "loss on another rank")
    raise JobError(f"non-finite {which} at step {step} (lm loss {lm:.4g}, router loss {aux:.4g}); stopped before "
                   "the optimizer step, the newest checkpoint is the last good one (lower train.lr or check the data)")


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISION_DTYPES[precision])


def forward_backward(c: Components, cfg: MoesysConfig, groups: ParallelGroups, step: int, device: torch.device,
                     scaler: DynamicLossScale | None = None) -> tuple[torch.Tensor, object]:
    """Loss and complete gradients of this rank's share of `step`. Returns (lm loss, model output)."""
    lm_loss, out = c.objective.forward_backward(c.model, step, device, _autocast(device, cfg.train.precision), scaler)
    for part in c.parts:
        part.after_backward()
    return lm_loss, out


def optimizer_step(c: Components, cfg: MoesysConfig, groups: ParallelGroups, step: int,
                   scaler: DynamicLossScale | None = None) -> float:
    """Clip by the global gradient norm and apply AdamW with the scheduled learning rate. Returns the norm. With a
    loss scale (fp16), a step whose gradients overflowed anywhere is skipped on every rank and part."""
    tr = cfg.train
    scale = scaler.value if scaler else 1.0
    norm = global_grad_norm(c.parts) / scale
    if scaler and not scaler.update(norm):
        for part in c.parts:
            part.skip_step()
        c.optimizer.zero_grad(set_to_none=True)
        return norm
    if not math.isfinite(norm):  # equal on every rank (reduced gradients): all stop here
        raise JobError(f"non-finite gradient norm at step {step + 1}; stopped before the optimizer step, the newest "
                       "checkpoint is the last good one (lower train.lr or check the data)")
    multiplier = 1 / scale if scaler else None  # what every gradient is multiplied by: unscale, then clip
    if tr.grad_clip > 0 and norm > tr.grad_clip:
        multiplier = (multiplier or 1.0) * tr.grad_clip / (norm + 1e-6)
    if multiplier is not None:
        for part in c.parts:
            part.scale_grads(multiplier)
    lr = lr_at(step, tr)
    for group in c.optimizer.param_groups:
        group["lr"] = lr
    for part in c.parts:
        part.before_optimizer_step(step, lr, multiplier)
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)
    return norm


def train(cfg: MoesysConfig, run_dir: Path, groups: ParallelGroups, device: torch.device) -> dict:
    """Train until train.max_steps or a stop request; resume from the run directory's latest checkpoint."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(Path(run_dir).resolve())))
    stop = StopRequest()
    memory = RankMemory(run_dir, groups.rank, device).start()  # this worker's peak, building included
    ckpt = latest_checkpoint(run_dir)
    initial = InitialWeights(cfg.train.init_from) if ckpt is None and cfg.train.init_from else None
    try:
        c = build_components(cfg, groups, device, read_placement(run_dir),  # plan.json: decided once, by moesys train
                             resuming=ckpt is not None, initial=initial)
    finally:
        if initial is not None:
            initial.close()
    start = 0
    if ckpt is not None:
        start = load_checkpoint(ckpt, c.model, c.optimizer, groups, parts=c.parts)
    else:
        torch.manual_seed(cfg.train.seed + 1 + groups.rank)  # router noise differs per rank
    scaler = DynamicLossScale() if cfg.train.precision == "fp16" else None
    writer = MetricsWriter(run_dir, start) if groups.rank == 0 else None
    board = open_tensorboard(cfg, run_dir, start) if writer else None
    marks = start_marks(start)  # on the first line this worker writes
    evaluate = evaluation(cfg, groups, device)  # held-out loss at its steps, {} at the others
    tr = cfg.train
    tokens_per_step = c.objective.tokens_per_step
    step, last_ckpt = start, ckpt
    try:
        for step in range(start + 1, tr.max_steps + 1):
            began = time.perf_counter()
            lm_loss, out = forward_backward(c, cfg, groups, step - 1, device, scaler)
            aux_loss = out.aux_loss.detach().float()
            stopping, diverged = stop.agreed(groups, not bool(torch.isfinite(lm_loss + aux_loss)))
            _check_finite(step, lm_loss, aux_loss, diverged)
            norm = optimizer_step(c, cfg, groups, step - 1, scaler)
            part_stats = {k: v for part in c.parts for k, v in part.metrics().items()}
            stats = step_stats(lm_loss, out, groups, memory_bytes(device),
                               memory.per_rank(sum(part.disk_bytes() for part in c.parts)))
            stats.update(part_stats)
            objective_stats, rank_lines = c.objective.records(step)  # collective
            stats.update(objective_stats)
            elapsed = time.perf_counter() - began
            stats.update(evaluate(step, c.model, _autocast(device, tr.precision)))  # collective
            if writer:
                record = {"step": step, "max_steps": tr.max_steps, **stats, "grad_norm": norm,
                          "lr": lr_at(step - 1, tr), "tokens_per_s": tokens_per_step / elapsed,
                          "step_time_s": elapsed, **marks}
                marks = {}
                if rank_lines:  # per-rank task speeds first, the step line last (readers follow the last line)
                    writer.write_many([*rank_lines, record])
                else:
                    writer.write(record)
                if board:
                    board.write(record, rank_lines)
            ending = (step == tr.max_steps or stopping) and tr.final_checkpoint
            if (tr.checkpoint_every and step % tr.checkpoint_every == 0) or ending:
                last_ckpt = save_checkpoint(run_dir, step, c.model, c.optimizer, groups, cfg, parts=c.parts)
            if stopping:
                break
    except RuntimeError as exc:
        if is_timeout(exc):  # one line naming the collective and the step, not gloo's
            raise timeout_error(exc, step, tr.collective_timeout_s) from exc
        raise
    finally:  # also on an error: no background work may outlive the run
        for part in c.parts:
            part.close()
        memory.close()
        if board:
            board.close()
    return {"steps": step, "stopped_early": step < tr.max_steps,
            "checkpoint": str(last_ckpt) if last_ckpt else None}
