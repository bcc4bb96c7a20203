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
    """D: everything that is not an expert weight (attention, norms, routers, dense FFNs, embeddings)."""
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


def ffn_params(m: ModelConfig) -> int:
    """One FFN (a dense block's or one expert's): w1, w2 and, for SwiGLU, w3."""
    n = _linear(m.ffn_size, m.hidden_size, m.bias) + _linear(m.hidden_size, m.ffn_size, m.bias)
    if m.expert_type == "swiglu":
        n += _linear(m.ffn_size, m.hidden_size, m.bias)
    return n


def count_parameters(m: ModelConfig) -> ParamCounts:
    d, hd = m.hidden_size, m.head_dim
    attention = (_linear(m.num_heads * hd, d, m.bias) + 2 * _linear(m.kv_heads * hd, d, m.bias)
                 + _linear(d, m.num_heads * hd, m.bias))
    norm = d * (2 if m.norm == "layernorm" and m.bias else 1)
    expert = ffn_params(m)
    moe_layers = m.num_moe_layers
    dense_blocks = m.num_layers - moe_layers
    router = m.num_experts * d
    embedding = m.vocab_size * d
    embedding += m.max_seq_len * d if m.position == "learned" else 0
    embedding += 0 if m.tie_embeddings else m.vocab_size * d
    sparse = moe_layers * m.num_experts * expert
    dense = (m.num_layers * (attention + 2 * norm) + dense_blocks * expert + moe_layers * router
             + norm + embedding)
    active = dense + moe_layers * m.top_k * expert
    return ParamCounts(total=dense + sparse, dense=dense, sparse=sparse, active=active, embedding=embedding,
                       per_expert=expert, moe_layers=moe_layers)
