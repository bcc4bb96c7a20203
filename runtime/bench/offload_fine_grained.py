"""`moesys bench offload`'s fine-grained variant: the offloaded step with 128 experts a layer, top-8 (Qwen3-MoE's
regime), beside 8 experts, top-2 (Mixtral's), both SwiGLU without biases and holding as many expert parameters a
layer (128 experts of ffn/16 against 8 of ffn), at the realistic load: bytes moved, the SSD cache's hit rate, and the
host work per active expert parameter against its floor. Per-expert costs (Python work, small copies, an optimizer
call per expert and tensor) that stay hidden at 8 experts would show at 16x as many, each 16x smaller.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.config import MoesysConfig

VARIANTS = {"coarse": {"experts": 8, "top_k": 2, "ffn_divisor": 1},
            "fine": {"experts": 128, "top_k": 8, "ffn_divisor": 16}}
"""The two shapes compared: the experts a layer, the experts a token and the expert ffn size's divisor."""
KEPT = ("none_steps_per_s", "cpu_steps_per_s", "ssd_steps_per_s", "cpu_vs_none", "ssd_vs_none", "mean_active_experts",
        "ssd_cache_hit_rate", "ssd_bytes_per_step", "ssd_read_bytes_per_s", "ssd_write_bytes_per_s",
        "ssd_disk_read_bytes_per_step", "cpu", "ssd")
"""What each variant reports of the comparison (cpu and ssd: the priced host side, bytes per step among it)."""


def run_fine_grained(make_config: Callable[..., MoesysConfig], compare: Callable[[MoesysConfig, int], dict],
                     hidden: int, ffn: int, layers: int, tokens: int, cache_fraction: float) -> dict:
    """Each variant through `compare(cfg, cache_experts)` (none, cpu and ssd in alternated rounds, each mode in a
    fresh process), built by `make_config(hidden, ffn, experts, layers, tokens, top_k=, expert_type=, bias=)`; and
    the fine variant's priced host work over the coarse one's, per offloaded mode (the ratios of each to its own
    floor, so that the two floors' sizes cancel)."""
    out: dict = {}
    for name, shape in VARIANTS.items():
        cfg = make_config(hidden, ffn // shape["ffn_divisor"], shape["experts"], layers, tokens,
                          top_k=shape["top_k"], expert_type="swiglu", bias=False)
        cache = max(1, round(cache_fraction * shape["experts"] * cfg.model.num_moe_layers))
        result = compare(cfg, cache)
        out[name] = {"config": {"experts": shape["experts"], "top_k": shape["top_k"], "ffn": cfg.model.ffn_size,
                                "hidden": hidden, "layers": layers, "tokens_per_step": tokens, "cache_experts": cache,
                                "expert_type": "swiglu", "bias": False},
                     **{key: result[key] for key in KEPT}}
    priced = {name: {mode: out[name][mode]["cpu_side_vs_floor"] for mode in ("cpu", "ssd")} for name in VARIANTS}
    out["fine_vs_coarse_host"] = {mode: priced["fine"][mode] / priced["coarse"][mode] for mode in ("cpu", "ssd")}
    return out
