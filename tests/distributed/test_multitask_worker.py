"""torchrun worker for test_multitask_gloo.py (collected by pytest but holds no tests): MODE CONFIG_JSON OUT_DIR.

grads  one forward/backward; save the loss and every gradient by global name (dense, expert g, head of task t)
train  run the real training loop (runtime.train.loop.train) with OUT_DIR as the run directory
load   load OUT_DIR's latest checkpoint with this config's layout; save every loaded tensor and Adam moment
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.config import config_from_dict
from runtime.moe.layer import is_expert_param
from runtime.parallel.groups import build_groups
from runtime.train.build import build_components
from runtime.train.checkpoint import latest_checkpoint, load_checkpoint
from runtime.train.loop import forward_backward, train
from runtime.train.worker import init_distributed


def by_global_name(c, groups, value) -> dict[str, torch.Tensor]:
    """value(param) keyed like the checkpoint: model names, expert rows by global index, heads by task."""
    out = {}
    for name, p in c.model.named_parameters():
        v = value(p)
        if is_expert_param(name):
            for j in range(p.shape[0]):
                out[f"{name}.{groups.ep_rank * p.shape[0] + j}"] = v[j].contiguous()
        elif groups.rank == 0:
            out[name] = v.contiguous()
    for task in c.tasks.local:
        out[f"task_heads.{task}.weight"] = value(c.tasks.heads[task].weight).contiguous()
    return out


def main() -> None:
    mode, cfg_path, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    rank, world, local_world, device = init_distributed()
    groups = build_groups(world, rank, cfg.topology.expert_parallel, local_world)
    if mode == "train":
        train(cfg, out, groups, device)
    else:
        c = build_components(cfg, groups, device)
        if mode == "grads":
            loss, _ = forward_backward(c, cfg, groups, 0, device)
            save_file(by_global_name(c, groups, lambda p: p.grad), str(out / f"grads-rank{rank}.safetensors"))
            (out / f"rank{rank}.json").write_text(json.dumps({"loss": float(loss), "tasks": c.tasks.local}))
        else:
            ckpt = latest_checkpoint(out)
            load_checkpoint(ckpt, c.model, c.optimizer, groups)
            c.tasks.load(ckpt, c.optimizer)
            tensors = by_global_name(c, groups, lambda p: p.detach())
            tensors.update({f"exp_avg.{k}": v for k, v in
                            by_global_name(c, groups, lambda p: c.optimizer.state[p]["exp_avg"]).items()})
            save_file(tensors, str(out / f"loaded-rank{rank}.safetensors"))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
