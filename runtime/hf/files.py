"""A Hugging Face model directory on disk: its config.json, its safetensors files (one, or shards listed by an index)
mapped in place, and the tokenizer files that travel with the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.errors import UserError
from runtime.inference.mapped import TensorFiles

INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some older checkpoints saved beside the weights."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
"""Files beside the weights that an export carries over from its source: the tokenizer, its chat template and
generation settings."""


class HFCheckpointError(UserError):
    """A Hugging Face checkpoint moesys cannot read or write; the message names the file or tensor."""


def read_config_json(path: Path) -> dict:
    """The config.json of model directory `path` as a dict."""
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: no such checkpoint directory")
    config = path / "config.json"
    if not config.is_file():
        raise HFCheckpointError(f"{config}: missing")
    try:
        data = json.loads(config.read_text())
    except ValueError as exc:
        raise HFCheckpointError(f"{config}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{config}: not a JSON object")
    return data


def tokenizer_files(path: Path) -> list[Path]:
    """The TOKENIZER_FILES present in model directory `path`."""
    return [path / name for name in TOKENIZER_FILES if (path / name).is_file()]


class HFTensorFiles(TensorFiles):
    """Every tensor of a model directory by its Hugging Face name, each a view of its file's memory map (read when
    used); the index, when there is one, names the files."""

    def __init__(self, path: Path):
        index = path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise HFCheckpointError(f"{index}: not a safetensors index ({exc})") from None
            files = sorted({path / f for f in weight_map.values()})
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise HFCheckpointError(f"{path}: no *.safetensors files")
        for file in files:
            if not file.is_file():
                raise HFCheckpointError(f"{file}: listed in {INDEX} but missing")
        super().__init__(files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise HFCheckpointError(f"missing tensor {name}")
        return super().get(name)

    def unused(self) -> list[str]:
        """Names no moesys parameter was read from (apart from buffers older checkpoints saved)."""
        return sorted(n for n in self.where if n not in self.used and not n.endswith(IGNORED_SUFFIXES))

    def stored_bytes(self) -> int:
        return sum(f.path.stat().st_size for f in self.files)
