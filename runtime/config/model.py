"""The model section: the transformer, its MoE layers, and the parts released families add (shared experts, q/k
norms, a router score bias, dense blocks of their own width), each chosen by a key whose default keeps the model as
before."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from runtime.config.checks import ConfigSection, Problems

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "ernie4_5_moe")
"""The released families moesys reads and writes in their Hugging Face format (runtime/hf/families.py)."""


@dataclass
class ModelConfig(ConfigSection):
    """The transformer and its MoE layers (the paper's "Experiment"; Mixtral for the SwiGLU/RoPE family)."""

    hidden_size: int = 128
    """Model width D."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention (query) heads."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means num_heads."""
    head_dim: int | None = None
    """Width of one attention head; None means hidden_size / num_heads."""
    vocab_size: int = 256
    """Vocabulary V: at least train.tokenizer's (bytes: 259 with eos and the chat markers, 256 without them); more
    leaves ids no text maps to."""
    ffn_hidden_size: int | None = None
    """Expert FFN width F (and the dense blocks' unless dense_ffn_hidden_size is set); None means 4 x hidden_size."""
    dense_ffn_hidden_size: int | None = None
    """FFN width of the dense (non-MoE) blocks; None means ffn_hidden_size."""
    num_experts: int = 8
    """Experts per MoE layer E."""
    top_k: int = 2
    """Experts each token is routed to (1 = Switch, 2 = GShard)."""
    expert_type: Annotated[str, Literal["gelu", "swiglu"]] = "gelu"
    """FFN kind: gelu (GPT) or swiglu (Mixtral)."""
    moe_layer_freq: int = 1
    """Every k-th block is an MoE block (1 = all)."""
    moe_layers: list[int] | None = None
    """The 0-based indices of the MoE blocks, the others dense; None means every moe_layer_freq-th block."""
    shared_expert_hidden_size: int = 0
    """FFN width of the shared expert every token of an MoE block passes through beside its routed experts (N shared
    experts of width F are one of width N x F); 0: none."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid of a learned projection of the token (Qwen2-MoE)."""
    max_seq_len: int = 256
    """Longest sequence; sizes learned positions and the RoPE table."""
    norm: Annotated[str, Literal["layernorm", "rmsnorm"]] = "layernorm"
    """layernorm or rmsnorm."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    qk_norm: Annotated[str, Literal["none", "head", "full"]] = "none"
    """RMSNorm of queries and keys before RoPE: none, head (over each head's values, Qwen3-MoE) or full (over all
    heads' values at once, OLMoE)."""
    bias: bool = True
    """Biases in linear layers and LayerNorm."""
    attention_bias: Annotated[str, Literal["none", "qkv", "all"]] | None = None
    """Biases of the attention projections: none, qkv (query, key and value; Qwen2-MoE) or all; None follows
    model.bias."""
    position: Annotated[str, Literal["learned", "rope"]] = "learned"
    """learned positions or rope."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    capacity_factor: float = 0.0
    """Expert capacity = factor x tokens x top_k / experts; 0 means dropless."""
    drop_policy: Annotated[str, Literal["cut", "random", "routing_weight"]] = "cut"
    """Which tokens an over-full expert drops: cut (latest), random, routing_weight (lowest weight)."""
    router_jitter: float = 0.0
    """Multiplicative jitter epsilon on router inputs while training."""
    router_input_dropout: float = 0.0
    """Dropout on router inputs while training."""
    router_gumbel: bool = False
    """Gumbel-max sampling of the second..k-th expert while training."""
    router_score_bias: bool = False
    """A fixed per-expert bias added to the routing probabilities when choosing the top-k, not to the combine weights
    (ERNIE-4.5's score correction; a parameter that trains only where something sets it)."""
    normalize_top_k: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Mixtral)."""
    load_balancing: Annotated[str, Literal["switch", "pooled"]] = "switch"
    """Form of the load-balancing loss: switch (each MoE layer's Switch loss, summed over layers) or pooled
    (transformers': expert loads and mean probabilities pooled over all MoE layers into one loss)."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss."""
    sparsity_loss_weight: float = 0.0
    """Weight of the L1 sparsity loss on routing probabilities."""
    importance_loss_weight: float = 0.0
    """Weight of the mean-importance loss."""
    embedding_partition: bool = False
    """Split the [V, H] embedding column-wise over data-parallel ranks (the paper's "Embedding Partition in Data
    Parallelism")."""
    family: Annotated[str, Literal[FAMILIES]] | None = None
    """The released family this model was read from and export.format=hf writes it as (mixtral, qwen2_moe, qwen3_moe,
    olmoe, ernie4_5_moe); None: moesys's own, written as mixtral where its parts allow."""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def dense_ffn_size(self) -> int:
        return self.dense_ffn_hidden_size or self.ffn_size

    @property
    def head_width(self) -> int:
        """The width of one attention head: model.head_dim, else hidden_size / num_heads."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether the query, key and value projections have biases."""
        return self.bias if self.attention_bias is None else self.attention_bias != "none"

    @property
    def out_bias(self) -> bool:
        """Whether the attention's output projection has a bias."""
        return self.bias if self.attention_bias is None else self.attention_bias == "all"

    def is_moe_layer(self, index: int) -> bool:
        """Block `index` (0-based) is an MoE block: listed in moe_layers, else the last of each group of
        moe_layer_freq."""
        if self.num_experts <= 0:
            return False
        if self.moe_layers is not None:
            return index in self.moe_layers
        return index % self.moe_layer_freq == self.moe_layer_freq - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    BOUNDS = (("positive", "hidden_size num_layers num_heads vocab_size max_seq_len moe_layer_freq"),
              ("positive or null", "num_kv_heads head_dim ffn_hidden_size dense_ffn_hidden_size"),
              (">= 0", "num_experts shared_expert_hidden_size"), ("positive", "top_k"),
              (">= 0", "capacity_factor router_jitter router_input_dropout aux_loss_weight z_loss_weight "
                       "sparsity_loss_weight importance_loss_weight"))

    def rules(self, p: Problems, at: str) -> None:
        if self.num_experts > 0:
            p.need(self.top_k <= self.num_experts,
                   f"{at}.top_k={self.top_k} exceeds {at}.num_experts={self.num_experts}")
        if self.num_heads > 0:
            p.need(self.head_dim is not None or self.hidden_size % self.num_heads == 0,
                   f"{at}.num_heads={self.num_heads} must divide {at}.hidden_size={self.hidden_size} (or set "
                   f"{at}.head_dim)")
            if self.kv_heads > 0:
                p.need(self.num_heads % self.kv_heads == 0,
                       f"{at}.num_kv_heads={self.kv_heads} must divide {at}.num_heads={self.num_heads}")
            if self.position == "rope":
                p.need(self.head_width % 2 == 0, f"{at}.position=rope needs an even head dim (got {self.head_width})")
        self._layer_rules(p, at)
        p.need(not self.shared_expert_gate or self.shared_expert_hidden_size > 0,
               f"{at}.shared_expert_gate=true needs a shared expert: set {at}.shared_expert_hidden_size")
        p.need(not (self.router_score_bias and self.router_gumbel),
               f"{at}.router_score_bias=true and {at}.router_gumbel=true both change which experts are chosen; "
               "set one of them")

    def _layer_rules(self, p: Problems, at: str) -> None:
        if self.moe_layers is None:
            return
        outside = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
        p.need(not outside, f"{at}.moe_layers names block {outside[0] if outside else ''}, outside 0.."
                            f"{self.num_layers - 1} ({at}.num_layers={self.num_layers})")
        p.need(len(set(self.moe_layers)) == len(self.moe_layers), f"{at}.moe_layers={self.moe_layers} repeats a block")
        p.need(self.moe_layer_freq == 1, f"{at}.moe_layers and {at}.moe_layer_freq={self.moe_layer_freq} both choose "
                                         f"the MoE blocks; set one of them")
