"""train.freeze: parameter sets a fine-tune leaves as they are (LlamaFactory's and torchtune's frozen modules). The
sets are disjoint and named after what they hold; a frozen parameter gets no gradient, so no reducer, clip or
optimizer sees it and it has no optimizer state (frozen offloaded experts: runtime/storage/offload_engine.py)."""

from __future__ import annotations

import re

from torch import nn

from runtime.config.schema import FREEZABLE

PATTERNS = {
    "embeddings": r"(tok_embeddings|pos_embeddings|output)\.weight",
    "norms": r"(.*\.)?(attention_norm|ffn_norm|norm|q_norm|k_norm)\.(weight|bias)",
    "attention": r"layers\.\d+\.attention\.w[qkvo]\.(weight|bias)",
    "router": r"layers\.\d+\.ffn\.router\..*",
    "experts": r"layers\.\d+\.ffn\.experts\..*",
    "shared_experts": r"layers\.\d+\.ffn\.shared_experts\..*",
}
"""Each set's parameters by qualified name: the input and output embeddings (a tied head is the input table), every
norm's gain and bias (the q/k norms too), the attention projections, the router's gate (and score bias), the routed
experts, the shared experts with their gate. The dense blocks' FFNs are in none of them."""
assert set(PATTERNS) == set(FREEZABLE)


def parameter_set(name: str) -> str | None:
    """The set parameter `name` belongs to, or None."""
    found = [s for s, pattern in PATTERNS.items() if re.fullmatch(pattern, name)]
    assert len(found) <= 1, (name, found)
    return found[0] if found else None


def freeze(model: nn.Module, sets: list[str]) -> list[str]:
    """Stop gradients of every parameter of `model` in one of `sets`; returns their names."""
    frozen = []
    for name, param in model.named_parameters():
        if parameter_set(name) in sets:
            param.requires_grad_(False)
            frozen.append(name)
    return frozen
