"""The step time and tokens/s a plan predicts for a config, from runtime/plan/step_time.py's terms: for the mode the
plan chose, and for every storage mode beside resident training (`moesys plan`'s step-time lines)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from runtime.config import MoesysConfig
from runtime.plan.modes import MODES, OffloadMode
from runtime.plan.planner import RankEstimate, fit_training
from runtime.plan.step_time import (
    Rates,
    StepBound,
    StepWork,
    compute_seconds,
    offloaded_step_work,
    step_bound,
    tokens_per_rank,
)


@dataclass(frozen=True)
class Prediction:
    """One mode's predicted optimizer step."""

    mode: OffloadMode
    bound: StepBound
    tokens_per_step: int
    fits: bool
    problems: tuple[str, ...] = ()

    @property
    def step_s(self) -> float:
        return self.bound.bound_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self, resident: Prediction | None = None) -> dict:
        out = {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "bound_term": self.bound.bound_term,
               "terms_s": dict(self.bound.terms_s), "fits": self.fits}
        if resident is not None and self.step_s > 0:
            out["vs_none"] = resident.step_s / self.step_s
        return out


def predict_step(cfg: MoesysConfig, mode: OffloadMode, est: RankEstimate, rates: Rates, moe_layers: int) -> StepBound:
    """The step of `cfg` in `mode` with the plan's per-rank estimate `est` (its offloaded experts, SSD cache and
    device window)."""
    tokens = tokens_per_rank(cfg)
    if not mode.offloaded:
        return step_bound(StepWork(compute_s=compute_seconds(cfg, rates, tokens)), rates)
    cache = est.cache_experts if mode is OffloadMode.SSD else None
    work = offloaded_step_work(cfg, rates, est.local_experts, cache, est.expert_window,
                               moe_layers - est.resident_layers, tokens)
    return step_bound(work, rates)


def predict(cfg: MoesysConfig, rates: Rates) -> Prediction:
    """The step of the mode the plan chooses for `cfg` (storage.offload, or auto's first that fits)."""
    mode, est, problems, p = fit_training(cfg)
    return Prediction(mode, predict_step(cfg, mode, est, rates, p.moe_layers), global_tokens(cfg), not problems,
                      tuple(problems))


def global_tokens(cfg: MoesysConfig) -> int:
    """Tokens every rank together computes in an optimizer step."""
    return tokens_per_rank(cfg) * cfg.topology.world_size


def with_mode(cfg: MoesysConfig, mode: OffloadMode) -> MoesysConfig:
    """cfg with storage.offload=mode (its storage.resident_layers and delayed update dropped where they need an
    offloaded mode)."""
    st = cfg.storage
    offloaded = mode.offloaded
    storage = dataclasses.replace(st, offload=mode.value, resident_layers=st.resident_layers if offloaded else 0,
                                  delayed_update=st.delayed_update and mode is OffloadMode.CPU,
                                  direct_io=st.direct_io or mode is OffloadMode.SSD)
    return dataclasses.replace(cfg, storage=storage)


def predict_modes(cfg: MoesysConfig, rates: Rates) -> dict[str, dict]:
    """Every storage mode's predicted step for `cfg`'s batch and split, beside resident training (none): what
    `moesys plan --json` reports as step_time."""
    predictions = {str(mode): predict(with_mode(cfg, mode), rates) for mode in MODES}
    resident = predictions[str(OffloadMode.NONE)]
    return {name: p.to_dict(resident) for name, p in predictions.items()}
