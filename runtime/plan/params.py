"""Parameter counts from the config alone: total, dense D, sparse S, active per token, embedding (the paper's Eq. 2).

Mirrors the parameter set of runtime/model/transformer.py exactly; a test checks it against sum(p.numel()).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int
    dense: int
    """D: everything that is not a routed expert's weight (attention, norms, routers, dense FFNs, shared experts,
    embeddings)."""
    sparse: int
    """S: expert weights of all MoE layers."""
    active: int
    """Parameters one token touches: dense plus top_k experts per MoE layer."""
    embedding: int
    """Token embedding, learned positions and an untied output head."""
    per_expert: int
    """One expert's FFN."""
    moe_layers: int


def _linear(out_features: int, in_features: int, bias: bool) -> int:
    return out_features * in_features + (out_features if bias else 0)


def ffn_params(m: ModelConfig, width: int | None = None) -> int:
    """One FFN of `width` (default: one expert's, m.ffn_size): w1, w2 and, for SwiGLU, w3."""
    f = width or m.ffn_size
    n = _linear(f, m.hidden_size, m.bias) + _linear(m.hidden_size, f, m.bias)
    if m.expert_type == "swiglu":
        n += _linear(f, m.hidden_size, m.bias)
    return n


def attention_params(m: ModelConfig) -> int:
    """One attention: the four projections with their biases, and the q/k norms' weights."""
    d, q, kv = m.hidden_size, m.num_heads * m.head_width, m.kv_heads * m.head_width
    n = _linear(q, d, m.qkv_bias) + 2 * _linear(kv, d, m.qkv_bias) + _linear(d, q, m.out_bias)
    if m.qk_norm == "head":
        n += 2 * m.head_width
    elif m.qk_norm == "full":
        n += q + kv
    return n


def count_parameters(m: ModelConfig) -> ParamCounts:
    d = m.hidden_size
    attention = attention_params(m)
    norm = d * (2 if m.norm == "layernorm" and m.bias else 1)
    expert = ffn_params(m)
    moe_layers = m.num_moe_layers
    dense_blocks = m.num_layers - moe_layers
    moe_dense = m.num_experts * d + (m.num_experts if m.router_score_bias else 0)  # router, its score bias
    if m.shared_expert_hidden_size:
        moe_dense += ffn_params(m, m.shared_expert_hidden_size) + (d if m.shared_expert_gate else 0)
    embedding = m.vocab_size * d
    embedding += m.max_seq_len * d if m.position == "learned" else 0
    embedding += 0 if m.tie_embeddings else m.vocab_size * d
    sparse = moe_layers * m.num_experts * expert
    dense = (m.num_layers * (attention + 2 * norm) + dense_blocks * ffn_params(m, m.dense_ffn_size)
             + moe_layers * moe_dense + norm + embedding)
    active = dense + moe_layers * m.top_k * expert
    return ParamCounts(total=dense + sparse, dense=dense, sparse=sparse, active=active, embedding=embedding,
                       per_expert=expert, moe_layers=moe_layers)
