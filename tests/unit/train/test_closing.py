"""The end of a run closes everything it started, also when one of them raises as it closes (a part whose
background update failed raises that error again): the rank's memory record is still written."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, TrainConfig
from runtime.parallel.groups import build_groups
from runtime.train import loop
from runtime.train.run_setup import prepare_run_dir


def test_a_part_that_raises_as_it_closes_leaves_the_other_closes_to_run(tmp_path, monkeypatch):
    from runtime.train.rank_memory import RankMemory

    cfg = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64,
                                         num_experts=4, max_seq_len=32),
                       train=TrainConfig(max_steps=1, micro_batch_size=1, seq_len=16, warmup_steps=1,
                                         run_dir=str(tmp_path / "run")))
    cfg.topology.nproc_per_node = 1
    closed = []
    real_close = RankMemory.close

    def memory_close(self):
        closed.append("memory")
        return real_close(self)

    def build(*args, **kwargs):
        components = real_build(*args, **kwargs)

        def broken() -> None:
            raise RuntimeError("the update failed")

        components.parts[0].close = broken
        return components

    real_build = loop.build_components
    monkeypatch.setattr(loop, "build_components", build)
    monkeypatch.setattr(RankMemory, "close", memory_close)
    with pytest.raises(RuntimeError, match="the update failed"):
        loop.train(cfg, prepare_run_dir(cfg), build_groups(1, 0, 1, 1), torch.device("cpu"))
    assert closed == ["memory"]
