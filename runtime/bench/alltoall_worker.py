"""One process of `moesys bench alltoall`: `python -m runtime.bench.alltoall_worker SPEC.json` with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME set. Rank 0 writes the timings to the spec's `out` path.

The payload is a real MoE layer's dispatch: a router over random tokens chooses each token's experts, the local
dispatcher sorts the rows by expert, and the rows go to the experts' owners with the AlltoAll the layer would use.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.config import ModelConfig
from runtime.host.io import atomic_write_json
from runtime.moe.dispatch import LocalDispatcher
from runtime.moe.router import Router
from runtime.parallel.alltoall import make_all_to_all
from runtime.parallel.groups import build_groups

KINDS = ("flat", "hierarchical")


def dispatch_payload(model: ModelConfig, tokens: int, ranks: int, rank: int,
                     seed: int) -> tuple[torch.Tensor, list[int]]:
    """(x_RD, rows for each rank): this rank's rows of one MoE layer's dispatch, grouped by destination rank."""
    torch.manual_seed(seed)
    router = Router(model).eval()  # one gate, the same on every rank, as in a model
    x_TD = torch.randn(tokens, model.hidden_size, generator=torch.Generator().manual_seed(seed * 1000 + rank))
    with torch.no_grad():
        x_RD, tokens_per_expert_E, _ = LocalDispatcher(model.num_experts).dispatch(x_TD, router(x_TD))
    return x_RD.contiguous(), tokens_per_expert_E.view(ranks, -1).sum(1).tolist()


def _timed(fn, *args) -> float:
    """Seconds the slowest rank spent in fn, started together."""
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # the processes of a host share its cores
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        groups = build_groups(world, rank, world, spec["processes_per_host"])
        model = ModelConfig(**spec["model"])
        x_RD, send_counts = dispatch_payload(model, spec["tokens"], world, rank, spec["seed"])
        ops = {kind: make_all_to_all(kind, groups) for kind in KINDS}
        (y_flat, c_flat), (y_hier, c_hier) = (ops[k](x_RD, send_counts) for k in KINDS)
        same = torch.tensor([int(torch.equal(y_flat, y_hier) and list(c_flat) == list(c_hier))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        rows = torch.zeros(world, dtype=torch.int64)
        rows[rank] = x_RD.shape[0]
        dist.all_reduce(rows)
        if not same.item():  # every rank knows: none times a wrong AlltoAll
            if rank == 0:
                atomic_write_json(Path(spec["out"]), {"exact": False, "rows_per_rank": rows.tolist(), "seconds": {}})
            return 0
        for kind in KINDS * spec["warmup"]:
            ops[kind](x_RD, send_counts)
        seconds: dict[str, list[float]] = {k: [] for k in KINDS}
        for i in range(spec["rounds"]):  # paired: both kinds each round, the order alternating
            for kind in (KINDS if i % 2 == 0 else KINDS[::-1]):
                seconds[kind].append(_timed(ops[kind], x_RD, send_counts))
        if rank == 0:
            atomic_write_json(Path(spec["out"]), {"exact": True, "rows_per_rank": rows.tolist(), "seconds": seconds})
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
