"""`moesys config`: the resolved config as YAML/JSON, every key with --keys, and --help pointing there."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from moesys_cli.resolve import available_recipes, resolve_config
from runtime.config.keys import config_keys
from tests.cli.conftest import run_moesys

OVERRIDES = ["recipe=ufo-multitask", "model.num_experts=16", "train.max_steps=7"]


def test_prints_the_resolved_config_as_yaml_and_json():
    expected = dataclasses.asdict(resolve_config(OVERRIDES))
    out = run_moesys("config", *OVERRIDES)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == expected
    out = run_moesys("config", *OVERRIDES, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == expected


def test_keys_lists_every_key_with_type_default_value_and_doc():
    out = run_moesys("config", "--keys", "train.max_steps=7")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["KEY", "TYPE", "DEFAULT", "VALUE"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == [k.key for k in config_keys()]
    assert rows["train.max_steps"].split()[1:4] == ["int", "100", "7"] and rows["train.max_steps"].endswith(
        "Optimizer steps.")
    assert rows["storage.offload"].split()[1] == "none|cpu|ssd|auto"
    data = json.loads(run_moesys("config", "--keys", "--json").stdout)
    assert {"key": "model.top_k", "type": "int", "default": 2, "value": 2,
            "doc": "Experts each token is routed to (1 = Switch, 2 = GShard)."} in data


def test_a_bad_key_is_one_line_exit_2():
    out = run_moesys("config", "model.num_expert=3")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "model.num_experts" in out.stderr and "Traceback" not in out.stderr



def test_a_recipe_file_that_does_not_parse_is_one_line_exit_2(tmp_path):
    (tmp_path / "bad.yaml").write_text("model:\n  hidden_size: [64\n")
    for verb in (["config"], ["train", "--dry-run"]):
        out = run_moesys(*verb, f"recipe={tmp_path / 'bad.yaml'}")
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [
            f"error: recipe {tmp_path / 'bad.yaml'} is not valid YAML: expected ',' or ']', but got '<stream end>' at "
            "line 3, column 1"], out.stderr


@pytest.mark.parametrize("verb", ["plan", "train", "infer", "rebalance", "bench", "config"])
def test_help_points_to_the_keys_and_lists_the_recipes(verb):
    out = run_moesys(verb, "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.replace("│", " ").split())
    assert "moesys config --keys" in text
    if verb != "infer":  # infer reads its config from the checkpoint: no recipe= there
        assert all(name in text for name in available_recipes())
