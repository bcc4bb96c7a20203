"""Run in a fresh process by test_streaming_checkpoint.py: train a model of a few hundred MB of states one step,
then print (JSON) the peak anonymous RSS that save_checkpoint and load_checkpoint add beyond what they leave
allocated, and whether the loaded model saves the same checkpoint again. argv: RUN_DIR OFFLOAD(none|ssd).
Run it with MALLOC_MMAP_THRESHOLD_ set, so freed tensors go back to the kernel and RSS follows live memory."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

import torch

from runtime.files.checkpoint_format import CheckpointReader
from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TrainConfig
from runtime.host.memory_probe import PeakMemory, rss_anon_bytes
from runtime.moe.layer import is_expert_param
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from runtime.train.loop import forward_backward, optimizer_step
from runtime.train.parts import OffloadedExperts

CPU = torch.device("cpu")
MB = 1 << 20


def config(run_dir: Path, offload: str) -> MoesysConfig:
    """32 experts of 2 x 0.5 MB per layer: a stacked expert weight (16 MB) is 32 times the largest tensor the
    streaming code holds (one expert's slice), so a reader that stacks or a writer that copies shows at once."""
    return MoesysConfig(
        model=ModelConfig(hidden_size=128, num_layers=2, num_heads=4, ffn_hidden_size=1024, num_experts=32, top_k=2,
                          max_seq_len=32),
        storage=StorageConfig(offload=offload, ssd_path=str(run_dir / "ssd"), cpu_cache_experts=8),
        train=TrainConfig(seq_len=16, micro_batch_size=2, max_steps=1, warmup_steps=1, run_dir=str(run_dir)))


def trained(cfg: MoesysConfig, groups):
    c = build_components(cfg, groups, CPU)
    forward_backward(c, cfg, groups, 0, CPU)
    optimizer_step(c, cfg, groups, 0)
    c.optimizer.zero_grad(set_to_none=True)
    for part in c.parts:
        if isinstance(part, OffloadedExperts):
            part.engine.drain()
    return c


def measure(fn) -> tuple[int, int, int]:
    """Anonymous RSS before `fn`, its peak while `fn` ran (sampled every 2 ms) and after it returned."""
    gc.collect()
    with PeakMemory(interval_s=0.002) as peak:
        before = rss_anon_bytes()
        peak.reset()
        fn()
    return before, peak.peak, rss_anon_bytes()


def largest_unit(c) -> int:
    """Bytes of the largest tensor the streaming code holds at once: a dense parameter, one expert's slice of a
    stacked parameter, or (offloaded) one expert's states."""
    sizes = [(p[0] if is_expert_param(n) else p).numel() * p.element_size() for n, p in c.model.named_parameters()]
    for part in c.parts:
        if isinstance(part, OffloadedExperts):
            sizes += [spec.expert_bytes for spec in part.engine.specs.values()]
    return max(sizes)


def same_checkpoints(a: Path, b: Path) -> bool:
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    return set(ra.where) == set(rb.where) and all(torch.equal(ra.get(k), rb.get(k)) for k in ra.where)


def main(run_dir: Path, offload: str) -> dict:
    cfg = config(run_dir, offload)
    groups = build_groups(1, 0, 1, 1)
    c = trained(cfg, groups)
    before, peak, _ = measure(lambda: save_checkpoint(run_dir, 1, c.model, c.optimizer, groups, cfg, parts=c.parts))
    save_extra = peak - before
    ckpt = latest_checkpoint(run_dir)
    file_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))

    again = run_dir / "again"
    fresh_cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, ssd_path=str(again / "ssd")))
    fresh = build_components(fresh_cfg, groups, CPU)
    _, peak, after = measure(lambda: load_checkpoint(ckpt, fresh.model, fresh.optimizer, groups, parts=fresh.parts))
    load_extra = peak - after  # above what the load leaves allocated (the moments AdamW will own)
    save_checkpoint(again, 1, fresh.model, fresh.optimizer, groups, fresh_cfg, parts=fresh.parts)
    return {"checkpoint_mb": file_bytes / MB, "unit_mb": largest_unit(c) / MB, "save_extra_mb": save_extra / MB,
            "load_extra_mb": load_extra / MB, "exact": same_checkpoints(ckpt, latest_checkpoint(again))}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2])))
