"""model.embedding_partition=true in real training: same losses, norms, embedding gradients and table as a
replicated embedding on 2 gloo ranks, and its checkpoint loads into one process, partitioned or not."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.distributed.test_train_gloo import small_config
from tests.distributed.torchrun import torchrun

WORKER = Path(__file__).with_name("_worker_train.py")


def run(tmp: Path, cfg, nproc: int) -> list[dict]:
    tmp.mkdir()
    (tmp / "cfg.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    proc = torchrun(nproc, WORKER, "steps", str(tmp / "cfg.json"), str(tmp), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(nproc)]


def config(world: int, partition: bool):
    cfg = small_config(world=world, ep=world, embedding_partition=partition)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_clip=0.5))


@pytest.mark.extended
def test_partitioned_training_matches_replicated_and_reshards(tmp_path):
    ref = run(tmp_path / "ref", config(2, False), 2)
    part = run(tmp_path / "part", config(2, True), 2)
    for a, b in zip(ref, part):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["norm"] == pytest.approx(b["norm"], rel=1e-5)
    ref_emb = load_file(str(tmp_path / "ref" / "emb-rank0.safetensors"))
    part_emb = load_file(str(tmp_path / "part" / "emb-rank1.safetensors"))
    torch.testing.assert_close(part_emb["grad"], ref_emb["grad"])
    torch.testing.assert_close(part_emb["table"], ref_emb["table"])
    groups = build_groups(1, 0, 1, 1)
    for partition in (False, True):
        c = build_components(config(1, partition), groups, torch.device("cpu"))
        assert load_checkpoint(latest_checkpoint(tmp_path / "part"), c.model, c.optimizer, groups) == 2
        weight = c.model.tok_embeddings.weight
        torch.testing.assert_close(weight.detach(), part_emb["table"])
        assert c.optimizer.state[weight]["exp_avg"].abs().sum() > 0
