"""A real moesys run directory for tests that read one (infer, serve): a few training steps in this process."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.config import ModelConfig, MoesysConfig, TrainConfig
from runtime.parallel.groups import build_groups
from runtime.train.run_setup import prepare_run_dir
from runtime.train.loop import train

SMALL_MOE = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, vocab_size=256, ffn_hidden_size=64,
                        num_experts=4, max_seq_len=48)
"""2 MoE layers of 4 experts on the byte tokenizer."""


def train_run_dir(root: Path, model: ModelConfig = SMALL_MOE, steps: int = 1, seq_len: int = 16) -> Path:
    """`steps` single-process training steps of `model` in a new run directory under root, with its checkpoint."""
    cfg = MoesysConfig(model=model, train=TrainConfig(max_steps=steps, micro_batch_size=2, seq_len=seq_len,
                                                      warmup_steps=1, run_dir=str(root)))
    cfg.topology.nproc_per_node = 1
    path = prepare_run_dir(cfg)
    train(cfg, path, build_groups(1, 0, 1, 1), torch.device("cpu"))
    return path
