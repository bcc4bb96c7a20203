"""`topology.expert_parallel=auto`: the largest divisor of the world size that also divides model.num_experts,
resolved to an int when the config is resolved; and one world size (nodes x GPUs, or x CPU processes) for all."""

from __future__ import annotations

import pytest

from moesys_cli.resolve import resolve_config
from runtime.config import ConfigError, MoesysConfig, TopologyConfig, config_from_dict, config_to_dict, validate
from runtime.plan.planner import plan_placement


@pytest.mark.parametrize("overrides,expected", [
    (["recipe=tiny", "topology.expert_parallel=auto", "topology.nproc_per_node=4"], 4),
    (["recipe=tiny", "topology.expert_parallel=auto", "topology.nproc_per_node=6"], 2),
    (["recipe=tiny", "topology.expert_parallel=auto", "topology.nproc_per_node=3"], 1),
    (["recipe=tiny", "topology.expert_parallel=auto", "model.num_experts=0", "model.top_k=1"], 1),
    (["recipe=tiny", "topology.expert_parallel=4", "topology.nproc_per_node=8"], 4),
    (["recipe=gpt-moe-207b", "topology.nodes=1", "topology.gpus_per_node=8"], 8),
    (["recipe=gpt-moe-207b", "topology.nodes=4", "topology.gpus_per_node=8", "topology.expert_parallel=16"], 16),
])
def test_auto_resolves_to_an_int_and_explicit_values_stay(overrides, expected):
    cfg = resolve_config(overrides)
    assert cfg.topology.expert_parallel == expected and isinstance(cfg.topology.expert_parallel, int)


def test_table_1_recipes_keep_their_expert_parallel_sizes():
    for name, experts in (("13b", 8), ("26b", 16), ("52b", 32), ("104b", 64), ("207b", 128)):
        assert resolve_config([f"recipe=gpt-moe-{name}"]).topology.expert_parallel == experts


def test_a_recipe_file_may_say_auto(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# @package _global_\nrecipe: mine\ntopology:\n  nproc_per_node: 4\n  expert_parallel: auto\n")
    assert resolve_config([f"recipe={recipe}"]).topology.expert_parallel == 4


def test_workers_rebuilding_a_config_resolve_auto_too():
    data = config_to_dict(MoesysConfig(topology=TopologyConfig(nproc_per_node=4, expert_parallel=0)))
    assert config_from_dict(data).topology.expert_parallel == 4


def test_a_bad_expert_parallel_is_still_one_line():
    with pytest.raises(ConfigError, match="topology.expert_parallel=3 must divide the world size"):
        resolve_config(["recipe=tiny", "topology.expert_parallel=3", "model.num_experts=6"])
    with pytest.raises(ConfigError, match="could not be converted to Integer"):
        resolve_config(["recipe=tiny", "topology.expert_parallel=most"])


def test_world_size_counts_gpus_when_there_are_gpus():
    # one process per GPU: 4 GPUs with a stale nproc_per_node=2 are 4 ranks for validation, plan and launch alike
    t = TopologyConfig(nodes=2, gpus_per_node=4, gpu_memory_gb=80, nproc_per_node=2, expert_parallel=8)
    cfg = MoesysConfig(topology=t)
    validate(cfg)
    assert t.world_size == 8 and plan_placement(cfg).world_size == 8
    cfg.model.embedding_partition = True
    cfg.topology = TopologyConfig(gpus_per_node=3, gpu_memory_gb=80, nproc_per_node=2, expert_parallel=1)
    with pytest.raises(ConfigError, match="divisible by the 3 data-parallel ranks"):
        validate(cfg)  # the plan used to raise on this config instead
