"""Ring-memory offloading benchmark (seed 004 section 3.3.2 / 5.4.2): none vs ondemand vs ring decoding on one model
whose experts are most of its parameters, measured round-robin in one process; medians and ratios.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from pathlib import Path
from typing import Optional

import torch

from runtime.config import ModelConfig
from runtime.inference.generate import generate
from runtime.inference.ring import make_offloader
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param

MODES = ("none", "ondemand", "ring")


def bench_model_config(hidden: int = 256, ffn: int = 1024, experts: int = 8, layers: int = 4,
                       max_seq_len: int = 128) -> ModelConfig:
    """A GPT-style MoE whose experts hold ~94% of the parameters at the defaults."""
    return ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=4, vocab_size=256, ffn_hidden_size=ffn,
                       num_experts=experts, top_k=2, expert_type="gelu", max_seq_len=max_seq_len)


def run_ring_bench(cfg: Optional[ModelConfig] = None, ring_slots: int = 2, batch: int = 32, prompt_len: int = 8,
                   new_tokens: int = 8, repeats: int = 5, threads: Optional[int] = 1, seed: int = 0,
                   device: Optional[str] = None) -> dict:
    """Decode tokens/s per mode (median of `repeats` interleaved rounds), bytes per tier, copies and their overlap.

    threads: torch intra-op threads for the whole process (None keeps the setting). On a CPU the copy thread is
    the ring's DMA engine: with 1 compute thread it gets a core of its own, as a GPU's copy engine would.
    """
    cfg = cfg or bench_model_config()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    base = Transformer(cfg).eval()
    params = dict(base.named_parameters())
    expert_params = sum(p.numel() for n, p in params.items() if is_expert_param(n))
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen).tolist()
    runs: dict[str, dict] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="moesys-ring-bench-") as tmp:
            for mode in MODES:
                model = copy.deepcopy(base)
                off = make_offloader(model, mode, dev, ring_slots, cache_dir=Path(tmp) / mode)
                generate(model, prompts[:2], 2, offloader=off)  # warm-up: page in the store, first-call costs
                runs[mode] = {"model": model, "offloader": off, "tokens_per_s": [], "stats": []}
            for _ in range(repeats):
                for mode in MODES:
                    r = runs[mode]
                    r["offloader"].reset()
                    r["offloader"].reset_stats()
                    g = generate(r["model"], prompts, new_tokens, offloader=r["offloader"])
                    r["tokens_per_s"].append(g.decode_tokens_per_s)
                    r["stats"].append({**r["offloader"].stats(), "tokens": sum(map(len, g.tokens)),
                                       "forward_s": g.decode_s / max(1, new_tokens - 1)})
            for r in runs.values():
                r["offloader"].close()
    finally:
        torch.set_num_threads(old_threads)
    tps = {m: statistics.median(runs[m]["tokens_per_s"]) for m in MODES}
    last = {m: runs[m]["stats"][-1] for m in MODES}
    ring = runs["ring"]["stats"]
    copy_ms = statistics.median(s["copy_s"] / s["copies"] for s in ring if s["copies"]) * 1e3 if any(
        s["copies"] for s in ring) else 0.0
    n = cfg.num_moe_layers
    return {
        "device": str(dev), "threads": torch.get_num_threads() if not threads else threads,
        "model": {"hidden": cfg.hidden_size, "ffn": cfg.ffn_size, "experts": cfg.num_experts, "layers": cfg.num_layers,
                  "moe_layers": n, "params": sum(p.numel() for p in params.values()),
                  "expert_share": expert_params / sum(p.numel() for p in params.values())},
        "ring_slots": ring_slots, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "repeats": repeats,
        "none_tokens_per_s": tps["none"], "ondemand_tokens_per_s": tps["ondemand"], "ring_tokens_per_s": tps["ring"],
        "ring_vs_none": tps["ring"] / tps["none"], "ring_vs_ondemand": tps["ring"] / tps["ondemand"],
        "expert_device_bytes_none": last["none"]["expert_device_bytes"],
        "expert_device_bytes_ondemand": last["ondemand"]["expert_device_bytes"],
        "expert_device_bytes_ring": last["ring"]["expert_device_bytes"],
        "expert_host_bytes_ring": last["ring"]["expert_host_bytes"],
        "copied_bytes_per_token_ring": last["ring"]["copied_bytes"] / last["ring"]["tokens"],
        "copied_bytes_per_token_ondemand": last["ondemand"]["copied_bytes"] / last["ondemand"]["tokens"],
        "copy_hidden_share_ring": statistics.median(s["copy_hidden_share"] or 0.0 for s in ring),
        "layer_copy_ms": copy_ms,
        "layer_compute_ms": statistics.median(s["forward_s"] for s in runs["none"]["stats"]) / n * 1e3,
    }
