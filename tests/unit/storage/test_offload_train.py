"""The real training loop with storage.offload=ssd: same losses as offload=none, and a crash after the store ran past
the last checkpoint resumes to the same losses (the paper's "Training Phase")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import runtime.train.loop as loop
from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TrainConfig
from runtime.parallel.groups import build_groups
from runtime.files.run_dir import read_metrics

CPU = torch.device("cpu")


def config(tmp_path, offload: str, **train) -> MoesysConfig:
    return MoesysConfig(
        model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64, num_experts=4, top_k=2,
                          max_seq_len=32),
        storage=StorageConfig(offload=offload, ssd_path=str(tmp_path / f"ssd-{offload}"), cpu_cache_experts=3),
        train=dataclasses.replace(TrainConfig(seq_len=16, micro_batch_size=2, max_steps=6, warmup_steps=2), **train))


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def test_train_offload_ssd_matches_none_and_reports_tier_metrics(tmp_path):
    """50 steps, bitwise: every expert gets tokens each step here, and no clipping (the clipped norm is summed per
    expert under offload, per stacked tensor without; see test_offload.py for that tolerance)."""
    groups = build_groups(1, 0, 1, 1)
    for mode in ("none", "ssd"):
        (tmp_path / mode).mkdir()
        loop.train(config(tmp_path, mode, grad_clip=0.0, max_steps=50), tmp_path / mode, groups, CPU)
    assert len(losses(tmp_path / "ssd")) == 50
    assert losses(tmp_path / "ssd") == losses(tmp_path / "none")
    last = read_metrics(tmp_path / "ssd")[-1]
    for key in ("experts_active", "cache_hit_rate", "fetch_stall_s", "ssd_read_bytes", "ssd_write_bytes",
                "device_peak_bytes", "host_peak_bytes"):
        assert f"offload/{key}" in last
    assert last["offload/experts_active"] == 8 and last["offload/device_used_bytes"] == 0


def test_crash_after_checkpoint_resumes_to_the_same_losses(tmp_path, monkeypatch):
    groups = build_groups(1, 0, 1, 1)
    for name in ("full", "crash"):
        (tmp_path / name).mkdir()
    loop.train(config(tmp_path / "a", "ssd", checkpoint_every=3), tmp_path / "full", groups, CPU)

    cfg = config(tmp_path / "b", "ssd", checkpoint_every=3)
    real = loop.step_stats
    calls = []

    def dying(*args):
        calls.append(1)
        if len(calls) == 5:  # step 5: the store already holds step-4 and step-5 updates, checkpoint is step 3
            raise RuntimeError("killed")
        return real(*args)

    monkeypatch.setattr(loop, "step_stats", dying)
    with pytest.raises(RuntimeError, match="killed"):
        loop.train(cfg, tmp_path / "crash", groups, CPU)
    monkeypatch.setattr(loop, "step_stats", real)
    summary = loop.train(cfg, tmp_path / "crash", groups, CPU)
    assert summary["steps"] == 6
    assert losses(tmp_path / "crash") == losses(tmp_path / "full")
