"""Ring-memory offloading benchmark (the paper's "Ring Memory Offloading", design and experiment): none vs ondemand vs
ring decoding on one model whose experts are most of its parameters, in one process, at several batch sizes.

Ratios are paired: each round runs the three modes back to back (in rotating order) and the ratio of that round is
taken; the reported ratio is the median over rounds, with every round's ratio alongside. On a shared 2-core machine
the absolute speed drifts by tens of percent between seconds; a round's modes see the same drift.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from runtime.config import ModelConfig
from runtime.inference.generate import generate
from runtime.inference.offloaders import make_offloader
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param

MODES = ("none", "ondemand", "ring")

BATCHES = (4, 1, 32)
"""The first is the headline. At 4 a layer's copy is a little under its compute on the development machine, the
regime where both targets can hold (copy hidden: ring ~ none; copy large enough that ondemand pays >= 1.5x;
benchmarks/ring_*.md); 1 is copy-bound, 32 compute-bound."""


def bench_model_config(hidden: int = 256, ffn: int = 1024, experts: int = 8, layers: int = 4,
                       max_seq_len: int = 128) -> ModelConfig:
    """A GPT-style MoE whose experts hold ~94% of the parameters at the defaults."""
    return ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=4, vocab_size=256, ffn_hidden_size=ffn,
                       num_experts=experts, top_k=2, expert_type="gelu", max_seq_len=max_seq_len)


def _paired(rounds: list[dict[str, float]], a: str, b: str) -> list[float]:
    return [r[a] / r[b] for r in rounds]


def _measure(runs: dict[str, dict], prompts: list[list[int]], new_tokens: int, repeats: int, n_layers: int) -> dict:
    """`repeats` rounds of every mode decoding `prompts`; tokens/s, paired ratios, bytes and copy timings."""
    rounds: list[dict[str, float]] = []
    stats: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(repeats):
        tps: dict[str, float] = {}
        for mode in MODES[i % len(MODES):] + MODES[:i % len(MODES)]:
            off = runs[mode]["offloader"]
            off.reset()
            off.reset_stats()
            g = generate(runs[mode]["model"], prompts, new_tokens, offloader=off)
            tps[mode] = g.decode_tokens_per_s
            stats[mode].append({**off.stats(), "tokens": sum(map(len, g.tokens)),
                                "forward_s": g.decode_s / max(1, new_tokens - 1)})
        rounds.append(tps)
    ring_vs_none, ring_vs_ondemand = _paired(rounds, "ring", "none"), _paired(rounds, "ring", "ondemand")
    last = {m: stats[m][-1] for m in MODES}
    copies = [s["copy_s"] / s["copies"] for s in stats["ring"] if s["copies"]]
    layer_copy_ms = statistics.median(copies) * 1e3 if copies else 0.0
    layer_compute_ms = statistics.median(s["forward_s"] for s in stats["none"]) / n_layers * 1e3
    # Copies that are hidden still cost compute when both share a memory system: ring's extra forward time over
    # none's, per second of copying. ~0 with a GPU's copy engine; on a CPU it bounds ring_vs_none at
    # 1 / (1 + stall * copy / compute), whatever the overlap.
    none_s = len(prompts) / statistics.median(r["none"] for r in rounds)
    extra_s = none_s * (1 / statistics.median(ring_vs_none) - 1)  # from the paired ratio, as reported
    copy_s = n_layers * layer_copy_ms / 1e3
    return {
        "batch": len(prompts),
        **{f"{m}_tokens_per_s": statistics.median(r[m] for r in rounds) for m in MODES},
        "ring_vs_none": statistics.median(ring_vs_none), "ring_vs_ondemand": statistics.median(ring_vs_ondemand),
        "ring_vs_none_rounds": ring_vs_none, "ring_vs_ondemand_rounds": ring_vs_ondemand,
        "expert_device_bytes_none": last["none"]["expert_device_bytes"],
        "expert_device_bytes_ondemand": last["ondemand"]["expert_device_bytes"],
        "expert_device_bytes_ring": last["ring"]["expert_device_bytes"],
        "expert_host_bytes_ring": last["ring"]["expert_host_bytes"],
        "copied_bytes_per_token_ring": last["ring"]["copied_bytes"] / last["ring"]["tokens"],
        "copied_bytes_per_token_ondemand": last["ondemand"]["copied_bytes"] / last["ondemand"]["tokens"],
        "copy_hidden_share_ring": statistics.median(s["copy_hidden_share"] or 0.0 for s in stats["ring"]),
        "layer_copy_ms": layer_copy_ms,
        "layer_compute_ms": layer_compute_ms,
        "copy_within_compute": layer_copy_ms <= layer_compute_ms,
        "ring_stall_per_copy_s": extra_s / copy_s if copy_s > 0 else 0.0,
    }


def run_ring_bench(cfg: ModelConfig | None = None, ring_slots: int = 2, batches: Sequence[int] = BATCHES,
                   prompt_len: int = 8, new_tokens: int = 32, repeats: int = 9, threads: int | None = 1,
                   seed: int = 0, device: str | None = None) -> dict:
    """Decode tokens/s and paired ratios per mode at each batch size; the first batch's figures are top level.

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
    prompts = torch.randint(0, cfg.vocab_size, (max(batches), prompt_len), generator=gen).tolist()
    runs: dict[str, dict] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="moesys-ring-bench-") as tmp:
            for mode in MODES:
                model = copy.deepcopy(base)
                off = make_offloader(model, mode, dev, ring_slots, cache_dir=Path(tmp) / mode)
                generate(model, prompts[:2], 2, offloader=off)  # warm-up: page in the store, first-call costs
                runs[mode] = {"model": model, "offloader": off}
            try:
                by_batch = {str(b): _measure(runs, prompts[:b], new_tokens, repeats, cfg.num_moe_layers)
                            for b in batches}
            finally:
                for r in runs.values():
                    r["offloader"].close()
    finally:
        torch.set_num_threads(old_threads)
    total = sum(p.numel() for p in params.values())
    return {
        "device": str(dev), "threads": threads or torch.get_num_threads(),
        "model": {"hidden": cfg.hidden_size, "ffn": cfg.ffn_size, "experts": cfg.num_experts, "layers": cfg.num_layers,
                  "moe_layers": cfg.num_moe_layers, "params": total, "expert_share": expert_params / total},
        "ring_slots": ring_slots, "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
        **by_batch[str(batches[0])],
        "by_batch": by_batch,
    }
