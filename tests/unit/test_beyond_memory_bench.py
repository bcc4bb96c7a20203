"""The beyond-memory benchmark's model: expert states at least `ratio` x the memory, the fewest experts that do it,
and a plan that fits in the share of the cap it is given (the run itself is `moesys bench beyond-memory`)."""

from __future__ import annotations

from pathlib import Path

from moesys_cli.resolve import resolve_config
from runtime.bench.beyond_memory import PLANNED_SHARE, TOKENS_PER_RANK, _experts_for, _overrides
from runtime.plan.params import count_parameters
from runtime.plan.planner import plan_placement


def test_the_model_outgrows_the_memory_and_its_plan_fits_the_cap():
    ram = 24 * 2**30
    experts = _experts_for(1.5, ram)
    alpha = 2 * TOKENS_PER_RANK / experts
    cfg = resolve_config(_overrides(experts, alpha, Path("/tmp/unused"), 3, PLANNED_SHARE * 0.75 * ram / 1e9,
                                    Path("data.txt")))
    states = 12 * count_parameters(cfg.model).sparse
    assert experts % 2 == 0 and 1.5 * ram <= states < 1.6 * ram
    fewer = cfg.model.num_experts - 2
    assert states * fewer / experts < 1.5 * ram  # the fewest experts that do it
    plan = plan_placement(cfg)
    assert plan.feasible, plan.problems
    assert plan.mode == "ssd" and plan.per_rank.cache_experts < plan.per_rank.local_experts
