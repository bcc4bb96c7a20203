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
from torch.profiler import record_function

from runtime.config import MoesysConfig
from runtime.errors import JobError
from runtime.model.precision import PRECISION_DTYPES
from runtime.model.transformer import ModelOutput
from runtime.parallel.groups import ParallelGroups
from runtime.parallel.timeouts import is_timeout, timeout_error
from runtime.plan.placement import read as read_placement
from runtime.storage.optim import lr_at
from runtime.train.build import Components, build_components
from runtime.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from runtime.train.evaluate import evaluation
from runtime.train.init_from import InitialWeights
from runtime.train.loss_scale import DynamicLossScale
from runtime.train.meter import StepMeter
from runtime.train.metrics import MetricsWriter, memory_bytes, start_marks, step_stats
from runtime.train.micro_batches import run_micro_batches
from runtime.train.parts import global_grad_norm
from runtime.train.rank_memory import RankMemory
from runtime.train.tensorboard import open_tensorboard


class StopRequest:
    """SIGTERM / SIGINT set a flag; the loop checkpoints at the end of the step and exits cleanly."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, groups: ParallelGroups, diverged: bool = False) -> tuple[bool, bool]:
        """(stop, diverged), true on every rank once any rank was asked to stop or saw a non-finite loss (one
        all-reduce of two host flags; none on one process)."""
        if groups.world_size == 1:
            return self.requested, diverged
        flags = torch.tensor([float(self.requested), float(diverged)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])


def _divergence(bad: tuple[int, float, float, float], step: int) -> JobError:
    """The one-line error of a run whose loss or gradient norm stopped being finite (StepMeter.first_bad; step 0:
    on another rank, seen at `step`)."""
    at, kind, lm, aux = bad
    if kind == StepMeter.NORM:
        return JobError(f"non-finite gradient norm at step {at}; stopped before the optimizer step, the newest "
                        "checkpoint is the last good one (lower train.lr or check the data)")
    which = ("loss on another rank" if not at else "language-model loss" if not math.isfinite(lm)
             else "router loss" if not math.isfinite(aux) else "loss on another rank")
    return JobError(f"non-finite {which} at step {at or step} (lm loss {lm:.4g}, router loss {aux:.4g}); stopped "
                    "before the optimizer step, the newest checkpoint is the last good one (lower train.lr or check "
                    "the data)")


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISION_DTYPES[precision])


def forward_backward(c: Components, cfg: MoesysConfig, groups: ParallelGroups, step: int, device: torch.device,
                     scaler: DynamicLossScale | None = None) -> tuple[torch.Tensor, ModelOutput]:
    """Loss and complete gradients of this rank's share of `step` (its micro-batches, train.grad_accum_steps).
    Returns (lm loss, model output), averaged over the micro-batches."""
    lm_loss, out = run_micro_batches(c, step, device, _autocast(device, cfg.train.precision), scaler)
    for part in c.parts:
        part.after_backward()
    return lm_loss, out


def update(c: Components, cfg: MoesysConfig, groups: ParallelGroups, step: int,
           scaler: DynamicLossScale | None = None, check: bool = True) -> torch.Tensor:
    """Clip by the global gradient norm and apply AdamW with the scheduled learning rate. Returns the norm, a 0-d
    tensor on the device: nothing is read back to the host (unless `check`: a non-finite norm then stops the run
    before the optimizer step; a loss scale reads it too). With a loss scale (fp16), a step whose gradients
    overflowed anywhere is skipped on every rank and part."""
    tr = cfg.train
    norm = global_grad_norm(c.parts, next(c.model.parameters()).device)
    if scaler:
        return torch.tensor(_scaled_update(c, cfg, step, scaler, float(norm)), dtype=torch.float64)
    if check and not bool(torch.isfinite(norm)):  # equal on every rank (reduced gradients): all stop here
        raise _divergence((step + 1, StepMeter.NORM, math.nan, math.nan), step + 1)
    multiplier = (torch.where(norm > tr.grad_clip, tr.grad_clip / (norm + 1e-6), 1.0) if tr.grad_clip > 0
                  else torch.ones_like(norm))  # exactly 1 below the clip: the gradients unchanged
    _apply(c, tr, step, multiplier)
    return norm


def _scaled_update(c: Components, cfg: MoesysConfig, step: int, scaler: DynamicLossScale, norm: float) -> float:
    """`update` with a loss scale: the norm is read on the host, which decides whether the step is applied."""
    tr = cfg.train
    norm = norm / scaler.value
    if not scaler.update(norm):
        for part in c.parts:
            part.skip_step()
        c.optimizer.zero_grad(set_to_none=True)
        return norm
    if not math.isfinite(norm):
        raise _divergence((step + 1, StepMeter.NORM, math.nan, math.nan), step + 1)
    multiplier = 1 / scaler.value  # what every gradient is multiplied by: unscale, then clip
    if tr.grad_clip > 0 and norm > tr.grad_clip:
        multiplier *= tr.grad_clip / (norm + 1e-6)
    _apply(c, tr, step, multiplier)
    return norm


def _apply(c: Components, tr, step: int, multiplier) -> None:
    for part in c.parts:
        part.scale_grads(multiplier)
    lr = lr_at(step, tr)
    for group in c.optimizer.param_groups:
        group["lr"] = lr
    for part in c.parts:
        part.before_optimizer_step(step, lr, multiplier)
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)


def optimizer_step(c: Components, cfg: MoesysConfig, groups: ParallelGroups, step: int,
                   scaler: DynamicLossScale | None = None) -> float:
    """`update`, its norm read back as a float."""
    return float(update(c, cfg, groups, step, scaler))


def metrics_due(step: int, tr) -> bool:
    """Whether `step` writes a metrics line: every train.log_every steps, at the last step and at evaluations."""
    evaluating = bool(tr.eval_data) and bool(tr.eval_every) and step % tr.eval_every == 0
    return step % tr.log_every == 0 or step == tr.max_steps or evaluating


def _stop_agreed(stop: StopRequest, groups: ParallelGroups, meter: StepMeter, sync: bool, step: int) -> bool:
    """Whether every rank stops after this step (a stop request anywhere). At a step that syncs anyway (a metrics
    line, a checkpoint, the last step, a stop), first the divergence check: a loss or norm that was not finite since
    the last line, on any rank, stops the run with its error (the only host read of the step)."""
    bad = meter.first_bad() if sync else (0, 0.0, 0.0, 0.0)
    stopping, diverged = stop.agreed(groups, bad[0] > 0)
    if stopping and not sync:
        bad = meter.first_bad()
        _, diverged = stop.agreed(groups, bad[0] > 0)
    if diverged:
        raise _divergence(bad, step)
    return stopping


def _line(c: Components, groups: ParallelGroups, meter: StepMeter, device: torch.device, memory: RankMemory,
          step: int) -> tuple[dict, list[dict]]:
    """A metrics line's values over the steps since the last one (collective: every rank calls it), with their count
    under `steps`, and the objective's extra lines."""
    lm_loss, out, norm, steps = meter.take()
    per_rank = memory.per_rank(sum(part.disk_bytes() for part in c.parts))
    stats = step_stats(lm_loss, out, groups, memory_bytes(device), per_rank)
    stats.update({k: v for part in c.parts for k, v in part.metrics().items()})
    objective_stats, rank_lines = c.objective.records(step)  # collective
    stats.update(objective_stats)
    return {**stats, "grad_norm": norm, "steps": steps}, rank_lines


def _write(writer: MetricsWriter, board, record: dict, rank_lines: list[dict]) -> None:
    if rank_lines:  # per-rank task speeds first, the step line last (readers follow the last line)
        writer.write_many([*rank_lines, record])
    else:
        writer.write(record)
    if board:
        board.write(record, rank_lines)


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
    meter, interval_s = StepMeter(), 0.0  # what the next metrics line reports, summed on the device
    try:
        for step in range(start + 1, tr.max_steps + 1):
            began = time.perf_counter()
            with record_function(f"moesys.step {step}"):  # a profiler's marker; nothing when none runs
                lm_loss, out = forward_backward(c, cfg, groups, step - 1, device, scaler)
                meter.add_step(step, lm_loss, out)
                logging, saving = metrics_due(step, tr), tr.checkpoint_every and step % tr.checkpoint_every == 0
                sync = bool(logging or saving) or step == tr.max_steps
                stopping = _stop_agreed(stop, groups, meter, sync, step)
                meter.add_norm(step, update(c, cfg, groups, step - 1, scaler, check=sync or stopping))
            if logging or stopping:
                stats, rank_lines = _line(c, groups, meter, device, memory, step)  # the device catches up here
            interval_s += time.perf_counter() - began
            if logging or stopping:
                stats.update(evaluate(step, c.model, _autocast(device, tr.precision)))  # collective
                steps = stats.pop("steps")
                record = {"step": step, "max_steps": tr.max_steps, **stats, "lr": lr_at(step - 1, tr),
                          "tokens_per_s": tokens_per_step * steps / interval_s, "step_time_s": interval_s / steps,
                          **marks}
                marks, interval_s = {}, 0.0
                if writer:
                    _write(writer, board, record, rank_lines)
            ending = (step == tr.max_steps or stopping) and tr.final_checkpoint
            if saving or ending:
                last_ckpt = save_checkpoint(run_dir, step, c.model, c.optimizer, groups, cfg, parts=c.parts)
            if stopping:
                break
    except RuntimeError as exc:
        if is_timeout(exc):  # one line naming the collective and the step, not gloo's
            raise timeout_error(exc, step, tr.collective_timeout_s) from exc
        raise
    finally:  # also on an error: no background work may outlive the run, and a close that raises skips no other
        with contextlib.ExitStack() as closing:
            if board:
                closing.callback(board.close)
            closing.callback(memory.close)
            for part in reversed(c.parts):  # (the stack runs them last in first out: the parts first, in order)
                closing.callback(part.close)
    return {"steps": step, "stopped_early": step < tr.max_steps,
            "checkpoint": str(last_ckpt) if last_ckpt else None}
