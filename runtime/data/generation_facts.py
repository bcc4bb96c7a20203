"""A model's generation facts: the chat template it renders chat with, its named special tokens (bos, eos, pad, ...: the
variables transformers gives a chat template) and the token ids its generation ends at.

A released model states them in its Hugging Face files (chat_template.jinja or tokenizer_config.json's chat_template,
tokenizer_config.json and special_tokens_map.json, generation_config.json or config.json). A run started from
train.init_from records its source's once in the run directory (CHAT_TEMPLATE_FILE, GENERATION_TOKENS_FILE), and its
checkpoints and moesys exports carry them beside tokenizer.json. `checkpoint_facts` is the one place that finds the
facts of a checkpoint; the tokenizer a run or checkpoint loads carries them (runtime/data/tokenizer.py), and training,
inference, serving and export read them there. A model moesys initialised has none: ChatML and moesys's own tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.files.paths import (
    CHAT_TEMPLATE_FILE,
    CHECKPOINTS,
    GENERATION_CONFIG,
    GENERATION_TOKENS_FILE,
    HF_TOKENIZER_CONFIG,
)
from runtime.host.io import atomic_write_json, atomic_write_text

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens a Hugging Face tokenizer names, which transformers passes to a chat template."""
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
"""Older Hugging Face tokenizers' named special tokens, for the names tokenizer_config.json leaves out."""


@dataclass(frozen=True)
class GenerationFacts:
    """What a model states about its chat and its tokens; a field left None defers to moesys's own."""

    chat_template: str | None = None
    """None: ChatML."""
    special_tokens: dict[str, str] | None = None
    """NAMED_TOKENS the model sets, by name (a name it leaves unset is absent); None: moesys's own special tokens."""
    eos_token_ids: tuple[int, ...] | None = None
    """The ids its generation config ends generation at (an id or a list there); None: moesys's stop tokens."""

    def to_json(self) -> dict[str, Any]:
        """GENERATION_TOKENS_FILE's contents (the template is a file of its own)."""
        ids = list(self.eos_token_ids) if self.eos_token_ids is not None else None
        return {"special_tokens": self.special_tokens, "eos_token_id": ids}


def ending_ids(eos_token_ids: Iterable[int], eos_id: int | None) -> tuple[int, ...]:
    """The ids a generation ends at: those the generation config names, and the eos token's when it is not among them
    (as vLLM stops)."""
    ids = list(dict.fromkeys(eos_token_ids))
    return tuple(ids + [eos_id] if eos_id is not None and eos_id not in ids else ids)


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _ids(value: Any) -> tuple[int, ...] | None:
    """An eos_token_id as a generation config gives it (an id, a list of ids, or null) as a tuple; None when unset."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    return tuple(i for i in values if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def _token(value: Any) -> str | None:
    """A named token as tokenizer files write it: its string, or an added token's content."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def stated_eos_ids(directory: str | Path) -> tuple[int, ...] | None:
    """eos_token_id of a Hugging Face directory's generation_config.json, else of its config.json; None where
    neither names one."""
    for name in (GENERATION_CONFIG, "config.json"):
        data = _json(Path(directory) / name)
        if data is not None and "eos_token_id" in data:
            return _ids(data["eos_token_id"]) or ()
    return None


def _named_tokens(directory: Path) -> dict[str, str] | None:
    """NAMED_TOKENS as transformers reads them: tokenizer_config.json's, where an older one without
    added_tokens_decoder has special_tokens_map.json's over its own; None without either file."""
    config, legacy = _json(directory / HF_TOKENIZER_CONFIG), _json(directory / SPECIAL_TOKENS_MAP)
    if config is None and legacy is None:
        return None
    layers = [config or {}] if "added_tokens_decoder" in (config or {}) else [config or {}, legacy or {}]
    named = {}
    for layer in layers:
        named.update({name: _token(layer[name]) for name in NAMED_TOKENS if name in layer})
    return {name: token for name, token in named.items() if token is not None}


def _hf_template(directory: Path) -> str | None:
    """The directory's chat_template.jinja, else tokenizer_config.json's chat_template (the one named default of a
    list); None without one."""
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return (directory / CHAT_TEMPLATE_FILE).read_text()
    template = (_json(directory / HF_TOKENIZER_CONFIG) or {}).get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) else None


def hf_facts(directory: str | Path) -> GenerationFacts | None:
    """What a Hugging Face model directory states (also a moesys export of one, which carries its files); None when
    it has no tokenizer_config.json, special_tokens_map.json, generation_config.json or chat template."""
    directory = Path(directory)
    facts = GenerationFacts(_hf_template(directory), _named_tokens(directory), stated_eos_ids(directory))
    return None if facts == GenerationFacts() else facts


def recorded_facts(directory: str | Path) -> GenerationFacts | None:
    """What a run directory, checkpoint or moesys export records (GENERATION_TOKENS_FILE and CHAT_TEMPLATE_FILE); a
    template alone is a template with moesys's tokens; None without either."""
    directory = Path(directory)
    template_file = directory / CHAT_TEMPLATE_FILE
    template = template_file.read_text() if template_file.is_file() else None
    data = _json(directory / GENERATION_TOKENS_FILE)
    if data is None:
        return GenerationFacts(template) if template is not None else None
    named = data.get("special_tokens")
    named = {k: v for k, v in named.items() if k in NAMED_TOKENS and isinstance(v, str)} \
        if isinstance(named, dict) else None
    return GenerationFacts(template, named, _ids(data.get("eos_token_id")))


def directory_facts(directory: str | Path) -> GenerationFacts | None:
    """The facts one directory holds: what it records, else what its Hugging Face files state."""
    directory = Path(directory)
    if (directory / GENERATION_TOKENS_FILE).is_file():
        return recorded_facts(directory)
    return hf_facts(directory) or recorded_facts(directory)


def checkpoint_facts(path: str | Path, step_dir: str | Path) -> GenerationFacts | None:
    """The facts of a checkpoint or export, found where its tokenizer.json is: its step directory (or the export),
    else the directory given, else the run directory above a step directory; None: ChatML and moesys's tokens."""
    step_dir = Path(step_dir)
    candidates = [step_dir, Path(path)]
    if step_dir.parent.name == CHECKPOINTS:
        candidates.append(step_dir.parent.parent)
    for directory in dict.fromkeys(candidates):
        facts = directory_facts(directory)
        if facts is not None:
            return facts
    return None


def write_facts(directory: str | Path, facts: GenerationFacts | None) -> None:
    """Record `facts` in `directory`, each file written atomically; None removes what was recorded."""
    directory = Path(directory)
    if facts is None:
        for name in (GENERATION_TOKENS_FILE, CHAT_TEMPLATE_FILE):
            (directory / name).unlink(missing_ok=True)
        return
    if facts.chat_template is not None:
        atomic_write_text(directory / CHAT_TEMPLATE_FILE, facts.chat_template)
    else:
        (directory / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
    atomic_write_json(directory / GENERATION_TOKENS_FILE, facts.to_json())
