"""The beyond-memory benchmark's model: expert states at least `ratio` x the memory, the fewest experts that do it,
and a plan that fits in the share of the cap it is given (the run itself is `moesys bench beyond-memory`); its config is
what `moesys train` resolves from the same settings."""

from __future__ import annotations

from pathlib import Path

from moesys_cli.resolve import resolve_config
from runtime.bench.beyond_memory import FFN, GPT_LAYOUT, HEADS, HIDDEN, LAYERS, PLANNED_SHARE, TOKENS_PER_RANK, \
    _experts_for, bench_config
from runtime.config import config_to_dict
from runtime.plan.params import count_parameters
from runtime.plan.planner import plan_placement


def test_the_model_outgrows_the_memory_and_its_plan_fits_the_cap():
    ram = 24 * 2**30
    experts = _experts_for(1.5, ram)
    alpha = 2 * TOKENS_PER_RANK / experts
    cfg = bench_config(resolve_config([]), experts, alpha, Path("/tmp/unused"), 3, PLANNED_SHARE * 0.75 * ram / 1e9,
                       Path("data.txt"))
    states = 12 * count_parameters(cfg.model).sparse
    assert experts % 2 == 0 and 1.5 * ram <= states < 1.6 * ram
    fewer = cfg.model.num_experts - 2
    assert states * fewer / experts < 1.5 * ram  # the fewest experts that do it
    plan = plan_placement(cfg)
    assert plan.feasible, plan.problems
    assert plan.mode == "ssd" and plan.per_rank.cache_experts < plan.per_rank.local_experts


def test_the_capped_run_is_configured_as_moesys_train_resolves_the_same_settings():
    experts, alpha, memory_gb = 500, 0.125, 12.34
    overrides = ["recipe=tiny", "topology=single", "train.data=data.txt", f"topology.cpu_memory_gb={memory_gb}",
                 "topology.nproc_per_node=2", "topology.expert_parallel=2", f"model.hidden_size={HIDDEN}",
                 f"model.ffn_hidden_size={FFN}", f"model.num_layers={LAYERS}", f"model.num_heads={HEADS}",
                 f"model.num_experts={experts}", "model.top_k=1", "model.max_seq_len=64",
                 f"train.seq_len={TOKENS_PER_RANK}", "train.micro_batch_size=1", "train.max_steps=3",
                 "train.warmup_steps=100", "train.checkpoint_every=0", "train.final_checkpoint=false",
                 "train.max_restarts=0", "storage.offload=ssd", f"storage.alpha={alpha}", "train.run_dir=/tmp/unused",
                 *(f"model.{key}={str(value).lower()}" for key, value in GPT_LAYOUT.items())]
    built = bench_config(resolve_config([]), experts, alpha, Path("/tmp/unused"), 3, memory_gb, Path("data.txt"))
    assert config_to_dict(built) == config_to_dict(resolve_config(overrides))
