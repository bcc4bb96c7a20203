"""Property test of the planner: random valid configs never make it raise, and every `try:` suggestion it prints,
applied as overrides, gives a plan that fits."""

from __future__ import annotations

import json
import math
import re

import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from runtime.config import (ConfigError, InferConfig, ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig,
                            config_from_dict, config_to_dict, resolve_auto, validate)
from runtime.plan.planner import plan_placement, plan_to_dict

OVERRIDE = re.compile(r"([a-z_]+(?:\.[a-z_0-9]+)+)=(\S+)")


@st.composite
def configs(draw) -> tuple[MoesysConfig, bool]:
    """A valid config and whether its expert_parallel is `auto`."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    hidden = heads * draw(st.sampled_from([2, 16, 64, 512, 1024, 100_000]))
    experts = draw(st.sampled_from([0, 1, 2, 4, 8, 16, 64]))
    max_seq = draw(st.sampled_from([16, 256, 4096]))
    gpus, nproc, nodes = draw(st.sampled_from([0, 0, 1, 8])), draw(st.integers(1, 8)), draw(st.integers(1, 4))
    world = nodes * (gpus or nproc)
    model = ModelConfig(
        hidden_size=hidden, num_heads=heads, num_layers=draw(st.integers(1, 6)), num_experts=experts,
        top_k=draw(st.integers(1, max(1, min(experts, 4)))), moe_layer_freq=draw(st.integers(1, 3)),
        vocab_size=draw(st.sampled_from([256, 32000])), max_seq_len=max_seq,
        ffn_hidden_size=draw(st.sampled_from([None, 8, 14336])), expert_type=draw(st.sampled_from(["gelu", "swiglu"])),
        embedding_partition=hidden % world == 0 and draw(st.booleans()))
    auto = draw(st.booleans())
    divisors = [d for d in range(1, world + 1) if world % d == 0 and (experts == 0 or experts % d == 0)]
    topology = TopologyConfig(
        nodes=nodes, gpus_per_node=gpus, nproc_per_node=nproc, expert_parallel=0 if auto else draw(st.sampled_from(divisors)),
        gpu_memory_gb=draw(st.sampled_from([0.0, 0.5, 24.0, 80.0])),
        cpu_memory_gb=draw(st.sampled_from([0.0, 0.01, 4.0, 16.0, 1024.0])),
        ssd_gb=draw(st.sampled_from([0.0, 0.01, 100.0, 15000.0])))
    storage = StorageConfig(offload=draw(st.sampled_from(["none", "cpu", "ssd", "auto"])),
                            alpha=draw(st.sampled_from([0.1, 0.5, 1.0])), dense_shard=draw(st.booleans()),
                            prefetch_depth=draw(st.integers(0, 2)), cpu_cache_experts=draw(st.sampled_from([0, 0, 3])),
                            resident_layers=draw(st.sampled_from([0, 0, 1])))
    train = TrainConfig(micro_batch_size=draw(st.integers(1, 16)), seq_len=draw(st.integers(1, max_seq)),
                        precision=draw(st.sampled_from(["fp32", "bf16", "fp16"])))
    infer = InferConfig(ring_slots=draw(st.integers(1, 8)), offload=draw(st.sampled_from(["ring", "ondemand", "none"])))
    cfg = MoesysConfig(model=model, topology=topology, storage=storage, train=train, infer=infer,
                       purpose=draw(st.sampled_from(["train", "serve"])))
    resolve_auto(cfg)
    try:
        validate(cfg)
    except ConfigError:
        assume(False)  # rules outside the planner's reach (e.g. an offload mode a precision does not support)
    return cfg, auto


def apply(cfg: MoesysConfig, overrides: list[tuple[str, str]], auto: bool) -> MoesysConfig:
    """The config a user gets by adding `key=value ...` to their command (`auto` resolved again)."""
    data = config_to_dict(cfg)
    if auto:
        data["topology"]["expert_parallel"] = 0
    for key, value in overrides:
        *path, name = key.split(".")
        node = data
        for part in path:
            node = node[part]
        assert name in node, key
        node[name] = yaml.safe_load(value)
    return config_from_dict(data)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(configs())
def test_random_configs_plan_and_every_suggestion_fits(drawn):
    cfg, auto = drawn
    plan = plan_placement(cfg)
    json.dumps(plan_to_dict(plan), allow_nan=False)
    assert plan.feasible == (not plan.problems) and (plan.feasible or plan.suggestions)
    for line in plan.suggestions:
        overrides = OVERRIDE.findall(line)
        if not overrides:
            assert "=" not in line, line
            continue
        for key, value in overrides:
            if key in ("train.micro_batch_size", "train.seq_len", "infer.ring_slots"):
                assert 1 <= int(value), line
        fixed = plan_placement(apply(cfg, overrides, auto))
        assert fixed.feasible, (line, fixed.problems)
    budget = plan.budget
    assert (budget.min_nodes() is None) == bool(budget.unsatisfiable())
    assert budget.min_nodes() is None or isinstance(budget.min_nodes(), int) and not math.isinf(budget.min_nodes())
