"""train.compile=true: the tiny recipe trained on one process with each block compiled whole (no graph break), the
same losses as eager (1e-5), with and without gradient accumulation."""

from __future__ import annotations

import pytest
import torch

from moesys_cli.resolve import resolve_config
from runtime.files.run_dir import read_metrics
from runtime.parallel.groups import build_groups
from runtime.train.loop import train


def losses(tmp_path, compile: bool, accum: int) -> list[float]:
    run_dir = tmp_path / f"compile-{compile}-{accum}"
    cfg = resolve_config(["recipe=tiny", "topology.nproc_per_node=1", "topology.expert_parallel=1",
                          f"train.compile={str(compile).lower()}", f"train.grad_accum_steps={accum}",
                          "train.max_steps=3", "train.checkpoint_every=0", "train.final_checkpoint=false",
                          "train.seq_len=32", f"train.micro_batch_size={4 // accum}", f"train.run_dir={run_dir}"])
    train(cfg, run_dir, build_groups(1, 0, 1, 1), torch.device("cpu"))
    return [m["loss"] for m in read_metrics(run_dir)]


@pytest.mark.parametrize("accum", [1, 2])
def test_compiled_blocks_train_the_tiny_recipe_as_eager_does(tmp_path, accum):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = losses(tmp_path, False, accum)
    compiled = losses(tmp_path, True, accum)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)
