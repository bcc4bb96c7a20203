"""Benchmark of one MoE layer, forward + backward, side by side with its ceiling and a plain loop MoE
(ORT MoE "merged experts"): (1) the dropless MoELayer, (2) the same expert kernel on equal row counts with no
routing at all, (3) routing + per-expert Python loop + index_add. Interleaved, medians.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from runtime.config import ModelConfig
from runtime.moe.experts import expert_ffn, reference_moe_forward
from runtime.moe.layer import MoELayer


def _equal_counts(rows: int, experts: int) -> torch.Tensor:
    counts = torch.full((experts,), rows // experts, dtype=torch.long)
    counts[: rows % experts] += 1
    return counts


def run_moe_layer_bench(tokens: int = 4096, hidden: int = 512, ffn: int = 2048, experts: int = 8, top_k: int = 2,
                        repeats: int = 7, warmup: int = 1, expert_type: str = "gelu", bias: bool = True,
                        seed: int = 0, device: str | None = None) -> dict:
    """Forward+backward tokens/s of moe, ceiling and loop, measured round-robin; returns a JSON-ready dict.
    device: default the GPU where there is one (as `bench ring`), else the CPU."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(seed)
    cfg = ModelConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k,
                      expert_type=expert_type, bias=bias, capacity_factor=0.0)
    layer = MoELayer(cfg).to(dev)
    weights = layer.experts.weights()
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
        y = expert_ffn(x_RD, counts_e, **weights, kind=expert_type, impl=layer.experts.impl)
        y.backward(g_RD)

    def loop() -> None:
        routing = layer.router(x_TD)
        y = reference_moe_forward(x_TD, routing.expert_ids_TK, routing.weights_TK, **weights, kind=expert_type)
        y.backward(g_TD)

    runs: dict[str, Callable[[], None]] = {"moe": moe, "ceiling": ceiling, "loop": loop}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + repeats):
        for name, fn in runs.items():
            layer.zero_grad(set_to_none=True)
            x_TD.grad = x_RD.grad = None
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    tps = {name: tokens / statistics.median(ts) for name, ts in times.items()}
    rounds = list(zip(times["moe"], times["ceiling"], times["loop"]))
    moe_vs_ceiling = [c / m for m, c, _ in rounds]
    moe_vs_loop = [lp / m for m, _, lp in rounds]
    return {
        "config": {"tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts, "top_k": top_k,
                   "expert_type": expert_type, "bias": bias, "repeats": repeats, "warmup": warmup},
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "expert_impl": layer.experts.impl,
        "moe_tokens_per_s": tps["moe"],
        "ceiling_tokens_per_s": tps["ceiling"],
        "loop_tokens_per_s": tps["loop"],
        "moe_vs_ceiling": statistics.median(moe_vs_ceiling),
        "moe_vs_loop": statistics.median(moe_vs_loop),
        "moe_vs_ceiling_rounds": moe_vs_ceiling,
        "moe_vs_loop_rounds": moe_vs_loop,
        "median_s": {name: statistics.median(ts) for name, ts in times.items()},
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run_moe_layer_bench(), indent=2))
