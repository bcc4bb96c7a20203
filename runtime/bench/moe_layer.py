"""Benchmark of one MoE layer, forward + backward, side by side with its ceiling and a plain loop MoE
(ORT MoE "merged experts"): (1) the dropless MoELayer, (2) the same expert kernel on equal row counts with no
routing at all, (3) routing + per-expert Python loop + index_add. Interleaved, medians. Beside it, `fine_grained`:
the layer at Qwen3-MoE's shape against transformers' own block (runtime/bench/qwen3_moe_block.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runtime.bench.qwen3_moe_block import run_qwen3_moe_block_bench
from runtime.bench.rounds import alternate, paired_ratios
from runtime.config import ModelConfig
from runtime.moe.experts import GroupedExperts, expert_ffn, reference_moe_forward
from runtime.moe.layer import MoELayer


def _equal_counts(rows: int, experts: int) -> torch.Tensor:
    counts = torch.full((experts,), rows // experts, dtype=torch.long)
    counts[: rows % experts] += 1
    return counts


FINE_GRAINED = {"tokens": 1024, "hidden": 2048, "ffn": 768, "experts": 128, "top_k": 8}
"""Qwen3-30B-A3B's MoE layer at 1,024 tokens: 128 experts of 768, top-8 (8x the routed rows of a top-2 layer)."""


def run_moe_layer_bench(tokens: int = 4096, hidden: int = 512, ffn: int = 2048, experts: int = 8, top_k: int = 2,
                        repeats: int = 7, warmup: int = 1, expert_type: str = "gelu", bias: bool = True,
                        seed: int = 0, device: str | None = None, fine_grained: dict | None = FINE_GRAINED,
                        fine_grained_repeats: int = 3) -> dict:
    """Forward+backward tokens/s of moe, ceiling and loop, measured round-robin; returns a JSON-ready dict.
    device: default the GPU where there is one (as `bench ring`), else the CPU. fine_grained: the shape (keys of
    FINE_GRAINED, plus dtypes) of the comparison with transformers' Qwen3-MoE block, timed over
    `fine_grained_repeats` rounds after the output check (its eager contender takes minutes a round on a CPU); None
    skips it."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(seed)
    cfg = ModelConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k,
                      expert_type=expert_type, bias=bias, capacity_factor=0.0)
    layer = MoELayer(cfg).to(dev)
    grouped = layer.experts
    assert isinstance(grouped, GroupedExperts), "a layer built here holds its own experts"
    weights: dict[str, Any] = grouped.weights()
    x_TD = torch.randn(tokens, hidden, device=dev, requires_grad=True)
    g_TD = torch.randn(tokens, hidden, device=dev)
    rows = tokens * top_k
    x_RD = torch.randn(rows, hidden, device=dev, requires_grad=True)
    g_RD = torch.randn(rows, hidden, device=dev)
    counts_e = _equal_counts(rows, experts).to(dev)
    one = torch.ones((), device=dev)

    def moe() -> None:
        y, stats = layer(x_TD)
        torch.autograd.backward((y, stats.aux_loss), (g_TD, one))

    def ceiling() -> None:
        y = expert_ffn(x_RD, counts_e, **weights, kind=expert_type, impl=grouped.impl)
        y.backward(g_RD)

    def loop() -> None:
        routing = layer.router(x_TD)
        y = reference_moe_forward(x_TD, routing.expert_ids_TK, routing.weights_TK, **weights, kind=expert_type)
        y.backward(g_TD)

    runs: dict[str, Callable[[], None]] = {"moe": moe, "ceiling": ceiling, "loop": loop}

    def reset() -> None:
        layer.zero_grad(set_to_none=True)
        x_TD.grad = x_RD.grad = None

    times = alternate(runs, reset, sync, repeats, warmup)
    fine = None
    if fine_grained is not None:
        fine = run_qwen3_moe_block_bench(**{**FINE_GRAINED, **fine_grained}, repeats=fine_grained_repeats,
                                         seed=seed, device=dev, sync=sync)
    return {
        "config": {"tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts, "top_k": top_k,
                   "expert_type": expert_type, "bias": bias, "repeats": repeats, "warmup": warmup},
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "expert_impl": grouped.impl,
        **paired_ratios(times, tokens),
        **({"fine_grained": fine} if fine is not None else {}),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run_moe_layer_bench(), indent=2))
