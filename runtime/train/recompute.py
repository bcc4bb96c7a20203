"""Activation recomputation (train.recompute; Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
Megatron's selective recomputation): what a forward keeps for backward is traded for a second forward in backward.
`block` keeps each transformer block's input only; `moe` keeps the experts' input rows and output, not their [R, F]
intermediates, the largest activations of an MoE model. Gradients are exact: the same operators run on the same
inputs again (torch.utils.checkpoint, non-reentrant).

A model converter, applied before the optimizer exists: forwards are wrapped in place, so parameter names and
checkpoints do not change.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from runtime.model.transformer import Transformer
from runtime.moe.activations import unpooled_activations
from runtime.moe.experts import GroupedExperts

MODES = ("none", "moe", "block")


def recomputed(fn, preserve_rng_state: bool = True):
    """`fn` whose activations are recomputed in backward when it runs under autograd (called as is otherwise). Both
    of its forwards take fresh activations, not pooled buffers (which its autograd nodes would hold)."""
    def unpooled(*args, **kwargs):
        with unpooled_activations():
            return fn(*args, **kwargs)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(unpooled, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)
    return run


def apply_recompute(model: Transformer, mode: str, offload=None) -> None:
    """Wrap `model`'s blocks (block) or its experts' FFNs (moe: the resident GroupedExperts' forward, and the
    offloaded layers' FFN, which `offload` (an OffloadEngine) runs on the weights it fetched); none does nothing."""
    if mode not in MODES:
        raise ValueError(f"train.recompute={mode!r} is not one of {', '.join(MODES)}")
    if mode == "block":
        for block in model.layers:
            block.forward = recomputed(block.forward)
    elif mode == "moe":
        for layer in model.moe_layers():
            if isinstance(layer.experts, GroupedExperts):
                # an instance's forward wrapped in place (nn.Module calls self.forward); mypy forbids assigning a method
                layer.experts.forward = recomputed(  # type: ignore[method-assign]
                    layer.experts.forward, preserve_rng_state=False)
        if offload is not None:
            offload.ffn = recomputed(offload.ffn, preserve_rng_state=False)
