"""What a metrics line reports, kept on the device until it is written: the losses, router losses and gate metrics
of the steps since the last line (and of the micro-batches of a step) added up where they were computed, so that a
step between two lines reads nothing back to the host (train.log_every)."""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.model.transformer import ModelOutput
from runtime.moe.layer import MoEStats


def _add(a: Tensor | None, b: Tensor) -> Tensor:
    b = b.detach().float()
    return b if a is None else a + b


def _sum_stats(total: list[MoEStats] | None, stats: list[MoEStats]) -> list[MoEStats]:
    """Each MoE layer's router losses and gate metrics added to `total`'s (None: the first)."""
    previous: list[MoEStats | None] = [None] * len(stats) if total is None else list(total)
    return [MoEStats(_add(t.aux_loss if t else None, s.aux_loss),
                     {n: _add(t.losses[n] if t else None, v) for n, v in s.losses.items()},
                     {n: _add(t.metrics[n] if t else None, v) for n, v in s.metrics.items()})
            for t, s in zip(previous, stats, strict=True)]


def _scaled(stats: list[MoEStats], factor: float) -> list[MoEStats]:
    return [MoEStats(s.aux_loss * factor, {n: v * factor for n, v in s.losses.items()},
                     {n: v * factor for n, v in s.metrics.items()}) for s in stats]


class OutputSum:
    """The sum of several model outputs' losses and gate metrics (detached, fp32, on their device), and their mean."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start anew: nothing added."""
        self.count = 0
        self.lm_loss: Tensor | None = None
        self.aux_loss: Tensor | None = None
        self.stats: list[MoEStats] | None = None

    def add(self, lm_loss: Tensor, out: ModelOutput) -> None:
        self.count += 1
        self.lm_loss = _add(self.lm_loss, lm_loss)
        self.aux_loss = _add(self.aux_loss, out.aux_loss)
        self.stats = _sum_stats(self.stats, out.moe_stats)

    def mean(self) -> tuple[Tensor, ModelOutput]:
        """(mean language-model loss, a ModelOutput of the mean router losses and gate metrics, without logits)."""
        factor = 1.0 / max(1, self.count)
        if self.lm_loss is None or self.aux_loss is None:
            raise RuntimeError("the mean of no model output: add() one first")
        return self.lm_loss * factor, ModelOutput(self.lm_loss.new_empty(0), self.aux_loss * factor,
                                                  _scaled(self.stats or [], factor))


class StepMeter(OutputSum):
    """OutputSum over the optimizer steps since the last metrics line, with their gradient norms and the first step
    whose loss or norm was not finite, all on the device."""

    LOSS, NORM = 1.0, 2.0
    """What was not finite (the second entry of `bad`)."""

    def reset(self) -> None:
        super().reset()
        self.norm: Tensor | None = None
        self.bad: Tensor | None = None
        """float64 [step, LOSS or NORM, lm loss, router loss] of the first step that was not finite (step 0: none)."""

    def add_step(self, step: int, lm_loss: Tensor, out: ModelOutput) -> None:
        self.add(lm_loss, out)
        lm, aux = lm_loss.detach().double(), out.aux_loss.detach().double()
        self._flag(step, torch.isfinite(lm + aux), self.LOSS, lm, aux)

    def add_norm(self, step: int, norm: Tensor) -> None:
        norm = norm.detach().double().reshape(())
        self.norm = norm if self.norm is None else self.norm + norm
        self._flag(step, torch.isfinite(norm), self.NORM, norm, norm)

    def _flag(self, step: int, finite: Tensor, kind: float, lm: Tensor, aux: Tensor) -> None:
        new = torch.stack([torch.where(finite, 0.0, float(step)).double(), torch.full_like(lm, kind), lm, aux])
        self.bad = new if self.bad is None else torch.where(self.bad[0] > 0, self.bad, new)

    def first_bad(self) -> tuple[int, float, float, float]:
        """(step, LOSS or NORM, lm loss, router loss) of the first step since the last line whose loss or norm was not
        finite, step 0 when none: a host read."""
        if self.bad is None:
            return 0, 0.0, 0.0, 0.0
        step, kind, lm, aux = self.bad.tolist()
        return int(step), kind, lm, aux

    def take(self) -> tuple[Tensor, ModelOutput, float, int]:
        """(mean loss, mean output, mean gradient norm, steps) of the steps since the last line; starts anew."""
        lm_loss, out = self.mean()
        norm = float(self.norm) / self.count if self.norm is not None else 0.0
        steps = self.count
        self.reset()
        return lm_loss, out, norm, steps
