"""A moesys model written in its family's own Hugging Face format: config.json as transformers reads it and the
classic tensor layout `save_pretrained` writes. `hf_entries` lists the tensors for a streamed writer
(runtime/inference/export.py); `save_hf_model` writes a model held in memory as one model.safetensors."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.config import ModelConfig
from runtime.hf.families import family_of
from runtime.hf.files import INDEX, HFCheckpointError
from runtime.hf.names import TensorName, tensor_names, to_hf
from runtime.host.io import fsync_dir, fsync_file
from runtime.model.transformer import Transformer

PathLike = str | os.PathLike


def hf_entries(cfg: ModelConfig) -> list[TensorName]:
    """Every tensor of cfg's model in its family's classic layout, in the order it is written (dense weights, then
    each MoE layer's experts)."""
    return tensor_names(cfg, family_of(cfg).layout)


def hf_config(cfg: ModelConfig, dtype: torch.dtype, source: dict | None = None) -> dict:
    """The config.json of cfg in its family (model.family, else mixtral); HFCheckpointError when the family cannot
    express cfg. `source`: the config.json the model was read from (its special token ids are kept)."""
    return family_of(cfg).config_json(cfg, dtype, source)


def hf_state_dict(model: Transformer, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's tensors under its family's Hugging Face names, each its own contiguous CPU copy."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = {}
    for e in hf_entries(cfg):
        t = params[e.ours] if e.expert is None else params[e.ours][e.expert]
        out[e.hf] = to_hf(e, t).to("cpu").contiguous().clone()
    return out


def save_hf_model(model: Transformer, cfg: ModelConfig, path: PathLike, source: dict | None = None) -> None:
    """Write config.json + model.safetensors atomically: a temp dir, fsync, then rename (into an existing directory,
    file by file, weights first)."""
    path = Path(path)
    config = hf_config(cfg, model.tok_embeddings.weight.dtype, source)  # refuses other layouts before any write
    tensors = hf_state_dict(model, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and ((path / INDEX).exists() or any(p.name != "model.safetensors"
                                                          for p in path.glob("*.safetensors"))):
        raise HFCheckpointError(f"{path}: holds a sharded checkpoint; refusing to mix layouts")
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in ("model.safetensors", "config.json"):
            fsync_file(tmp / file)
        _publish(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(path.parent)


def _publish(tmp: Path, path: Path) -> None:
    """Rename tmp to path; into an existing directory, replace file by file (weights first, config last)."""
    if not path.exists():
        os.rename(tmp, path)
        return
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: exists and is not a directory")
    for file in ("model.safetensors", "config.json"):
        os.replace(tmp / file, path / file)
    fsync_dir(path)
