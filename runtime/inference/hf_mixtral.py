"""The Mixtral names of the family-generic Hugging Face import and export (runtime/hf/), kept for their callers."""

from __future__ import annotations

import torch

from runtime.config import ModelConfig
from runtime.hf.checkpoint import load_hf_model as load_hf_mixtral
from runtime.hf.checkpoint import open_hf_model as open_hf_mixtral
from runtime.hf.families import FAMILIES
from runtime.hf.files import INDEX, HFCheckpointError
from runtime.hf.save import hf_state_dict
from runtime.hf.save import save_hf_model as save_hf_mixtral


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """A ModelConfig for a Mixtral config.json dict."""
    if hf.get("model_type") != "mixtral":
        raise HFCheckpointError(f"{source}: model_type={hf.get('model_type')!r} is not 'mixtral'")
    return FAMILIES["mixtral"].model_config(hf, source)


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The Mixtral config.json of a model; HFCheckpointError when Mixtral cannot express it."""
    return FAMILIES["mixtral"].config_json(cfg, dtype)


__all__ = ["HFCheckpointError", "INDEX", "config_from_hf", "config_to_hf", "hf_state_dict", "load_hf_mixtral",
           "open_hf_mixtral", "save_hf_mixtral"]
