"""The optimizer's definition, held once: AdamW hyper-parameters, the learning-rate schedule, and the per-expert
AdamW update that offloaded experts run on the CPU (the resident model runs torch's fused AdamW with the same
numbers)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.optim.adam import adam

ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8


@dataclass(frozen=True)
class AdamWHyper:
    betas: tuple[float, float] = ADAMW_BETAS
    eps: float = ADAMW_EPS
    weight_decay: float = 0.01
    """Every expert tensor decays: the resident model stacks them ([e, ...], two or more dims)."""


def square_sum(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's fp32 sum of squares, its share of the global norm the clip uses: one pass, no temporary (the
    norm squared), and the same function for every part, offloaded experts included, so equal tensors give equal
    numbers."""
    return torch.linalg.vector_norm(grad, dtype=torch.float32).square()


def lr_at(step: int, tr) -> float:
    """Linear warm-up, then train.lr_schedule: cosine or linear decay to train.min_lr at train.max_steps, or
    constant (step counts from 0)."""
    if step < tr.warmup_steps:
        return tr.lr * (step + 1) / tr.warmup_steps
    if tr.lr_schedule == "constant":
        return tr.lr
    progress = min((step - tr.warmup_steps) / max(1, tr.max_steps - tr.warmup_steps), 1.0)
    if tr.lr_schedule == "linear":
        return tr.lr + (tr.min_lr - tr.lr) * progress
    return tr.min_lr + 0.5 * (tr.lr - tr.min_lr) * (1 + math.cos(math.pi * progress))


def fused_adamw(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lr: float, h: AdamWHyper,
                grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step of each (param, grad, moments, step count) in place, with torch's fused kernel: the kernel the
    resident model's AdamW runs (build_optimizer), so offloaded experts get the same numbers. `grad_scale`: the
    gradients are divided by it first, inside the kernel."""
    adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, grad_scale=grad_scale,
         decoupled_weight_decay=True, amsgrad=False, beta1=h.betas[0], beta2=h.betas[1], lr=lr,
         weight_decay=h.weight_decay, eps=h.eps, maximize=False)


def fused_adamw_counted(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                        exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lr: float, h: AdamWHyper,
                        grad_scale: torch.Tensor | None = None) -> None:
    """`fused_adamw`'s kernel alone, on step counts the caller has already advanced: one count may then serve
    several tensors (an expert's w1, w2, b1, ...), with no per-tensor copy of it to add to and copy back. The
    numbers are fused_adamw's: it too adds 1 to each count, then calls this kernel."""
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=h.betas[0], beta2=h.betas[1],
                        weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                        found_inf=None)


CATCH_UP_CHUNK = 1 << 20
"""Elements of an expert's states taken through all of its missed steps before the next ones are read: 16 MB of
master, moments and zero gradient, which stay in cache from one step to the next, so a catch-up of k steps reads
memory once instead of k times (the kernel is elementwise: the same numbers as k whole passes)."""


@functools.lru_cache(maxsize=8)
def _zeros(numel: int) -> torch.Tensor:
    """A zero gradient of `numel` fp32 elements, kept: catch-up steps only read it (a fresh one each time pays its
    page faults), and one serves every expert of that size in a kernel call."""
    return torch.zeros(numel)


class AdamWStates(Protocol):
    """What the per-expert AdamW steps: flat fp32 master weights and moments, and the step count they reached (an
    ExpertSlot is one)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor


def catch_up(slots: Sequence[AdamWStates], upto: int, lr_schedule, h: AdamWHyper,
             done: list[float] | None = None) -> int:
    """Apply the zero-gradient AdamW steps experts missed while they received no tokens (those whose step count,
    `done` when the caller has read them, is below `upto`): resident AdamW steps every expert every iteration,
    decaying its weights and moments, so an offloaded expert stepped only when active must do the same to train
    identically. The states go in pieces of at most CATCH_UP_CHUNK elements (a chunk of a large expert, or several
    small experts together), each taken through all of its missed steps while it is in cache, one kernel call per
    piece and step over all of its experts (the kernel is elementwise, with a step count per tensor: the numbers of
    stepping each expert alone). Returns the steps applied; the caller refreshes the slots' stages."""
    if done is None:
        done = torch.stack([slot.step for slot in slots]).tolist() if slots else []
    behind = [(slot, int(d)) for slot, d in zip(slots, done, strict=True) if d < upto]
    if not behind:
        return 0
    lrs = [(step, lr_schedule(step)) for step in range(min(d for _, d in behind), upto)]
    for piece in _pieces(behind):
        for step, lr in lrs:
            at = [part for part in piece if part.done <= step]
            if not at:
                continue
            counts = [part.step for part in at]
            torch._foreach_add_(counts, 1)
            fused_adamw_counted([part.master for part in at], [_zeros(part.master.numel()) for part in at],
                                [part.exp_avg for part in at], [part.exp_avg_sq for part in at], counts, lr, h)
    chunked = [(slot, d) for slot, d in behind if _in_chunks(slot)]
    if chunked:  # a whole slot's piece counted on the slot's own step; each chunk on a copy of it
        torch._foreach_add_([slot.step for slot, _ in chunked], [float(upto - d) for _, d in chunked])
    return sum(upto - d for _, d in behind)


@dataclass(frozen=True)
class _Piece:
    """Part of an expert's states that a catch-up takes through its missed steps: the whole slot, or a chunk."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    """The count the kernel reads and advances: a whole slot's own step, or a copy of it for each chunk (the
    chunks of one slot go through the same steps one after another)."""
    done: int


def _in_chunks(slot: AdamWStates) -> bool:
    """Whether a catch-up takes the slot's states in chunks (each counting on a copy of its step), not whole."""
    return slot.master.numel() > CATCH_UP_CHUNK


def _pieces(behind: list[tuple[AdamWStates, int]]) -> list[list[_Piece]]:
    """Groups of at most CATCH_UP_CHUNK elements: each chunk of an expert larger than that alone, smaller experts
    whole, several to a group."""
    groups: list[list[_Piece]] = []
    room = 0
    for slot, done in behind:
        numel = slot.master.numel()
        if _in_chunks(slot):
            for lo in range(0, numel, CATCH_UP_CHUNK):
                part = slice(lo, min(lo + CATCH_UP_CHUNK, numel))
                groups.append([_Piece(slot.master[part], slot.exp_avg[part], slot.exp_avg_sq[part],
                                      slot.step.clone(), done)])
            room = 0
            continue
        if numel > room:
            groups.append([])
            room = CATCH_UP_CHUNK
        groups[-1].append(_Piece(slot.master, slot.exp_avg, slot.exp_avg_sq, slot.step, done))
        room -= numel
    return groups
