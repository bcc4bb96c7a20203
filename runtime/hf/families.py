"""The one table of released families: for each, how its config.json maps to the model section (which parts it
has: shared experts, q/k norms, a router score bias, dense blocks), which parts its transformers class can express,
and its tensor layout. Import (checkpoint.py) and export (save.py, runtime/inference/export.py) both read it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.config import ModelConfig
from runtime.hf.config import moe_layers_of, pick, read_common, refuse, write_common
from runtime.hf.files import HFCheckpointError
from runtime.hf.names import TensorLayout

SWIGLU_ROPE = {"expert_type": ("swiglu",), "norm": ("rmsnorm",), "position": ("rope",), "bias": (False,),
               "capacity_factor": (0.0,)}
"""Parts every family here has: SwiGLU experts without biases, RMSNorm, RoPE, dropless routing."""


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    defaults: dict
    """The config class's defaults of the keys read_common reads (config.json may leave them out)."""
    read: Callable[[dict, str], dict]
    """config.json -> the family's own ModelConfig fields (experts, widths, its parts; over read_common's)."""
    write: Callable[[ModelConfig], dict]
    """ModelConfig -> the family's own config.json keys; raises HFCheckpointError for what it cannot express."""
    parts: dict[str, tuple]
    """ModelConfig field -> the values the family's transformers class can express."""
    layout: TensorLayout

    def model_config(self, hf: dict, source: str) -> ModelConfig:
        """The model section of a config.json of this family."""
        return ModelConfig(**{**read_common(hf, source, self.defaults), **self.read(hf, source)},
                           family=self.model_type)

    def problems(self, cfg: ModelConfig) -> list[str]:
        """What of cfg this family cannot express, as `model.KEY=VALUE (FAMILY needs ...)`."""
        return [f"model.{key}={getattr(cfg, key)!r} ({self.model_type} needs "
                f"{' or '.join(repr(v) for v in allowed)})"
                for key, allowed in {**SWIGLU_ROPE, **self.parts}.items() if getattr(cfg, key) not in allowed]

    def config_json(self, cfg: ModelConfig, dtype: torch.dtype, source: dict | None = None) -> dict:
        """The config.json transformers reads for cfg; HFCheckpointError when the family cannot express it."""
        bad = self.problems(cfg)
        if bad:
            raise HFCheckpointError(f"not a {self.model_type}-layout model: " + ", ".join(bad))
        out = write_common(cfg, self.model_type, self.architecture, self.defaults["router_aux_loss_coef"], dtype,
                           source)
        return {**out, **self.write(cfg)}


def _every_block_moe(cfg: ModelConfig, family: str) -> None:
    if cfg.num_moe_layers != cfg.num_layers:
        dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
        raise HFCheckpointError(f"not a {family}-layout model: blocks {dense} are dense (model.moe_layers, "
                                f"model.moe_layer_freq); every {family} block is an MoE block")


def _routing(hf: dict, source: str, experts: tuple[str, ...], top_k: tuple[str, ...]) -> dict:
    return dict(num_experts=pick(hf, experts, source), top_k=pick(hf, top_k, source))


def _no_sliding_window(hf: dict, source: str) -> None:
    if hf.get("use_sliding_window"):
        raise refuse(source, "use_sliding_window", True, "sliding-window attention")


# ---- mixtral ----

def _read_mixtral(hf: dict, source: str) -> dict:
    out = _routing(hf, source, ("num_local_experts", "num_experts"), ("num_experts_per_tok",))
    max_len = pick(hf, ("max_position_embeddings",), source, 4096 * 32)
    if hf.get("sliding_window"):  # within the window sliding-window attention is full causal attention
        max_len = min(max_len, hf["sliding_window"])
    return dict(out, ffn_hidden_size=pick(hf, ("intermediate_size",), source), normalize_top_k=True,
                router_jitter=float(hf.get("router_jitter_noise") or 0.0), max_seq_len=max_len)


def _write_mixtral(cfg: ModelConfig) -> dict:
    _every_block_moe(cfg, "mixtral")
    return {"intermediate_size": cfg.ffn_size, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k, "router_jitter_noise": cfg.router_jitter, "sliding_window": None}


# ---- qwen2_moe and qwen3_moe ----

def _qwen_layers(hf: dict, source: str, num_experts: int) -> dict:
    layers, step = pick(hf, ("num_hidden_layers",), source), hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    moe = moe_layers_of(layers, lambda i: i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return dict(moe_layers=moe, ffn_hidden_size=pick(hf, ("moe_intermediate_size",), source),
                dense_ffn_hidden_size=pick(hf, ("intermediate_size",), source),
                normalize_top_k=bool(hf.get("norm_topk_prob", False)))


def _write_qwen_layers(cfg: ModelConfig) -> dict:
    return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)],
            "moe_intermediate_size": cfg.ffn_size, "intermediate_size": cfg.dense_ffn_size,
            "norm_topk_prob": cfg.normalize_top_k, "use_sliding_window": False, "sliding_window": None}


def _read_qwen2(hf: dict, source: str) -> dict:
    _no_sliding_window(hf, source)
    routing = _routing(hf, source, ("num_experts", "num_local_experts"), ("num_experts_per_tok",))
    return dict(routing, **_qwen_layers(hf, source, routing["num_experts"]),
                shared_expert_hidden_size=pick(hf, ("shared_expert_intermediate_size",), source),
                shared_expert_gate=True, attention_bias="qkv" if hf.get("qkv_bias", True) else "none")


def _write_qwen2(cfg: ModelConfig) -> dict:
    if not cfg.shared_expert_hidden_size:
        raise HFCheckpointError("not a qwen2_moe-layout model: model.shared_expert_hidden_size=0 (every Qwen2-MoE "
                                "block has a gated shared expert)")
    return dict(_write_qwen_layers(cfg), shared_expert_intermediate_size=cfg.shared_expert_hidden_size,
                qkv_bias=cfg.qkv_bias, max_window_layers=cfg.num_layers)


def _read_qwen3(hf: dict, source: str) -> dict:
    _no_sliding_window(hf, source)
    routing = _routing(hf, source, ("num_experts", "num_local_experts"), ("num_experts_per_tok",))
    return dict(routing, **_qwen_layers(hf, source, routing["num_experts"]), qk_norm="head",
                attention_bias="all" if hf.get("attention_bias") else "none")


def _write_qwen3(cfg: ModelConfig) -> dict:
    return dict(_write_qwen_layers(cfg), attention_bias=cfg.qkv_bias)


# ---- olmoe ----

def _read_olmoe(hf: dict, source: str) -> dict:
    if hf.get("clip_qkv") is not None:
        raise refuse(source, "clip_qkv", hf["clip_qkv"], "clipped query/key/value states")
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    if hf.get("head_dim") not in (None, hidden // heads if hidden and heads else None):
        raise refuse(source, "head_dim", hf["head_dim"], "OLMoE's q/k norms span hidden_size")
    return dict(_routing(hf, source, ("num_experts", "num_local_experts"), ("num_experts_per_tok",)),
                ffn_hidden_size=pick(hf, ("intermediate_size",), source), qk_norm="full",
                attention_bias="all" if hf.get("attention_bias") else "none",
                normalize_top_k=bool(hf.get("norm_topk_prob", False)))


def _write_olmoe(cfg: ModelConfig) -> dict:
    _every_block_moe(cfg, "olmoe")
    if cfg.num_heads * cfg.head_width != cfg.hidden_size:
        raise HFCheckpointError(f"not an olmoe-layout model: model.head_dim={cfg.head_dim} (OLMoE's q/k norms span "
                                "hidden_size = num_heads x head_dim)")
    return {"intermediate_size": cfg.ffn_size, "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
            "attention_bias": cfg.qkv_bias, "clip_qkv": None, "norm_topk_prob": cfg.normalize_top_k}


# ---- ernie4_5_moe ----

def _read_ernie(hf: dict, source: str) -> dict:
    if hf.get("use_bias"):
        raise refuse(source, "use_bias", True, "biases in ERNIE's dense FFNs but not its experts")
    layers = pick(hf, ("num_hidden_layers",), source)
    start, end = hf.get("moe_layer_start_index", 1), hf.get("moe_layer_end_index", -1)
    end = layers - 1 if end in (None, -1) else end
    interval = hf.get("moe_layer_interval") or 1
    ffn = pick(hf, ("moe_intermediate_size",), source)
    return dict(_routing(hf, source, ("moe_num_experts", "num_experts"), ("moe_k", "num_experts_per_tok")),
                moe_layers=moe_layers_of(layers, lambda i: (i + 1) % interval == 0 and start <= i <= end),
                ffn_hidden_size=ffn, dense_ffn_hidden_size=pick(hf, ("intermediate_size",), source),
                shared_expert_hidden_size=ffn * (hf.get("moe_num_shared_experts") or 0), router_score_bias=True,
                normalize_top_k=True, attention_bias="none")


def _ernie_interval(moe: list[int], num_layers: int) -> tuple[int, int, int]:
    """(start, end, interval) whose rule gives exactly the blocks `moe`; HFCheckpointError when none does."""
    if moe:
        start, end = moe[0], moe[-1]
        for interval in range(1, num_layers + 1):
            if [i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end] == moe:
                return start, end, interval
    raise HFCheckpointError(f"not an ernie4_5_moe-layout model: MoE blocks {moe} are not every k-th block between "
                            "two indices (moe_layer_start_index .. moe_layer_end_index every moe_layer_interval)")


def _write_ernie(cfg: ModelConfig) -> dict:
    shared, ffn = cfg.shared_expert_hidden_size, cfg.ffn_size
    if shared % ffn:
        raise HFCheckpointError(f"not an ernie4_5_moe-layout model: model.shared_expert_hidden_size={shared} is not "
                                f"a multiple of the expert width {ffn} (ERNIE counts shared experts)")
    start, end, interval = _ernie_interval([i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)], cfg.num_layers)
    return {"moe_num_experts": cfg.num_experts, "moe_k": cfg.top_k, "moe_intermediate_size": ffn,
            "intermediate_size": cfg.dense_ffn_size, "moe_num_shared_experts": shared // ffn,
            "moe_layer_start_index": start, "moe_layer_end_index": end, "moe_layer_interval": interval,
            "moe_norm_min": 1e-12, "use_bias": False}


_QWEN_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                  "tie_word_embeddings": False, "router_aux_loss_coef": 0.001}
_NO_SHARED = {"shared_expert_hidden_size": (0,), "router_score_bias": (False,)}

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("mixtral", "MixtralForCausalLM",
           {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
            "tie_word_embeddings": False, "router_aux_loss_coef": 0.001},
           _read_mixtral, _write_mixtral,
           {"qk_norm": ("none",), "attention_bias": (None, "none"), "normalize_top_k": (True,), **_NO_SHARED},
           TensorLayout(moe="block_sparse_moe", experts=("w1", "w2", "w3"),
                        aliases=((".block_sparse_moe.", ".mlp."),))),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", _QWEN_DEFAULTS, _read_qwen2, _write_qwen2,
           {"qk_norm": ("none",), "attention_bias": (None, "none", "qkv"), "shared_expert_gate": (True,),
            "router_score_bias": (False,)},
           TensorLayout(shared="shared_expert", shared_gate="shared_expert_gate")),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _QWEN_DEFAULTS, _read_qwen3, _write_qwen3,
           {"qk_norm": ("head",), "attention_bias": (None, "none", "all"), **_NO_SHARED},
           TensorLayout()),
    Family("olmoe", "OlmoeForCausalLM",
           {"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "router_aux_loss_coef": 0.01},
           _read_olmoe, _write_olmoe,
           {"qk_norm": ("full",), "attention_bias": (None, "none", "all"), **_NO_SHARED},
           TensorLayout()),
    Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM",
           {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
            "tie_word_embeddings": True, "router_aux_loss_coef": 0.001},
           _read_ernie, _write_ernie,
           {"qk_norm": ("none",), "attention_bias": (None, "none"), "shared_expert_gate": (False,),
            "router_score_bias": (True,), "normalize_top_k": (True,)},
           TensorLayout(shared="shared_experts", interleaved_rope=True,
                        aliases=((".mlp.moe_statics.", ".mlp.gate.moe_statics."),))),
)}


def family_named(model_type: str | None, source: str) -> Family:
    """The family of a config.json's model_type; HFCheckpointError naming the ones moesys reads otherwise."""
    if model_type not in FAMILIES:
        raise HFCheckpointError(f"{source}: model_type={model_type!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def family_of(cfg: ModelConfig) -> Family:
    """The family a model is written as: model.family, else mixtral (moesys's own SwiGLU/RoPE models)."""
    return FAMILIES[cfg.family or "mixtral"]
