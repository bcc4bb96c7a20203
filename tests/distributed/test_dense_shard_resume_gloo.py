"""Checkpoints of storage.dense_shard=true on 2 gloo processes, through the real torchrun worker: dense states are
written gathered under the unsharded keys, so a sharded run resumes from an unsharded checkpoint with the losses
of the uninterrupted run, and writes the tensors an unsharded run writes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.files.paths import CHECKPOINTS, CONFIG, METRICS
from runtime.files.run_dir import read_metrics, save_config
from tests.distributed.torchrun import REPO, torchrun

WORKER = REPO / "runtime" / "train" / "worker.py"


def launch(run_dir: Path, dense_shard: bool, checkpoint_every: int, resume_from: int | None = None) -> dict:
    """Train (or resume from step `resume_from`) to step 4; returns {step: loss} from metrics.jsonl."""
    cfg = MoesysConfig(
        model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64, num_experts=4, top_k=2,
                          max_seq_len=32),
        topology=TopologyConfig(nproc_per_node=2, expert_parallel=2),
        storage=StorageConfig(dense_shard=dense_shard),
        train=TrainConfig(seq_len=16, micro_batch_size=2, max_steps=4, warmup_steps=1,
                          checkpoint_every=checkpoint_every, run_dir=str(run_dir)))
    run_dir.mkdir(exist_ok=True)
    save_config(cfg, run_dir / CONFIG)
    if resume_from is not None:
        (run_dir / CHECKPOINTS / "latest").write_text(f"step_{resume_from:08d}\n")
    proc = torchrun(2, WORKER, str(run_dir), timeout=180)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def dense_tensors(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every dense tensor of a checkpoint (dense.safetensors, and dense-sharded.safetensors from a sharded run)."""
    out = {}
    for file in sorted((run_dir / CHECKPOINTS / f"step_{step:08d}").glob("dense*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.extended
def test_sharded_run_resumes_from_unsharded_checkpoint_and_writes_unsharded_keys(tmp_path):
    ref_dir, run = tmp_path / "ref", tmp_path / "run"
    ref = launch(ref_dir, dense_shard=False, checkpoint_every=2)  # unsharded: checkpoints at steps 2 and 4
    assert sorted(ref) == [1, 2, 3, 4]
    (run / CHECKPOINTS).mkdir(parents=True)
    shutil.copytree(ref_dir / CHECKPOINTS / "step_00000002", run / CHECKPOINTS / "step_00000002")
    shutil.copy(ref_dir / METRICS, run / METRICS)
    sharded = launch(run, dense_shard=True, checkpoint_every=2, resume_from=2)
    # Tolerance: the global gradient norm is summed in another order when sharded (see test_dense_shard_gloo).
    assert [sharded[s] for s in (3, 4)] == pytest.approx([ref[s] for s in (3, 4)], rel=1e-5)
    # The sharded run's step-4 checkpoint holds what the unsharded run's holds, under the same keys, so either
    # setting loads it (load_checkpoint reads the same keys with or without dense_shard).
    want, got = dense_tensors(ref_dir, 4), dense_tensors(run, 4)
    assert set(got) == set(want)
    for key, value in want.items():
        # atol 1e-6: Adam normalises the ~0 gradient of the key bias (softmax-invariant), which turns the
        # last-bit differences of the clipping coefficient into ~1e-7 absolute differences of that bias.
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=key)
