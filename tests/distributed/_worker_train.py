"""Training worker for tests/distributed/test_train_gloo.py: MODE CONFIG_JSON OUT_DIR.

grads        one forward/backward on the global batch split over ranks; save loss and gradients by global name
zero_tokens  route every token to expert 0 (owned by EP rank 0): rank 1 receives nothing, nobody sends to it
steps        two optimizer steps and a checkpoint; save losses, norms, the step-0 embedding gradient and the final
             embedding table (both as full [V, H] tables, gathered when the embedding is partitioned)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.config import config_from_dict
from runtime.moe.layer import is_expert_param
from runtime.moe.router import Router
from runtime.parallel.embedding_partition import gather_columns
from runtime.train.build import build_components
from runtime.train.checkpoint import save_checkpoint
from runtime.train.loop import forward_backward, optimizer_step
from runtime.train.worker import init_distributed
from runtime.parallel.groups import build_groups


def global_grads(model, groups) -> dict[str, torch.Tensor]:
    """Gradients keyed by parameter name, expert rows keyed by global expert index."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if is_expert_param(name):
            for j in range(p.shape[0]):
                out[f"{name}.{groups.ep_rank * p.shape[0] + j}"] = grad[j].contiguous()
        elif groups.rank == 0:
            out[name] = grad.contiguous()
    return out


def force_expert_zero(module, inputs, routing):
    ids = torch.zeros_like(routing.expert_ids_TK)
    ids[:, 1:] = 1 if ids.shape[1] > 1 else 0
    return dataclasses.replace(routing, expert_ids_TK=ids)


def full_table(t: torch.Tensor, cfg, groups) -> torch.Tensor:
    return gather_columns(t, groups.dp_group) if cfg.model.embedding_partition else t


def two_steps(c, cfg, groups, device, out: Path) -> None:
    losses, norms = [], []
    for step in range(2):
        loss, _ = forward_backward(c, cfg, groups, step, device)
        if step == 0:
            grad = full_table(c.model.tok_embeddings.weight.grad, cfg, groups).clone()  # before clipping
        norms.append(optimizer_step(c, cfg, groups, step))
        losses.append(float(loss))
    save_checkpoint(out, 2, c.model, c.optimizer, groups, cfg)
    table = full_table(c.model.tok_embeddings.weight.detach(), cfg, groups)
    save_file({"grad": grad.contiguous(), "table": table.contiguous()}, str(out / f"emb-rank{groups.rank}.safetensors"))
    (out / f"rank{groups.rank}.json").write_text(json.dumps({"loss": losses, "norm": norms}))


def main() -> None:
    mode, cfg_path, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    rank, world, local_world, device = init_distributed()
    groups = build_groups(world, rank, cfg.topology.expert_parallel, local_world)
    c = build_components(cfg, groups, device)
    if mode == "steps":
        two_steps(c, cfg, groups, device, out)
        torch.distributed.destroy_process_group() if world > 1 else None
        return
    if mode == "zero_tokens":
        for m in c.model.modules():
            if isinstance(m, Router):
                m.register_forward_hook(force_expert_zero)
    lm_loss, out_model = forward_backward(c, cfg, groups, 0, device)
    save_file(global_grads(c.model, groups), str(out / f"grads-rank{rank}.safetensors"))
    norm = optimizer_step(c, cfg, groups, 0)
    loads = [s.metrics["expert_routed_fraction"].tolist() for s in out_model.moe_stats]
    (out / f"rank{rank}.json").write_text(json.dumps({"loss": float(lm_loss), "norm": norm, "loads": loads,
                                                        "ep_rank": groups.ep_rank}))
    torch.distributed.destroy_process_group() if world > 1 else None


if __name__ == "__main__":
    main()
