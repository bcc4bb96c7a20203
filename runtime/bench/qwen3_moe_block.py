"""moesys's MoE layer beside transformers' own Qwen3-MoE sparse MoE block on the same fine-grained shape
(Qwen3-30B-A3B's MoE layer: 128 experts of 768, top-8), forward + backward, in alternated rounds: the block with the
experts implementation `from_pretrained` picks (transformers 5: `grouped_mm` where it can dispatch) and with its eager
per-expert loop. The same random weights are copied into both and their outputs compared first, so that the ratios
are on the same work.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch import Tensor

from runtime.bench.rounds import alternate, paired_ratios
from runtime.config import ModelConfig
from runtime.moe.experts import GroupedExperts, resolve_impl
from runtime.moe.layer import MoELayer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_TOLERANCE = 1e-5
"""Largest absolute difference of the fp32 forwards (times the output's largest magnitude where that exceeds 1):
above it the two are not computing the same layer, and the benchmark stops rather than report a ratio. In bf16 the
block's router rounds its logits to bf16 (moesys's computes them in fp32), so a few near-tied tokens pick another
expert: the differences are reported, not judged."""


def transformers_block_config(hidden: int, ffn: int, experts: int, top_k: int, experts_implementation: str | None):
    """Qwen3MoeConfig of one sparse MoE block, its experts implementation resolved as a model's construction (and so
    `from_pretrained`) resolves it: None asks for the default."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeModel

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=ffn, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=1, vocab_size=16,
                            intermediate_size=64, num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                            # transformers' config dataclass takes keys its signature does not list (stored, or read
                            # by PreTrainedConfig): its stubs are narrower than the class
                            experts_implementation=experts_implementation)  # type: ignore[call-arg]
    with torch.device("meta"):  # the model's __init__ checks and sets config._experts_implementation
        Qwen3MoeModel(config)
    return config


def transformers_blocks(layer: MoELayer, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """transformers' block with its default experts implementation and with eager, holding one copy of `layer`'s
    weights between them (gate_up_proj is [w1; w3] per expert: silu of the first half times the second)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = layer.cfg
    dims = (cfg.hidden_size, cfg.ffn_size, cfg.num_experts, cfg.top_k)
    with torch.device("meta"):  # every parameter is replaced below
        default = Qwen3MoeSparseMoeBlock(transformers_block_config(*dims, None))
        eager = Qwen3MoeSparseMoeBlock(transformers_block_config(*dims, "eager"))
    experts = layer.experts
    assert isinstance(experts, GroupedExperts), "a layer built here holds its own experts"
    assert experts.w3 is not None, "Qwen3's experts are SwiGLU: they have w3"
    with torch.no_grad():
        default.gate.weight = torch.nn.Parameter(layer.router.gate.weight.detach().to(dtype, copy=True))
        default.experts.gate_up_proj = torch.nn.Parameter(torch.cat([experts.w1, experts.w3], dim=1).to(dtype))
        default.experts.down_proj = torch.nn.Parameter(experts.w2.detach().to(dtype, copy=True))
    eager.gate.weight, eager.experts.gate_up_proj, eager.experts.down_proj = (
        default.gate.weight, default.experts.gate_up_proj, default.experts.down_proj)
    return {"transformers": default, "transformers_eager": eager}


def _diffs(a: Tensor, b: Tensor) -> dict[str, float]:
    diff = (a.float() - b.float()).abs()
    return {"max": float(diff.max()), "mean": float(diff.mean())}


def _compare_dtype(cfg: ModelConfig, dtype: torch.dtype, tokens: int, dev: torch.device, seed: int, repeats: int,
                   warmup: int, sync: Callable[[], None]) -> dict:
    """One dtype: the three contenders built, checked against each other, then timed in alternated rounds."""
    gc.collect()  # the previous dtype's modules, if a cycle holds them, go before these are built
    torch.manual_seed(seed)
    layer = MoELayer(cfg).to(dev)
    blocks = transformers_blocks(layer, dtype)
    layer.to(dtype)
    x = torch.randn(1, tokens, cfg.hidden_size, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(1, tokens, cfg.hidden_size, device=dev, dtype=dtype)
    modules = [layer, blocks["transformers"]]

    def moe() -> Tensor:
        y, _ = layer(x, stats=False)  # the block computes no router loss; its model pools one from the logits
        y.backward(g)
        return y

    def block(name: str) -> Callable[[], Tensor]:
        def run() -> Tensor:
            y = blocks[name](x)
            y.backward(g)
            return y
        return run

    runs = {"moe": moe, **{name: block(name) for name in blocks}}
    outputs: dict[str, tuple[Tensor, Tensor]] = {}

    def reset() -> None:
        for module in modules:
            module.zero_grad(set_to_none=True)
        x.grad = None

    for name, fn in runs.items():  # the same work: outputs and input gradients against moesys's
        reset()
        y = fn()
        assert x.grad is not None, "each run's backward reaches the input"
        outputs[name] = (y.detach(), x.grad)
    reset()
    scale = float(outputs["moe"][0].abs().max())
    forward = {name: _diffs(outputs["moe"][0], out[0]) for name, out in outputs.items() if name != "moe"}
    input_grad = {name: _diffs(outputs["moe"][1], out[1]) for name, out in outputs.items() if name != "moe"}
    agree = all(diff["max"] <= FP32_TOLERANCE * max(scale, 1.0) for diff in forward.values())
    if dtype == torch.float32 and not agree:
        raise RuntimeError(f"moesys's layer and transformers' Qwen3-MoE block disagree in fp32 (max abs diffs "
                           f"{forward}): the benchmark would not compare the same work")
    del outputs
    timed = paired_ratios(alternate(runs, reset, sync, repeats, warmup), tokens)
    out = {"forward_abs_diff": forward, "input_grad_abs_diff": input_grad, "output_max_abs": scale,
           **({"outputs_agree": agree} if dtype == torch.float32 else {}), **timed}
    return out


def run_qwen3_moe_block_bench(tokens: int = 1024, hidden: int = 2048, ffn: int = 768, experts: int = 128,
                              top_k: int = 8, dtypes: tuple[str, ...] = ("fp32", "bf16"), repeats: int = 3,
                              warmup: int = 0, seed: int = 0, device: torch.device | None = None,
                              sync: Callable[[], None] = lambda: None) -> dict:
    """Tokens/s of moe, transformers (its default experts implementation) and transformers_eager, forward + backward,
    and moe's speed-up over each per round and its median, for each dtype (weights and input in it; moesys's router
    computes in fp32 whatever the dtype, the block's in the dtype). Each contender's first run, the output check,
    warms it up: `warmup` more rounds are not kept."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed (pip install 'moesys[bench]')"}
    dev = device or torch.device("cpu")
    cfg = ModelConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k,
                      expert_type="swiglu", bias=False, capacity_factor=0.0, normalize_top_k=True)
    return {
        "config": {"tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts, "top_k": top_k,
                   "expert_type": "swiglu", "bias": False, "repeats": repeats, "warmup": warmup},
        "expert_impl": resolve_impl("auto", torch.empty(1, device=dev).expand(tokens * top_k, hidden),
                                    torch.empty(1, device=dev).expand(experts, ffn, hidden)),
        "transformers_version": transformers.__version__,
        "transformers_default_impl": transformers_block_config(hidden, ffn, experts, top_k,
                                                               None)._experts_implementation,
        "by_dtype": {name: _compare_dtype(cfg, DTYPES[name], tokens, dev, seed, repeats, warmup, sync)
                     for name in dtypes},
    }
