"""Open a checkpoint for inference: a moesys run directory (or one of its step_N directories) or a Hugging Face
directory of a family moesys reads (runtime/hf/families.py), as one single-process Transformer, its config and
tokenizer, and where its experts lie.

Files are memory-mapped and streamed: dense weights are copied to the device one tensor at a time, experts are
read only when an offload mode places or computes them, so opening a model larger than memory costs its dense
weights. Before that, a moesys checkpoint's files that hold model weights are checksummed in one streamed pass each
(the optimizer moments written beside the weights in those files are read too: the checksum covers the whole file);
the moments' pages are then dropped from the page cache, so checking leaves no more cached than the weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml

from runtime.config import ConfigError, ModelConfig, MoesysConfig, config_from_dict, config_to_dict
from runtime.data.generation_facts import ending_ids, stated_eos_ids
from runtime.data.tokenizer import checkpoint_tokenizer
from runtime.errors import UserError
from runtime.files.checkpoint_format import MODEL, check_complete, latest_checkpoint, missing_tensor, tensor_key
from runtime.files.paths import CHECKPOINTS, CONFIG, META
from runtime.files.tensorfile import verify
from runtime.hf.checkpoint import open_hf_model
from runtime.host.page_cache import evict
from runtime.inference.errors import InferError
from runtime.inference.expert_source import ExpertSource
from runtime.inference.mapped import MappedFileError, TensorFiles, copy_to, read_header
from runtime.model.transformer import Transformer
from runtime.moe.experts import GroupedExperts
from runtime.moe.layer import is_expert_param


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
    tokenizer: Tokenizer | None
    """None when prompts must be token ids."""
    path: Path
    experts: ExpertSource
    """Where the experts lie; the model's experts stay on the meta device until placed (see open_checkpoint)."""
    stop_ids: tuple[int, ...] = ()
    """The ids a generation ends at (after giving them out): those the model's generation config names and its eos
    (a run started from a released model: that model's), else moesys's eos and end of turn; none for a model without
    eos, which generates to its length."""


def checkpoint_kind(path: Path) -> str:
    """moesys (run dir or step dir) or hf (config.json); raises InferError otherwise."""
    if not path.exists():
        raise InferError(f"checkpoint={path}: no such directory")
    if not path.is_dir():
        raise InferError(f"checkpoint={path}: not a directory (give a moesys run directory or a Hugging Face dir)")
    if (path / CONFIG).is_file() or (path / META).is_file():
        return "moesys"
    if (path / "config.json").is_file():
        return "hf"
    raise InferError(f"checkpoint={path}: neither a moesys run directory ({CONFIG}) nor a Hugging Face "
                     "directory (config.json)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---- moesys run directories ----

def moesys_step_dir(path: Path) -> tuple[Path, dict]:
    """(step directory, config as plain data) of a run directory or of one step directory."""
    if (path / META).is_file():
        step = path
    else:
        latest = latest_checkpoint(path)
        if latest is None:
            raise InferError(f"checkpoint={path}: no complete checkpoint under {CHECKPOINTS}/ (train first)")
        step = latest
    try:
        meta = json.loads((step / META).read_text())
    except (OSError, ValueError) as exc:
        raise InferError(f"{step / META}: unreadable ({_first_line(exc)})") from None
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


def moesys_config(path: Path) -> tuple[Path, MoesysConfig]:
    """(step directory, validated config) of a run directory, one step directory or an export; nothing else read."""
    step, data = moesys_step_dir(path)
    try:
        return step, config_from_dict(data)
    except ConfigError as exc:
        raise InferError(f"checkpoint={path}: its config does not load ({exc})") from None


def _expert_prefixes(model: Transformer) -> list[str]:
    """The parameter-name prefix of each MoE layer's experts, in model order ("layers.1.ffn.experts")."""
    return [name for name, mod in model.named_modules() if isinstance(mod, GroupedExperts)]


@dataclass
class MoesysCheckpoint:
    """A moesys checkpoint opened for reading: the files holding model weights mapped (`model.PARAM` and
    `model.PARAM.G` for global expert G, whatever expert-parallel size, dense sharding or embedding partition wrote
    them) and their checksums verified; files without model weights (RNG states, task heads) are left alone."""

    step_dir: Path
    config: MoesysConfig
    files: TensorFiles


def _model_tensors(file: Path, params: set[str]) -> tuple[dict, int, set[str]]:
    """(header, data offset, the keys of the model's parameters: `model.PARAM` or `model.PARAM.G`) of one file."""
    try:
        header, data_start = read_header(file)
    except MappedFileError:
        verify(file)  # a torn file is named as damaged (ChecksumError) ...
        raise  # ... and one verify can still read is unreadable all the same
    prefix = f"{MODEL}."
    keys = {key for key in header if key.startswith(prefix)
            and (key[len(prefix):] in params or key[len(prefix):].rpartition(".")[0] in params)}
    return header, data_start, keys


def _unread_ranges(header: dict, data_start: int, keys: set[str]) -> list[tuple[int, int]]:
    """(offset, length) of every tensor inference never reads: the optimizer moments and steps beside the weights."""
    return [(data_start + entry["data_offsets"][0], entry["data_offsets"][1] - entry["data_offsets"][0])
            for key, entry in header.items() if key != "__metadata__" and key not in keys]


def read_moesys(path: Path) -> MoesysCheckpoint:
    """Open a run directory's latest checkpoint, one step directory, or an export of either."""
    kind = checkpoint_kind(path)  # a missing path is named as missing
    if kind != "moesys":
        raise InferError(f"checkpoint={path}: a Hugging Face directory, not a moesys run or step directory")
    step, cfg = moesys_config(path)
    check_complete(step)  # a deleted file is named, not reported as the first tensor it held
    with torch.device("meta"):
        params = {name for name, _ in Transformer(cfg.model).named_parameters()}
    candidates = [f for f in sorted(step.glob("*.safetensors")) if not f.name.startswith("rng-")]
    headers = {f: _model_tensors(f, params) for f in candidates}
    weight_files = [f for f in candidates if headers[f][2]]
    if not weight_files:
        raise InferError(f"{step}: no *.safetensors file holds this config's model weights (model.* tensors); was it "
                         "written by a different model config?")
    for file in weight_files:
        verify(file)  # a damaged file is named before anything loads from it (a streamed read, 1 MB of memory)
        evict(file, _unread_ranges(*headers[file]))  # ... and leaves only the weights' pages cached, never the moments
    return MoesysCheckpoint(step, cfg, TensorFiles(weight_files))


def open_moesys(path: Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> LoadedModel:
    checkpoint = read_moesys(path)
    step, cfg, files = checkpoint.step_dir, checkpoint.config, checkpoint.files
    with torch.device("meta"):
        model = Transformer(cfg.model)
    state = {}
    for name, param in model.named_parameters():
        if is_expert_param(name):
            continue
        key = tensor_key(MODEL, name)
        if key not in files:
            raise missing_tensor(step, key)
        state[name] = _shape_checked(files.get(key), param, name, step)
    layers = []
    for prefix in _expert_prefixes(model):
        weights = {}
        experts = model.get_submodule(prefix)
        assert isinstance(experts, GroupedExperts), "the prefixes are GroupedExperts'"
        for wname, weight in experts.weights().items():
            if weight is None:
                continue
            keys = [tensor_key(MODEL, f"{prefix}.{wname}", g) for g in range(weight.shape[0])]
            missing = [k for k in keys if k not in files]
            if missing:
                raise missing_tensor(step, missing[0])
            weights[wname] = [_shape_checked(files.get(k), weight[0], k, step) for k in keys]
        layers.append(weights)
    # the experts stay on meta (placed later): not in `state`
    model.load_state_dict({k: copy_to(v, device, dtype) for k, v in state.items()}, strict=False, assign=True)
    if any(b.is_meta for b in model.buffers()):
        raise InferError(f"{step}: a model buffer has no value in the checkpoint")
    tokenizer = checkpoint_tokenizer(path, step, cfg)  # with the checkpoint's generation facts: its stop ids
    source = ExpertSource(layers, cfg.model.expert_type, dtype, files)
    stops = _in_vocab(tokenizer.stop_ids if tokenizer is not None else (), cfg.model.vocab_size)
    return LoadedModel(config_to_dict(cfg), model.eval(), "moesys", tokenizer, path, source, stops)


def _shape_checked(tensor: torch.Tensor, param: torch.Tensor, name: str, step: Path) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(param.shape):
        raise InferError(f"{name}: shape {tuple(tensor.shape)} in {step}, the config gives {tuple(param.shape)}")
    return tensor


# ---- Hugging Face directories ----

class _HFTokenizer:
    """transformers' tokenizer of a Hugging Face directory, with its special tokens (what `moesys serve`'s
    /tokenizer_info reports)."""

    adds_special_tokens = True
    """encode() adds the tokens the tokenizer adds to a text (a bos, for some); add_special_tokens=False does not."""

    def __init__(self, tok: Any):
        self.tok = tok
        self.tokenizer_class = type(tok).__name__
        self.eos_token, self.bos_token, self.pad_token = tok.eos_token, tok.bos_token, tok.pad_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    @property
    def chat_template(self) -> str | None:
        """tokenizer_config.json's chat template (None without one): `moesys serve` renders chat with it."""
        return getattr(self.tok, "chat_template", None)

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        return self.tok.apply_chat_template(messages, **kwargs)


def _hf_tokenizer(path: Path) -> Tokenizer | None:
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


def _in_vocab(ids: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    return tuple(i for i in ids if 0 <= i < vocab_size)


def _hf_stop_ids(path: Path, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """The ids a Hugging Face directory's generation ends at: its generation config's eos_token_id (else
    config.json's) and its tokenizer's eos (runtime/data/generation_facts.ending_ids)."""
    return ending_ids(stated_eos_ids(path) or (), getattr(getattr(tokenizer, "tok", None), "eos_token_id", None))


def open_hf(path: Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> LoadedModel:
    try:
        model_cfg, model, source = open_hf_model(path, dtype=dtype, device=device)
    except UserError:
        raise
    except Exception as exc:  # torn safetensors files and the like
        raise InferError(f"checkpoint={path}: cannot read ({_first_line(exc)})") from None
    tokenizer = _hf_tokenizer(path)
    return LoadedModel(config_to_dict(served_config(model_cfg)), model, "hf", tokenizer, path, source,
                       _in_vocab(_hf_stop_ids(path, tokenizer), model_cfg.vocab_size))


def served_config(model_cfg: ModelConfig) -> MoesysConfig:
    """The whole config of a released model, as inference and export hold it: its model section, served as it is
    (its vocabulary need not be bytes), train.seq_len within its max_seq_len."""
    cfg = MoesysConfig(model=model_cfg, purpose="serve")
    cfg.train.seq_len = min(cfg.train.seq_len, model_cfg.max_seq_len)
    return cfg


def open_checkpoint(checkpoint: str | Path, dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu") -> LoadedModel:
    """Open a moesys run directory or a Hugging Face directory for inference without reading its experts:
    dense weights are copied to `device`, experts stay where they lie in the files (`LoadedModel.experts`) and on
    the meta device in the model until an offload mode places them."""
    path = Path(checkpoint).expanduser()
    kind = checkpoint_kind(path)
    return open_moesys(path, dtype, device) if kind == "moesys" else open_hf(path, dtype, device)


def load_model(checkpoint: str | Path, dtype: torch.dtype | None = None) -> LoadedModel:
    """Read a checkpoint into a CPU model with every expert resident (a copy of the whole model in memory)."""
    loaded = open_checkpoint(checkpoint, dtype)
    for m, layer in enumerate(loaded.model.moe_layers()):
        loaded.experts.fill(layer.experts, m, torch.device("cpu"))
    return loaded


def resolve_infer_config(config_data: dict[str, Any], infer_overrides: dict[str, Any]) -> MoesysConfig:
    """The checkpoint's config with `infer.*` overrides applied, validated (unknown keys name the dotted key)."""
    data = json.loads(json.dumps(config_data))  # a deep copy of plain data
    data.setdefault("infer", {}).update(infer_overrides)
    return config_from_dict(data)
