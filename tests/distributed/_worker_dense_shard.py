"""Worker for tests/distributed/test_dense_shard_gloo.py: CONFIG_JSON OUT_DIR STEPS.

Trains STEPS steps with storage.dense_shard=false, then again from the same seed with dense_shard=true, in one
process group; writes each run's losses, gradient norms and the bytes this rank holds for dense states.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from runtime.config import config_from_dict
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.loop import forward_backward, optimizer_step
from runtime.train.worker import init_distributed


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def shard_bytes(shard, optimizer) -> int:
    """Bytes a DenseShard holds on this rank: shards, their gradients and AdamW moments, gathered buffers."""
    tensors = [u.shard for u in shard.units] + [u.full for u in shard.units if u.full is not None]
    for u in shard.units:
        for p in u.opt_params:
            tensors += [p.grad] + list(optimizer.state.get(p, {}).values())
    return held_bytes(tensors)


def dense_bytes(c) -> int:
    """Dense parameters, gradients and AdamW moments held by this rank (shards when dense_shard is on)."""
    tensors = [t for p in c.dense_params for t in (p, p.grad, *c.optimizer.state.get(p, {}).values())]
    if c.dense_shard:
        return held_bytes(tensors) + shard_bytes(c.dense_shard, c.optimizer)
    return held_bytes(tensors)


def run(cfg, groups, device, steps: int) -> dict:
    c = build_components(cfg, groups, device)
    torch.manual_seed(cfg.train.seed + 1 + groups.rank)  # router noise, as loop.train seeds it
    losses, norms, peak = [], [], 0
    for step in range(steps):
        loss, _ = forward_backward(c, cfg, groups, step, device)
        norms.append(optimizer_step(c, cfg, groups, step))
        losses.append(float(loss))
        if c.dense_shard:
            peak = max(peak, c.dense_shard.step_metrics()["dense_gathered_peak_bytes"])
    return {"loss": losses, "norm": norms, "dense_state_bytes": dense_bytes(c), "gathered_peak_bytes": peak}


def main() -> None:
    cfg_path, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    rank, world, local_world, device = init_distributed()
    groups = build_groups(world, rank, cfg.topology.expert_parallel, local_world)
    report = {}
    for shard in (False, True):
        run_cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, dense_shard=shard))
        report["shard" if shard else "replicated"] = run(run_cfg, groups, device, steps)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group() if world > 1 else None


if __name__ == "__main__":
    main()
