"""The plan chooses the split, the user the batch: for the tokens a step the config asks for, the micro-batch x
accumulation, the activation recomputation and the MoE layers kept on the device that fit and give the fastest
predicted step (train.grad_accum_steps=auto, train.recompute=auto, storage.resident_layers=auto choose; a key the
user set stays), and the tokens a step from which offloaded training would reach 0.8x resident.

Tokens a step stay the user's (they change the losses and the learning rate): with grad_accum_steps=auto the
micro_batch_size sequences a rank runs per step are split into micro-batch x accumulation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from runtime.config import MoesysConfig
from runtime.config.schema import AUTO_LAYERS
from runtime.plan.machine_profile import machine_rates
from runtime.plan.modes import OffloadMode
from runtime.plan.planner import fit_training, keepable_layers
from runtime.plan.prediction import Prediction, predict, predict_step, with_mode
from runtime.plan.step_time import Rates

TARGET = 0.8
"""The share of resident tokens/s the schedule says when offloading reaches."""
RECOMPUTE_COST = {"none": 0, "moe": 1, "block": 2}
"""Order of preference at equal predicted speed: recompute no more than needed."""
MAX_ACCUM = 1 << 20


@dataclass(frozen=True)
class Schedule:
    """The split of one optimizer step and what the plan predicts for it."""

    micro_batch_size: int
    grad_accum_steps: int
    recompute: str
    resident_layers: int
    prediction: Prediction
    resident: Prediction
    """The same step with every expert on the device (fits or not): what offloading is compared with."""
    tokens_per_step_for_0_8: int | None = None
    example: tuple[int, int, str] | None = None
    """(micro-batch, accumulation, recompute) at tokens_per_step_for_0_8."""
    chosen: tuple[str, ...] = field(default_factory=tuple)
    """The keys the plan chose (those set to auto)."""

    @property
    def vs_resident(self) -> float:
        return self.resident.step_s / self.prediction.step_s if self.prediction.step_s > 0 else 0.0

    def to_dict(self) -> dict:
        """`moesys plan --json`'s schedule."""
        return {"micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps,
                "recompute": self.recompute, "resident_layers": self.resident_layers,
                "offload": str(self.prediction.mode), "tokens_per_step": self.prediction.tokens_per_step,
                "predicted_tokens_per_s": self.prediction.tokens_per_s, "predicted_vs_resident": self.vs_resident,
                "bound_term": self.prediction.bound.bound_term,
                "tokens_per_step_for_0_8": self.tokens_per_step_for_0_8, "fits": self.prediction.fits,
                "chosen": list(self.chosen)}

    def line(self) -> str:
        """One line: what bounds the step, how it compares with resident, and from what batch it would reach 0.8x."""
        p = self.prediction
        text = (f"{p.bound.bound_term} bound: {self.vs_resident:.2f}x resident at {p.tokens_per_step:,} tokens a "
                f"step (micro_batch {self.micro_batch_size} x grad_accum {self.grad_accum_steps}, recompute "
                f"{self.recompute}, {p.tokens_per_s:,.0f} tokens/s predicted)")
        if not p.mode.offloaded:
            return text
        if self.tokens_per_step_for_0_8 is None:
            return f"{text}; no batch reaches {TARGET}x: the copies grow with it"
        assert self.example is not None, "a batch that reaches the target has its example"
        m, a, r = self.example
        return (f"{text}; {TARGET}x from {self.tokens_per_step_for_0_8:,} (e.g. micro_batch {m} x grad_accum {a} "
                f"with recompute {r})")


def auto_keys(cfg: MoesysConfig) -> tuple[str, ...]:
    """The schedule's keys this config leaves to the plan."""
    return tuple(key for key, auto in (("train.grad_accum_steps", cfg.train.grad_accum_steps == 0),
                                       ("train.recompute", cfg.train.recompute == "auto"),
                                       ("storage.resident_layers", cfg.storage.resident_layers == AUTO_LAYERS))
                 if auto)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _recomputes(cfg: MoesysConfig, auto: bool) -> list[str]:
    """What validation allows with the rest of the config (runtime/config/rules.py step_schedule_combines):
    recompute=block runs an offloaded layer's forward again, which would fetch its experts again; compiled blocks and
    sharded dense states recompute nothing."""
    if not auto:
        return [cfg.train.recompute]
    if cfg.train.compile or cfg.storage.dense_shard:
        return ["none"]
    return ["none", "moe"] + ([] if cfg.storage.offload in ("cpu", "ssd") else ["block"])


def _accumulates(cfg: MoesysConfig) -> bool:
    """Whether the config may split a step into micro-batches (not multi-task heads, a distillation or sharded
    dense states)."""
    return not (cfg.tasks or cfg.distill.teacher or cfg.storage.dense_shard)


def _split(cfg: MoesysConfig, micro: int, accum: int, recompute: str, resident_layers: int | None) -> MoesysConfig:
    train = dataclasses.replace(cfg.train, micro_batch_size=micro, grad_accum_steps=accum, recompute=recompute)
    storage = dataclasses.replace(cfg.storage, resident_layers=resident_layers)
    return dataclasses.replace(cfg, train=train, storage=storage)


def _candidates(cfg: MoesysConfig):
    """Every (micro-batch, accumulation, recompute) the config leaves open."""
    tr = cfg.train
    if tr.grad_accum_steps:
        splits = [(tr.micro_batch_size, tr.grad_accum_steps)]
    elif _accumulates(cfg):
        splits = [(m, tr.micro_batch_size // m) for m in reversed(_divisors(tr.micro_batch_size))]
    else:
        splits = [(tr.micro_batch_size, 1)]
    for recompute in _recomputes(cfg, tr.recompute == "auto"):
        for micro, accum in splits:
            yield micro, accum, recompute


def _with_layers(trial: MoesysConfig, auto_layers: bool) -> MoesysConfig:
    """storage.resident_layers=auto: as many MoE layers as fit on the GPU (each one's update leaves the host)."""
    if not auto_layers:
        return trial
    mode, _, problems, p = fit_training(dataclasses.replace(trial, storage=dataclasses.replace(
        trial.storage, resident_layers=0)))
    kept = keepable_layers(trial, p, mode) if not problems else 0
    return dataclasses.replace(trial, storage=dataclasses.replace(trial.storage, resident_layers=kept))


def choose_schedule(cfg: MoesysConfig, rates: Rates | None = None) -> Schedule:
    """The fastest predicted split that fits, among those the config's auto keys leave open (a split that fits
    first; then the faster; then the larger micro-batch and the less recomputation)."""
    rates = rates or machine_rates(cfg)
    auto = auto_keys(cfg)
    auto_layers = "storage.resident_layers" in auto
    best = None
    for micro, accum, recompute in _candidates(cfg):
        layers = 0 if auto_layers else cfg.storage.resident_layers
        trial = _with_layers(_split(cfg, micro, accum, recompute, layers), auto_layers)
        prediction = predict(trial, rates)
        key = (not prediction.fits, prediction.step_s, -micro, RECOMPUTE_COST[recompute])
        if best is None or key < best[0]:
            best = (key, trial, prediction)
    assert best is not None, "there is always a split to try"
    _, trial, prediction = best
    resident = predict(with_mode(trial, OffloadMode.NONE), rates)
    reach = _tokens_for_target(trial, prediction, rates) if prediction.mode.offloaded else None
    tokens_for_target, example = reach or (None, None)
    tr, layers = trial.train, trial.storage.resident_layers
    assert layers is not None, "_with_layers chose storage.resident_layers=auto"
    return Schedule(tr.micro_batch_size, max(1, tr.grad_accum_steps), tr.recompute, layers, prediction, resident,
                    tokens_for_target, example, chosen=auto)


def _tokens_for_target(cfg: MoesysConfig, prediction: Prediction, rates: Rates) -> tuple[int, tuple] | None:
    """The fewest tokens a step at which the chosen split, accumulating more micro-batches, predicts TARGET x
    resident (its memory does not grow with accumulation); None when no accumulation gets there."""
    mode, est, _, p = fit_training(cfg)
    tr = cfg.train

    def ratio(accum: int) -> float:
        trial = dataclasses.replace(cfg, train=dataclasses.replace(tr, grad_accum_steps=accum))
        offloaded = predict_step(trial, prediction.mode, est, rates, p.moe_layers).bound_s
        resident = predict_step(trial, OffloadMode.NONE, est, rates, p.moe_layers).bound_s
        return resident / offloaded

    if ratio(MAX_ACCUM) < TARGET:
        return None
    lo, hi = 1, MAX_ACCUM
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ratio(mid) >= TARGET else (mid + 1, hi)
    tokens = tr.micro_batch_size * lo * tr.seq_len * cfg.topology.world_size
    return tokens, (tr.micro_batch_size, lo, tr.recompute)


def apply_schedule(cfg: MoesysConfig) -> MoesysConfig:
    """cfg with its auto keys replaced by the plan's choice (unchanged when it has none)."""
    return scheduled(cfg, choose_schedule(cfg)) if auto_keys(cfg) else cfg


def scheduled(cfg: MoesysConfig, s: Schedule) -> MoesysConfig:
    """cfg with the keys `s` chose set to its choice."""
    if not s.chosen:
        return cfg
    train = dataclasses.replace(cfg.train, micro_batch_size=s.micro_batch_size, grad_accum_steps=s.grad_accum_steps,
                                recompute=s.recompute)
    storage = dataclasses.replace(cfg.storage, resident_layers=s.resident_layers)
    return dataclasses.replace(cfg, train=train, storage=storage)
