"""Validation by section (runtime/config/): each section checks its own fields, choices come from Literal types,
and the rules across sections are named."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from runtime.config import (CROSS_SECTION_RULES, ConfigError, ConfigSection, ExportConfig, ModelConfig, MoesysConfig,
                            TaskConfig, choices, validate)


def test_every_section_is_a_section_and_the_default_config_has_no_problem():
    for f in dataclasses.fields(MoesysConfig):
        tp = typing.get_type_hints(MoesysConfig)[f.name]
        if dataclasses.is_dataclass(tp):
            assert issubclass(tp, ConfigSection), f.name
    assert MoesysConfig().problems() == []
    validate(MoesysConfig())


def test_choices_come_from_the_field_types():
    hints = typing.get_type_hints(ModelConfig, include_extras=True)
    assert choices(hints["norm"]) == ("layernorm", "rmsnorm")
    assert choices(hints["hidden_size"]) is None
    assert choices(typing.get_type_hints(ExportConfig, include_extras=True)["dtype"]) == ("fp32", "bf16", "fp16")


def test_a_section_names_its_own_keys_under_the_key_it_is_given():
    assert ModelConfig(norm="zz", top_k=0).problems("model") == [
        "model.norm='zz' is not one of layernorm, rmsnorm", "model.top_k must be positive (got 0)"]
    assert TaskConfig(gpus=-1).problems("tasks.a") == ["tasks.a.gpus must be >= 0 (got -1)"]
    assert ExportConfig(dtype=None).problems("export") == []
    assert ExportConfig(dtype="fp8").problems("export") == ["export.dtype='fp8' is not one of fp32, bf16, fp16, null"]


def test_every_problem_is_listed_at_once_sections_first_then_the_cross_section_rules():
    cfg = MoesysConfig()
    cfg.train.seq_len, cfg.model.max_seq_len, cfg.serve.port = 64, 32, -1
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == ("serve.port must be between 0 and 65535 (got -1); "
                              "train.seq_len=64 exceeds model.max_seq_len=32")
    assert all(rule.__doc__ for rule in CROSS_SECTION_RULES)
