"""The optimizer's definition, held once: AdamW hyper-parameters, the learning-rate schedule, and the per-expert
AdamW update that offloaded experts run on the CPU (the resident model runs torch's AdamW with the same numbers)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def lr_at(step: int, tr) -> float:
    """Linear warm-up, then cosine decay to train.min_lr at train.max_steps (step counts from 0)."""
    if step < tr.warmup_steps:
        return tr.lr * (step + 1) / tr.warmup_steps
    progress = (step - tr.warmup_steps) / max(1, tr.max_steps - tr.warmup_steps)
    return tr.min_lr + 0.5 * (tr.lr - tr.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def expert_adamw_step(state: dict[str, torch.Tensor], names: tuple[str, ...], grads: list[torch.Tensor],
                      lr: float, h: AdamWHyper) -> None:
    """One AdamW step of an expert's state dict (param.N, exp_avg.N, exp_avg_sq.N, step), in place; torch's
    single-tensor kernel, so the numbers equal what torch.optim.AdamW computes for the stacked resident tensor."""
    steps = [state["step"].clone() for _ in names]
    adam([state[f"param.{n}"] for n in names], grads, [state[f"exp_avg.{n}"] for n in names],
         [state[f"exp_avg_sq.{n}"] for n in names], [], steps, foreach=False, decoupled_weight_decay=True,
         amsgrad=False, beta1=h.betas[0], beta2=h.betas[1], lr=lr, weight_decay=h.weight_decay, eps=h.eps,
         maximize=False)
    state["step"] = steps[0]


def catch_up(state: dict[str, torch.Tensor], names: tuple[str, ...], upto: int, lr_schedule, h: AdamWHyper) -> int:
    """Apply the zero-gradient AdamW steps an expert missed while it received no tokens (its own step count is
    below `upto`): resident AdamW steps every expert every iteration, decaying its weights and moments, so an
    offloaded expert fetched only when active must do the same to train identically. Returns the steps applied."""
    done = int(state["step"])
    if done >= upto:
        return 0
    zeros = [torch.zeros_like(state[f"param.{n}"]) for n in names]
    for step in range(done, upto):
        expert_adamw_step(state, names, zeros, lr_schedule(step), h)
    return upto - done
