"""Composition of conf/ + recipes with Hydra, and the one validation of the typed config."""

from __future__ import annotations

import dataclasses
import re

import pytest

from moesys_cli.resolve import available_recipes, group_options, resolve_config
from runtime.config import ConfigError, MoesysConfig, config_from_dict, config_to_dict

GROUPS = ("model", "topology", "storage", "train", "infer", "launcher")


NEEDS = {"finetune": ["train.init_from=tests/data/hf_configs/qwen3-30b-a3b"]}
"""What a recipe cannot do without (finetune: the model it fine-tunes; a config.json is enough to compose)."""


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_recipe_composes_and_round_trips(recipe):
    cfg = resolve_config([f"recipe={recipe}", *NEEDS.get(recipe, [])])
    assert isinstance(cfg, MoesysConfig) and cfg.recipe == recipe
    assert config_from_dict(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if group == "model" and option != "tiny":
        overrides.append("topology.expert_parallel=1")
    cfg = resolve_config(overrides)
    if group == "launcher":
        assert cfg.launcher.name == option


def test_recipes_required_by_the_paper_exist():
    assert {"tiny", "gpt-moe-13b", "gpt-moe-26b", "gpt-moe-52b", "gpt-moe-104b", "gpt-moe-207b",
            "ufo-multitask"} <= set(available_recipes())


def test_gpt_moe_recipes_follow_table_1():
    for name, experts in (("13b", 8), ("26b", 16), ("52b", 32), ("104b", 64), ("207b", 128)):
        cfg = resolve_config([f"recipe=gpt-moe-{name}"])
        m, t = cfg.model, cfg.topology
        assert (m.num_heads, m.hidden_size, m.vocab_size, m.num_layers) == (64, 4096, 50304, 12)
        assert m.num_experts == experts and t.nodes * t.gpus_per_node == experts
        assert t.nodes * t.gpus_per_node * cfg.train.micro_batch_size == experts  # batch = GPUs in Table 1


def test_overrides_reach_every_section():
    cfg = resolve_config(["recipe=gpt-moe-13b", "model.num_experts=16", "topology.nodes=2",
                          "topology.expert_parallel=16", "storage.offload=ssd", "train.precision=bf16", "train.lr=0.5"])
    assert (cfg.model.num_experts, cfg.topology.nodes, cfg.storage.offload, cfg.train.lr) == (16, 2, "ssd", 0.5)


def test_ufo_multitask_tasks_and_override():
    cfg = resolve_config(["recipe=ufo-multitask", "tasks.task1.batch_size=600"])
    assert [t.batch_size for t in cfg.tasks.values()] == [600, 256, 128, 128]


def test_defaults_fill_derived_sizes():
    m = resolve_config(["model.num_kv_heads=null", "model.ffn_hidden_size=null"]).model
    assert m.kv_heads == m.num_heads and m.ffn_size == 4 * m.hidden_size


def test_topology_local_measures_this_machine():
    t = resolve_config(["topology=local"]).topology
    assert t.cpu_memory_gb > 0 and t.ssd_gb > 0 and not t.detect


@pytest.mark.parametrize("overrides,message", [
    (["model.num_expert=4"], "unknown config key model.num_expert; did you mean model.num_experts"),
    (["trian.lr=1"], "unknown config key trian.lr; did you mean train"),
    (["max_steps=4"], "unknown config key max_steps; did you mean train.max_steps?"),
    (["recipe=gpt-moe-14b"], "unknown recipe 'gpt-moe-14b'; did you mean gpt-moe-104b, gpt-moe-13b"),
    (["model=gpt"], "unknown model 'gpt'"),
    (["model.top_k=9"], "model.top_k=9 exceeds model.num_experts=8"),
    (["model.num_heads=3"], "model.num_heads=3 must divide model.hidden_size=128"),
    (["model.num_kv_heads=3"], "model.num_kv_heads=3 must divide model.num_heads=4"),
    (["model.num_experts=5"], "model.num_experts=5 is not divisible by topology.expert_parallel=2"),
    (["model.hidden_size=0"], "model.hidden_size must be positive"),
    (["train.max_steps=-1"], "train.max_steps must be positive"),
    (["model.hidden_size=abc"], "could not be converted to Integer"),
    (["model.norm=batchnorm"], "model.norm='batchnorm' is not one of layernorm, rmsnorm"),
    (["storage.alpha=2"], "storage.alpha must be in (0, 1]"),
    (["notakey"], "is not key=value"),
    (["student.num_experts=4"], "student.num_experts=4 applies to a distillation only: run moesys distill "
                                "checkpoint=TEACHER_RUN_DIR student.num_experts=4"),
    (["launcher=multinode", "launcher.rdzv_endpoint=node0"], "launcher.rdzv_endpoint='node0' is not host:port"),
    (["launcher=multinode", "launcher.rdzv_endpoint=node0:http"], "launcher.rdzv_endpoint='node0:http' is not host"),
    (["launcher=multinode", "launcher.rdzv_endpoint=node0:70000"], "is not host:port with a port in 1..65535"),
    (["launcher=multinode", "launcher.rdzv_endpoint=:29400"], "launcher.rdzv_endpoint=':29400' is not host:port"),
])
def test_bad_input_is_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        resolve_config(overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_recipe_file_with_a_typo_gets_the_command_lines_message_and_one_that_does_not_parse_is_named(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("# @package _global_\nrecipe: mine\nmodel:\n  hiden_size: 64\ntasks:\n  a: {batch_size: 4}\n")
    with pytest.raises(ConfigError) as on_command_line:
        resolve_config(["model.hiden_size=64"])
    with pytest.raises(ConfigError) as in_file:
        resolve_config([f"recipe={recipe}"])
    assert str(in_file.value) == f"{on_command_line.value} (in recipe {recipe})"
    assert "did you mean model.hidden_size" in str(in_file.value)
    for text, message in (("model:\n  hidden_size: [64\n", "is not valid YAML: expected ',' or ']', but got "
                                                          "'<stream end>' at line 3, column 1"),
                          ("- model\n", "is not a YAML mapping of config keys (it holds a list)")):
        recipe.write_text(text)
        with pytest.raises(ConfigError) as err:
            resolve_config([f"recipe={recipe}"])
        assert str(err.value) == f"recipe {recipe} {message}"


def test_validation_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as err:
        resolve_config(["model.top_k=9", "model.hidden_size=-4"])
    assert "model.top_k=9" in str(err.value) and "model.hidden_size must be positive" in str(err.value)


def test_worker_side_rebuild_rejects_unknown_keys():
    data = config_to_dict(MoesysConfig())
    data["model"]["hiden_size"] = 3
    with pytest.raises(ConfigError, match="unknown config key model.hiden_size; did you mean hidden_size"):
        config_from_dict(data)
    assert dataclasses.asdict(config_from_dict(config_to_dict(MoesysConfig()))) == config_to_dict(MoesysConfig())


def test_hierarchical_alltoall_over_part_of_a_node_is_refused_by_validate():
    with pytest.raises(ConfigError, match="parallel.alltoall=hierarchical needs topology.expert_parallel=6 to span"):
        resolve_config(["recipe=tiny", "parallel.alltoall=hierarchical", "topology.nodes=3",
                        "topology.nproc_per_node=4", "topology.expert_parallel=6", "model.num_experts=12"])
    resolve_config(["recipe=tiny", "parallel.alltoall=hierarchical", "topology.nodes=2", "topology.nproc_per_node=2",
                    "topology.expert_parallel=4"])


def test_a_vocabulary_below_the_byte_tokenizers_is_refused_for_training_only():
    with pytest.raises(ConfigError, match="model.vocab_size=100 is smaller than the byte tokenizer's 256 tokens"):
        resolve_config(["recipe=tiny", "model.vocab_size=100"])
    assert resolve_config(["recipe=tiny", "model.vocab_size=100", "purpose=serve"]).model.vocab_size == 100


@pytest.mark.parametrize("endpoint", ["localhost:29500", "127.0.1.1:29400", "'[::1]:29400'", "LocalHost:1"])
def test_a_loopback_rendezvous_is_refused_for_several_nodes_only(endpoint):
    nodes = ["recipe=tiny", "launcher=multinode", "topology.expert_parallel=2", f"launcher.rdzv_endpoint={endpoint}"]
    with pytest.raises(ConfigError) as err:
        resolve_config([*nodes, "topology.nodes=2"])
    assert "is a loopback address, which the other nodes of topology.nodes=2 cannot reach; set " \
           "launcher.rdzv_endpoint=<node 0's address" in str(err.value) and "\n" not in str(err.value)
    assert resolve_config([*nodes, "topology.nodes=1"]).launcher.rdzv_endpoint == endpoint.strip("'")
    two = resolve_config(["recipe=tiny", "launcher=multinode", "topology.nodes=2", "topology.expert_parallel=2",
                          "launcher.rdzv_endpoint='[fd00::1]:29400'"])
    assert two.launcher.rdzv_endpoint == "[fd00::1]:29400"
    assert resolve_config(["recipe=tiny", "launcher.rdzv_endpoint=nonsense"]).launcher.name == "local"  # unused


def test_student_experts_are_taken_with_a_teacher_only():
    data = config_to_dict(resolve_config(["recipe=tiny"]))
    data["student"]["num_experts"], data["model"]["num_experts"] = 4, 4
    with pytest.raises(ConfigError, match="student.num_experts=4 applies to a distillation only"):
        config_from_dict(data)
    data["distill"]["teacher"] = "/runs/teacher/checkpoints/step_00000010"
    assert config_from_dict(data).student.num_experts == 4  # as moesys distill writes it: both at once


@pytest.mark.parametrize("overrides,message", [
    (["storage.resident_layers=1"], "storage.resident_layers=1 needs storage.offload=cpu or ssd (got none)"),
    (["storage=cpu", "storage.resident_layers=4"], "keeps every one of the model's 4 MoE layers on the device"),
    (["storage=cpu", "storage.resident_layers=-1"], "storage.resident_layers must be >= 0"),
])
def test_resident_layers_need_an_offloaded_mode_and_leave_a_layer_offloaded(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_config(["recipe=tiny", *overrides])
