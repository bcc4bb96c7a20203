"""One rank of `moesys bench embedding`, started by the job API's torchrun on a run directory (`python -m
runtime.bench.embedding_worker RUN_DIR`): the model, world and batch from RUN_DIR/config.yaml, warm-up and timed steps
from RUN_DIR/embedding_bench.json; rank 0 writes the report to RUN_DIR/embedding_report.json."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.files.run_dir import load_config
from runtime.host.io import atomic_write_json
from runtime.host.topology import set_cpu_threads
from runtime.model.transformer import Transformer
from runtime.parallel.embedding_partition import partition_embedding, partitioned_parameters
from runtime.parallel.grad_buckets import GradBucketReducer

SPEC = "embedding_bench.json"
"""The run directory's file of warm-up and timed steps: {"warmup": N, "steps": N}."""
REPORT = "embedding_report.json"


def _state_bytes(params, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, their gradients and their optimizer state."""
    total = 0
    for p in params:
        total += p.numel() * p.element_size() * (1 + (p.grad is not None))
        total += sum(t.numel() * t.element_size() for t in optimizer.state.get(p, {}).values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


def main(run_dir: Path) -> int:
    """Build, warm up, time the spec's optimizer steps, write rank 0's report."""
    cfg = load_config(run_dir)
    spec = json.loads((run_dir / SPEC).read_text())
    m, batch, seq_len = cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)), respect_env=False)  # torchrun's default is 1
    torch.manual_seed(0)
    model = Transformer(m)
    if m.embedding_partition:
        partition_embedding(model, dist.group.WORLD)
    shards = {id(p) for _, p in partitioned_parameters(model)}
    dense = [p for p in model.parameters() if id(p) not in shards]
    reducer = GradBucketReducer(dense, dist.group.WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + rank)
    times = []
    for step in range(spec["warmup"] + spec["steps"]):
        tokens = torch.randint(0, m.vocab_size, (batch, seq_len + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        out = model(tokens[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + out.aux_loss
        loss.backward()
        reducer.finish()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        if step >= spec["warmup"]:
            times.append(float(elapsed))
    emb = model.tok_embeddings.weight
    report = {
        "embedding_bytes": _state_bytes([emb], optimizer),
        "model_state_bytes": _state_bytes(list(model.parameters()), optimizer),
        "params_per_rank": sum(p.numel() for p in model.parameters()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(times),
        "tokens_per_s": world * batch * seq_len / statistics.median(times),
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        report["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in gathered)  # the worst rank
        atomic_write_json(run_dir / REPORT, report)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
