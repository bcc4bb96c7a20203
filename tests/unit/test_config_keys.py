"""runtime/config/keys.py: every schema key, dotted, with its type, default and the docstring under its field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from runtime.config import MoesysConfig
from runtime.config.keys import attribute_docs, config_keys, type_name


@dataclass
class _Example:
    plain: int = 1
    """One line."""
    undocumented: str = "x"
    spread: Optional[float] = None
    """Over
    two lines."""


def test_attribute_docs_are_the_strings_under_each_field():
    assert attribute_docs(_Example) == {"plain": "One line.", "spread": "Over two lines."}


def test_type_names():
    assert [type_name(t) for t in (int, Optional[str], Optional[List[int]], bool)] == \
        ["int", "str | null", "list[int] | null", "bool"]


def test_every_key_of_the_schema_is_listed_with_a_docstring():
    keys = {k.key: k for k in config_keys()}
    assert not [k for k in keys.values() if not k.doc], "every config field needs a one-line docstring"
    assert keys["model.num_experts"].type == "int"
    assert keys["model.num_experts"].default == MoesysConfig().model.num_experts
    assert keys["storage.offload"].type == "none|cpu|ssd|auto"
    assert keys["train.run_dir"].type == "str | null" and keys["train.run_dir"].default is None
    assert keys["tasks.NAME.batch_size"].doc == "Samples per step."
    assert "recipe" in keys and "model" not in keys and "tasks" not in keys
