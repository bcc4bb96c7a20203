"""Worker of tests/distributed/test_schedule_gloo.py: CONFIG_JSON OUT_DIR. Three optimizer steps of the config's
split (micro-batches, recomputation, offloaded experts) over expert parallelism; writes each step's loss and the host
reads of the AlltoAll dispatch to OUT_DIR/rank{r}.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from runtime.config import config_from_dict
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step
from runtime.train.worker import init_distributed


def main() -> None:
    cfg_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    rank, world, local_world, device = init_distributed()
    groups = build_groups(world, rank, cfg.topology.expert_parallel, local_world)
    cfg.train.run_dir = str(out / f"run{rank}")
    c = build_components(cfg, groups, device)
    losses, reads = [], []
    for step in range(3):
        before = sum(layer.dispatcher.host_reads for layer in c.model.moe_layers())
        loss, _ = forward_backward(c, cfg, groups, step, device)
        optimizer_step(c, cfg, groups, step)
        losses.append(float(loss))
        reads.append(sum(layer.dispatcher.host_reads for layer in c.model.moe_layers()) - before)
    calls = dict(c.offload.optimizer.calls) if c.offload else {}
    for part in c.parts:
        part.close()
    (out / f"rank{rank}.json").write_text(json.dumps({"loss": losses, "reads": reads, "calls": calls}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
