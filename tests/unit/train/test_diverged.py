"""A non-finite loss stops training at that step, on every rank, before the optimizer applies it; the newest
checkpoint stays the last good one and nothing NaN is written."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TrainConfig
from runtime.errors import JobError
from runtime.parallel.groups import build_groups
from runtime.files.run_dir import read_metrics
from runtime.files.tensorfile import save_tensors
from runtime.train.checkpoint import latest_checkpoint
from runtime.train.loop import train

CPU = torch.device("cpu")


def config(tmp_path, offload: str, steps: int) -> MoesysConfig:
    return MoesysConfig(
        model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64, num_experts=4, max_seq_len=32),
        storage=StorageConfig(offload=offload),
        train=TrainConfig(seq_len=16, micro_batch_size=2, max_steps=steps, warmup_steps=1, checkpoint_every=2,
                          run_dir=str(tmp_path)))


@pytest.mark.parametrize("offload", ["none", "ssd"])
def test_nan_expert_weights_stop_the_run_at_that_step(tmp_path, offload):
    groups = build_groups(1, 0, 1, 1)
    train(config(tmp_path, offload, 2), tmp_path, groups, CPU)
    ckpt = latest_checkpoint(tmp_path)
    # NaN bytes in every expert of one layer (a damaged store or a bad write), in a file with a valid checksum.
    for file in ckpt.glob("experts-*.safetensors"):
        tensors = load_file(str(file))
        for key in tensors:
            if key.startswith("model.layers.0.") and ".w1." in key:
                tensors[key] = torch.full_like(tensors[key], float("nan"))
        save_tensors(file, tensors)
    with pytest.raises(JobError, match="non-finite language-model loss at step 3 .*newest checkpoint is the last good"):
        train(config(tmp_path, offload, 6), tmp_path, groups, CPU)
    assert latest_checkpoint(tmp_path) == ckpt
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
