"""A Hugging Face model directory opened in place under moesys's own checkpoint keys (`model.NAME` for a parameter,
`model.NAME.G` for global expert G of a stacked expert tensor), so whatever reads a moesys checkpoint tensor by
tensor (inference's loader, export, a training run's initial weights) reads a released model the same way.

Opening reads config.json and the safetensors headers only: every key is resolved to its stored tensor (the classic
layout, else transformers 5's fused experts and renamed modules) and its shape checked, and a stored tensor no key
reads is an error. A tensor is read when it is asked for: a view of the mapped file where the layouts agree, else one
tensor's converted copy; no step holds more than one tensor of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from runtime.config import ModelConfig
from runtime.files.checkpoint_format import MODEL, tensor_key
from runtime.hf.families import Family, family_named
from runtime.hf.files import HFCheckpointError, HFTensorFiles, read_config_json, tokenizer_files
from runtime.hf.names import TensorName, tensor_names, to_moesys
from runtime.inference.expert_source import ExpertSource
from runtime.inference.mapped import copy_to
from runtime.model.init import copy_weights
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param

PathLike = str | Path


def read_hf_config(path: PathLike) -> tuple[ModelConfig, Family, dict]:
    """(model section, family, config.json as a dict) of a model directory from its config.json alone: what a plan
    needs, with or without the weights beside it."""
    path = Path(path)
    data = read_config_json(path)
    where = str(path / "config.json")
    family = family_named(data.get("model_type"), where)
    return family.model_config(data, where), family, data


class HFCheckpoint:
    """config.json -> `config` (the model section, `family` its table entry) and the tensors by moesys key."""

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self.config, self.family, self.source_config = read_hf_config(self.path)
        self.files = HFTensorFiles(self.path)
        self.entries: dict[str, TensorName] = {}
        self._readers: dict[str, Callable[[], Tensor]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        for entry in tensor_names(self.config, self.family.layout):
            key = tensor_key(MODEL, entry.ours, entry.expert)
            self.entries[key] = entry
            self._readers[key], self._dtypes[key] = self._reader(entry)
        if self.config.tie_embeddings and "lm_head.weight" in self.files:
            self.files.used.add("lm_head.weight")  # a tied checkpoint may still store the head: it is the embedding
        extra = self.files.unused()
        if extra:
            raise HFCheckpointError(f"unexpected tensor {extra[0]} in {self.files.file_of(extra[0])} "
                                    f"({len(extra)} in all) for model_type={self.family.model_type}")

    # ---- resolving a key to its stored tensor ----

    def _stored(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """The stored tensor `name` (a view of its map, nothing read), its shape checked."""
        tensor = self.files.get(name)
        if tuple(tensor.shape) != shape:
            raise HFCheckpointError(f"{name} in {self.files.file_of(name)}: shape {tuple(tensor.shape)}, expected "
                                    f"{shape}")
        return tensor

    def _alias(self, name: str) -> str:
        """`name` as transformers 5's modules call it, where the classic name is not stored."""
        for classic, module in self.family.layout.aliases:
            if name not in self.files and classic in name:
                name = name.replace(classic, module)
        return name

    def _reader(self, entry: TensorName) -> tuple[Callable[[], Tensor], torch.dtype]:
        """How to read `entry` in moesys's layout, and the dtype it is stored in."""
        name = entry.hf if entry.hf in self.files else self._alias(entry.hf)
        if name in self.files:
            dtype = self._stored(name, entry.hf_shape).dtype
            return (lambda: to_moesys(entry, self._stored(name, entry.hf_shape))), dtype
        if entry.expert is not None:
            return self._fused_reader(entry)
        if entry.ours.endswith("router.score_bias"):  # absent: no correction, as transformers' zero init
            return (lambda: torch.zeros(entry.shape)), torch.float32
        raise HFCheckpointError(f"missing tensor {entry.hf}")

    def _fused_reader(self, entry: TensorName) -> tuple[Callable[[], Tensor], torch.dtype]:
        """One expert's slice of transformers 5's fused experts: gate_up_proj [E, 2F, D] (gate rows, then up rows)
        and down_proj [E, D, F]."""
        cfg = self.config
        E, F, D = cfg.num_experts, cfg.ffn_size, cfg.hidden_size
        prefix = self._alias(entry.hf.rsplit(".experts.", 1)[0] + ".experts.")
        gate_up, down = prefix + "gate_up_proj", prefix + "down_proj"
        if gate_up not in self.files:
            raise HFCheckpointError(f"missing tensor {entry.hf} (nor {gate_up})")
        self._stored(gate_up, (E, 2 * F, D))
        dtype = self._stored(down, (E, D, F)).dtype
        w, j = entry.ours.rsplit(".", 1)[1], entry.expert
        if w == "w2":
            return (lambda: self._stored(down, (E, D, F))[j]), dtype
        rows = slice(0, F) if w == "w1" else slice(F, 2 * F)
        return (lambda: self._stored(gate_up, (E, 2 * F, D))[j, rows]), dtype

    # ---- reading ----

    def __contains__(self, key: str) -> bool:
        return key in self._readers

    def keys(self) -> Iterator[str]:
        return iter(self._readers)

    def get(self, key: str) -> Tensor:
        """The tensor of checkpoint key `key` in moesys's layout (a view of the map where it can be)."""
        return self._readers[key]()

    def spec(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(stored dtype, moesys shape) of `key`, without reading it."""
        return self._dtypes[key], self.entries[key].shape

    def nbytes(self, key: str) -> int:
        dtype, shape = self.spec(key)
        return int(torch.Size(shape).numel()) * dtype.itemsize

    def copy_into(self, model: nn.Module) -> None:
        """Copy the weights into a materialized moesys model built from self.config, or into one rank's part of it
        (its experts module holds global experts first_expert..first_expert + e), one tensor or one expert at a
        time; parameters still on the meta device (those an offloader keeps elsewhere) are left alone."""
        copy_weights(model, lambda name, expert, shape: self.get(tensor_key(MODEL, name, expert)))

    def expert_source(self, model: Transformer, dtype: torch.dtype | None = None) -> ExpertSource:
        """Each MoE layer's experts of `model` (built from self.config) as per-expert tensors where they lie."""
        layers = []
        for name, module in model.named_modules():
            if name.endswith("ffn.experts"):
                layers.append({w: [self.get(tensor_key(MODEL, f"{name}.{w}", j)) for j in range(param.shape[0])]
                               for w, param in module.weights().items() if param is not None})
        return ExpertSource(layers, self.config.expert_type, dtype, self.files)

    def tokenizer_files(self) -> list[Path]:
        return tokenizer_files(self.path)

    def stored_bytes(self) -> int:
        return self.files.stored_bytes()

    def close(self) -> None:
        self.files.close()


def open_hf_model(path: PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
                  ) -> tuple[ModelConfig, Transformer, ExpertSource]:
    """A model directory as (config, eval-mode model whose dense weights are on `device` and whose experts are still
    on the meta device, where the experts lie in the files). dtype None keeps the stored one."""
    checkpoint = HFCheckpoint(path)
    cfg = checkpoint.config
    with torch.device("meta"):
        model = Transformer(cfg)
    state = {name: copy_to(checkpoint.get(tensor_key(MODEL, name)), device, dtype)
             for name, _ in model.named_parameters() if not is_expert_param(name)}
    model.load_state_dict(state, strict=False, assign=True)  # the experts stay on meta: not in `state`
    leftover = [n for n, b in model.named_buffers() if b.is_meta]
    if leftover:
        raise HFCheckpointError(f"moesys buffer {leftover[0]} has no value in the checkpoint")
    return cfg, model.eval(), checkpoint.expert_source(model, dtype)


def load_hf_model(path: PathLike, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> tuple[ModelConfig, Transformer]:
    """A model directory read into a moesys Transformer with every expert on `device` (eval mode)."""
    cfg, model, source = open_hf_model(path, dtype, device)
    for m, layer in enumerate(model.moe_layers()):
        source.fill(layer.experts, m, torch.device(device))
    return cfg, model
