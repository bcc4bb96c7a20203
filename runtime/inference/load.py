"""Open a checkpoint for inference: a moesys run directory (or one of its step_N directories) or a Hugging Face
Mixtral-layout directory, as one single-process Transformer with every expert, plus its config and tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch
import yaml

from runtime.config import ConfigError, MoesysConfig, config_from_dict, config_to_dict
from runtime.errors import UserError
from runtime.inference.hf_mixtral import load_hf_mixtral
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param
from runtime.run_dir import CHECKPOINTS, CONFIG
from runtime.checkpoint_format import MODEL, CheckpointReader, latest_checkpoint, tensor_key
from runtime.train.tokenizer import ByteTokenizer


class InferError(UserError):
    """Bad inference input (checkpoint, prompt, ring size); the message is one line."""


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class LoadedModel:
    """What a checkpoint gives inference: config (infer section overridable), model in eval mode, tokenizer."""

    config_data: dict[str, Any]
    """The checkpoint's config as plain data (for `resolve_infer_config`)."""
    model: Transformer
    kind: str
    """moesys or hf."""
    tokenizer: Optional[Tokenizer]
    """None when prompts must be token ids."""
    path: Path


def checkpoint_kind(path: Path) -> str:
    """moesys (run dir or step dir) or hf (config.json); raises InferError otherwise."""
    if not path.exists():
        raise InferError(f"checkpoint={path}: no such directory")
    if not path.is_dir():
        raise InferError(f"checkpoint={path}: not a directory (give a moesys run directory or a Hugging Face dir)")
    if (path / CONFIG).is_file() or (path / "meta.json").is_file():
        return "moesys"
    if (path / "config.json").is_file():
        return "hf"
    raise InferError(f"checkpoint={path}: neither a moesys run directory ({CONFIG}) nor a Hugging Face "
                     "directory (config.json)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---- moesys run directories ----

def _moesys_step_dir(path: Path) -> tuple[Path, dict]:
    """(step directory, config as plain data) of a run directory or of one step directory."""
    if (path / "meta.json").is_file():
        step = path
    else:
        step = latest_checkpoint(path)
        if step is None:
            raise InferError(f"checkpoint={path}: no complete checkpoint under {CHECKPOINTS}/ (train first)")
    try:
        meta = json.loads((step / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise InferError(f"{step / 'meta.json'}: unreadable ({_first_line(exc)})") from None
    config_file = path / CONFIG
    if config_file.is_file():
        try:
            data = yaml.safe_load(config_file.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise InferError(f"{config_file}: not valid YAML ({_first_line(exc)})") from None
    else:
        data = meta.get("config")
    if not isinstance(data, dict):
        raise InferError(f"checkpoint={path}: no config ({CONFIG} or meta.json 'config')")
    return step, data


def load_moesys(path: Path, dtype: Optional[torch.dtype] = None) -> LoadedModel:
    step, data = _moesys_step_dir(path)
    try:
        cfg = config_from_dict(data)
    except ConfigError as exc:
        raise InferError(f"checkpoint={path}: its config does not load ({exc})") from None
    if not (step / "dense.safetensors").is_file():
        raise InferError(f"{step}: dense.safetensors is missing")
    files = CheckpointReader(step)  # the training checkpoint's own reader: every file's checksum verified
    with torch.device("meta"):
        model = Transformer(cfg.model)
    state = {}
    for name, param in model.named_parameters():
        if is_expert_param(name):
            tensor = torch.stack([files.get(tensor_key(MODEL, name, g)) for g in range(param.shape[0])])
        else:
            tensor = files.get(tensor_key(MODEL, name))
        if tuple(tensor.shape) != tuple(param.shape):
            raise InferError(f"{name}: shape {tuple(tensor.shape)} in {step}, the config gives {tuple(param.shape)}")
        state[name] = tensor.to(dtype or tensor.dtype).contiguous()
    model.load_state_dict(state, strict=True, assign=True)
    if any(b.is_meta for b in model.buffers()):
        raise InferError(f"{step}: a model buffer has no value in the checkpoint")
    tokenizer = ByteTokenizer() if cfg.model.vocab_size >= ByteTokenizer.vocab_size else None
    return LoadedModel(config_to_dict(cfg), model.eval(), "moesys", tokenizer, path)


# ---- Hugging Face Mixtral directories ----

class _HFTokenizer:
    def __init__(self, tok: Any):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _hf_tokenizer(path: Path) -> Optional[Tokenizer]:
    """transformers' tokenizer when the directory has tokenizer files and transformers imports; else None."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer  # optional dependency, only for HF prompts given as text
    except ImportError:
        return None
    try:
        return _HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    except Exception:  # an unusable tokenizer: prompts must then be ids
        return None


def load_hf(path: Path, dtype: Optional[torch.dtype] = None) -> LoadedModel:
    try:
        model_cfg, model = load_hf_mixtral(path, dtype=dtype)
    except UserError:
        raise
    except Exception as exc:  # torn safetensors files and the like
        raise InferError(f"checkpoint={path}: cannot read ({_first_line(exc)})") from None
    cfg = MoesysConfig(model=model_cfg, purpose="serve")  # served as it is: its vocabulary need not be bytes
    cfg.train.seq_len = min(cfg.train.seq_len, model_cfg.max_seq_len)
    return LoadedModel(config_to_dict(cfg), model, "hf", _hf_tokenizer(path), path)


def load_model(checkpoint: str | Path, dtype: Optional[torch.dtype] = None) -> LoadedModel:
    """Read a moesys run directory or a Hugging Face Mixtral directory into a CPU model with all experts."""
    path = Path(checkpoint).expanduser()
    kind = checkpoint_kind(path)
    return load_moesys(path, dtype) if kind == "moesys" else load_hf(path, dtype)


def resolve_infer_config(config_data: dict[str, Any], infer_overrides: dict[str, Any]) -> MoesysConfig:
    """The checkpoint's config with `infer.*` overrides applied, validated (unknown keys name the dotted key)."""
    data = json.loads(json.dumps(config_data))  # a deep copy of plain data
    data.setdefault("infer", {}).update(infer_overrides)
    return config_from_dict(data)
