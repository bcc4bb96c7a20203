"""Import and export of Hugging Face Mixtral checkpoints (config.json + safetensors) for the moesys Transformer.

Reads the classic per-expert layout (block_sparse_moe.experts.{j}.w1/w2/w3) and the fused layout of transformers 5
module state dicts (mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj [E, D, F]); writes the classic one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors.torch import save_file

from runtime.errors import UserError
from runtime.io import fsync_dir, fsync_file
from runtime.config import ModelConfig
from runtime.inference.expert_source import ExpertSource
from runtime.inference.mapped import TensorFiles, copy_to
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param

PathLike = Union[str, os.PathLike]
INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


class HFCheckpointError(UserError):
    """A Hugging Face checkpoint moesys cannot read or write; the message names the file or tensor."""


# ---- config ----

def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """A ModelConfig for a Mixtral config.json dict (RoPE, RMSNorm, SwiGLU experts, no biases, dropless)."""
    if hf.get("model_type") != "mixtral":
        raise HFCheckpointError(f"{source}: model_type={hf.get('model_type')!r} is not 'mixtral'")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "num_local_experts", "num_experts_per_tok"):
        if key not in hf:
            raise HFCheckpointError(f"{source}: missing key {key!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, hidden // heads):
        raise HFCheckpointError(f"{source}: head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise HFCheckpointError(f"{source}: rope_type={rope.get('rope_type', rope.get('type'))!r} is not supported")
    theta = hf.get("rope_theta", rope.get("rope_theta", 1e6))
    max_len = hf.get("max_position_embeddings", 4096 * 32)
    if hf.get("sliding_window"):
        # within the window sliding-window attention is full causal attention: refuse longer sequences instead
        max_len = min(max_len, hf["sliding_window"])
    return ModelConfig(
        hidden_size=hidden, num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"],
        ffn_hidden_size=hf["intermediate_size"], num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"], expert_type="swiglu", moe_layer_freq=1, max_seq_len=max_len,
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-5), bias=False, position="rope",
        rope_theta=float(theta), tie_embeddings=bool(hf.get("tie_word_embeddings", False)), capacity_factor=0.0,
        normalize_top_k=True, aux_loss_weight=hf.get("router_aux_loss_coef", 0.001),
        router_jitter=hf.get("router_jitter_noise", 0.0) or 0.0,
    )


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json dict of a Mixtral-family ModelConfig; raises HFCheckpointError for other families."""
    wrong = {
        "expert_type": (cfg.expert_type, "swiglu"), "norm": (cfg.norm, "rmsnorm"), "position": (cfg.position, "rope"),
        "bias": (cfg.bias, False), "moe_layer_freq": (cfg.moe_layer_freq, 1),
        "normalize_top_k": (cfg.normalize_top_k, True), "capacity_factor": (cfg.capacity_factor, 0.0),
    }
    bad = [f"model.{k}={v!r} (Mixtral needs {want!r})" for k, (v, want) in wrong.items() if v != want]
    if cfg.num_experts < 1:
        bad.append(f"model.num_experts={cfg.num_experts} (Mixtral needs MoE layers)")
    if bad:
        raise HFCheckpointError("not a Mixtral-layout model: " + ", ".join(bad))
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "router_aux_loss_coef": cfg.aux_loss_weight, "router_jitter_noise": cfg.router_jitter,
        "sliding_window": None, "attention_dropout": 0.0, "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ---- tensor names ----

def dense_names(cfg: ModelConfig) -> dict[str, str]:
    """moesys parameter name -> HF tensor name, for every parameter that maps one to one."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        names[f"{ours}.attention_norm.weight"] = f"{hf}.input_layernorm.weight"
        names[f"{ours}.ffn_norm.weight"] = f"{hf}.post_attention_layernorm.weight"
        for w, proj in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")):
            names[f"{ours}.attention.{w}.weight"] = f"{hf}.self_attn.{proj}_proj.weight"
    return names


class _TensorFiles(TensorFiles):
    """Every tensor of a checkpoint directory by name, each a view of its file's memory map (read when used)."""

    def __init__(self, path: Path):
        index = path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
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
        return sorted(n for n in self.where if n not in self.used and not n.endswith(IGNORED_SUFFIXES))


def _checked(files: _TensorFiles, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    tensor = files.get(name)
    if tuple(tensor.shape) != shape:
        raise HFCheckpointError(f"{name} in {files.file_of(name)}: shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _expert_tensors(files: _TensorFiles, cfg: ModelConfig,
                    i: int) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """Layer i's router [E, D] and its experts, one view per expert (w1/w3 [F, D], w2 [D, F]), from either layout."""
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.ffn_size
    classic, fused = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
    if f"{fused}.experts.gate_up_proj" in files:
        gate_up_E2FD = _checked(files, f"{fused}.experts.gate_up_proj", (E, 2 * F, D))  # gate rows, then up rows
        down_EDF = _checked(files, f"{fused}.experts.down_proj", (E, D, F))
        experts = {"w1": [gate_up_E2FD[j, :F] for j in range(E)], "w3": [gate_up_E2FD[j, F:] for j in range(E)],
                   "w2": list(down_EDF.unbind(0))}
        return _checked(files, f"{fused}.gate.weight", (E, D)), experts
    shapes = {"w1": (F, D), "w2": (D, F), "w3": (F, D)}
    experts = {w: [_checked(files, f"{classic}.experts.{j}.{w}.weight", shape) for j in range(E)]
               for w, shape in shapes.items()}
    return _checked(files, f"{classic}.gate.weight", (E, D)), experts


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: no such checkpoint directory")
    config = path / "config.json"
    if not config.is_file():
        raise HFCheckpointError(f"{config}: missing")
    try:
        return json.loads(config.read_text())
    except ValueError as exc:
        raise HFCheckpointError(f"{config}: not valid JSON ({exc})") from None


def open_hf_mixtral(path: PathLike, dtype: Optional[torch.dtype] = None,
                    device: Union[str, torch.device] = "cpu") -> tuple[ModelConfig, Transformer, ExpertSource]:
    """Read a Mixtral checkpoint directory without reading its experts: (config, eval-mode model whose dense
    weights are on `device` and whose experts are still on the meta device, where the experts lie in the files).
    dtype None keeps the stored one."""
    path = Path(path)
    cfg = config_from_hf(_read_config(path), str(path / "config.json"))
    files = _TensorFiles(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = dict(model.named_parameters())
    state = {ours: _checked(files, hf, tuple(expected[ours].shape)) for ours, hf in dense_names(cfg).items()}
    layers = []
    for i in range(cfg.num_layers):
        state[f"layers.{i}.ffn.router.gate.weight"], experts = _expert_tensors(files, cfg, i)
        layers.append(experts)
    extra = files.unused()
    if extra:
        raise HFCheckpointError(f"unexpected tensor {extra[0]} in {files.file_of(extra[0])} ({len(extra)} in all)")
    if cfg.tie_embeddings and "lm_head.weight" in files:
        files.used.add("lm_head.weight")  # a tied checkpoint may still store the head: it is the embedding
    unknown = sorted(set(state) - set(expected))
    if unknown:  # the MoE layer's parameter names changed under this importer
        raise HFCheckpointError(f"moesys has no parameter {unknown[0]} to load into")
    missing = sorted(n for n in set(expected) - set(state) if not is_expert_param(n))
    if missing:
        raise HFCheckpointError(f"no checkpoint tensor maps to moesys parameter {missing[0]}")
    for name, tensor in state.items():
        state[name] = copy_to(tensor, device, dtype)
    model.load_state_dict(state, strict=False, assign=True)
    leftover = [n for n, b in model.named_buffers() if b.is_meta]
    if leftover:
        raise HFCheckpointError(f"moesys buffer {leftover[0]} has no value in the checkpoint")
    return cfg, model.eval(), ExpertSource(layers, "swiglu", dtype, files)


def load_hf_mixtral(path: PathLike, dtype: Optional[torch.dtype] = None,
                    device: Union[str, torch.device] = "cpu") -> tuple[ModelConfig, Transformer]:
    """Read a Mixtral checkpoint directory into a moesys Transformer with every expert on `device` (eval mode)."""
    cfg, model, source = open_hf_mixtral(path, dtype, device)
    for m, layer in enumerate(model.moe_layers()):
        source.fill(layer.experts, m, torch.device(device))
    return cfg, model


# ---- export ----

def hf_tensor_names(cfg: ModelConfig) -> list[tuple[str, str, Optional[int]]]:
    """(HF name, moesys parameter, expert index or None) for every tensor of the classic Mixtral layout, in the
    order it is written: dense weights, then each layer's router and experts."""
    out: list[tuple[str, str, Optional[int]]] = [(hf, ours, None) for ours, hf in dense_names(cfg).items()]
    for i in range(cfg.num_layers):
        prefix, ours = f"model.layers.{i}.block_sparse_moe", f"layers.{i}.ffn"
        out.append((f"{prefix}.gate.weight", f"{ours}.router.gate.weight", None))
        for j in range(cfg.num_experts):
            out += [(f"{prefix}.experts.{j}.{w}.weight", f"{ours}.experts.{w}", j) for w in ("w1", "w2", "w3")]
    return out


def hf_state_dict(model: Transformer, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's tensors under classic HF Mixtral names (per-expert w1/w2/w3), each its own contiguous copy."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = {hf: params[ours] if j is None else params[ours][j] for hf, ours, j in hf_tensor_names(cfg)}
    return {k: v.to("cpu").contiguous().clone() for k, v in out.items()}


def save_hf_mixtral(model: Transformer, cfg: ModelConfig, path: PathLike) -> None:
    """Write config.json + model.safetensors (classic layout) atomically: a temp dir, fsync, then rename."""
    path = Path(path)
    config = config_to_hf(cfg, model.tok_embeddings.weight.dtype)  # refuses non-Mixtral models before any write
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


__all__ = ["HFCheckpointError", "config_from_hf", "config_to_hf", "dense_names", "hf_state_dict", "hf_tensor_names",
           "load_hf_mixtral", "open_hf_mixtral", "save_hf_mixtral"]
