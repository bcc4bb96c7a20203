"""Benchmark of the embedding partition in data parallelism (the paper's "Embedding Partition in Data Parallelism",
Table 4): per-rank memory and step tokens/s of a small GPT-MoE with a replicated vs a column-partitioned (tied)
embedding, on torchrun + gloo.

Each (hidden, mode) runs as its own torchrun job, so every job's peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.config import ModelConfig
from runtime.model.transformer import Transformer
from runtime.parallel.embedding_partition import partition_embedding, partitioned_parameters
from runtime.parallel.grad_buckets import GradBucketReducer

MODES = ("replicated", "partitioned")
REPO = Path(__file__).resolve().parents[2]


def bench_model_config(vocab: int, hidden: int, layers: int, experts: int) -> ModelConfig:
    """GPT-MoE of Table 4's shape (vocab 50304, tied head, top-1 over `experts` experts), expert width = hidden."""
    return ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 128), vocab_size=vocab,
                       ffn_hidden_size=hidden, num_experts=experts, top_k=1, max_seq_len=1024, tie_embeddings=True)


def _state_bytes(params, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, their gradients and their optimizer state."""
    total = 0
    for p in params:
        total += p.numel() * p.element_size() * (1 + (p.grad is not None))
        total += sum(t.numel() * t.element_size() for t in optimizer.state.get(p, {}).values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank: build, warm up, time `steps` optimizer steps, write rank 0's report."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Transformer(bench_model_config(args.vocab, args.hidden, args.layers, args.experts))
    if args.mode == "partitioned":
        partition_embedding(model, dist.group.WORLD)
    shards = {id(p) for _, p in partitioned_parameters(model)}
    dense = [p for p in model.parameters() if id(p) not in shards]
    reducer = GradBucketReducer(dense, dist.group.WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + rank)
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=gen)
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
        if step >= args.warmup:
            times.append(float(elapsed))
    emb = model.tok_embeddings.weight
    report = {
        "embedding_bytes": _state_bytes([emb], optimizer),
        "model_state_bytes": _state_bytes(list(model.parameters()), optimizer),
        "params_per_rank": sum(p.numel() for p in model.parameters()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(times),
        "tokens_per_s": world * args.micro_batch * args.seq_len / statistics.median(times),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        report["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in gathered)  # the worst rank
        Path(args.out).write_text(json.dumps(report))
    dist.destroy_process_group()


def _launch(nproc: int, out: Path, mode: str, hidden: int, vocab: int, layers: int, experts: int, seq_len: int,
            micro_batch: int, steps: int, warmup: int, timeout: float) -> dict:
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "runtime.bench.embedding", "--worker", "--out", str(out), "--mode", mode, "--hidden", str(hidden),
           "--vocab", str(vocab), "--layers", str(layers), "--experts", str(experts), "--seq-len", str(seq_len),
           "--micro-batch", str(micro_batch), "--steps", str(steps), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"embedding bench ({mode}, hidden {hidden}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_embedding_bench(vocab: int = 50304, hiddens: tuple[int, ...] = (1024, 2048), nproc: int = 2,
                        layers: int = 2, experts: int = 4, seq_len: int = 256, micro_batch: int = 1,
                        steps: int = 3, warmup: int = 1, timeout: float = 900) -> dict:
    """Replicated vs partitioned on `nproc` gloo ranks for each hidden size; returns a JSON-ready dict.

    Ratios are partitioned / replicated: memory below 1 and tokens/s at or above 1 is the Table 4 direction.
    """
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in hiddens:
            runs = {mode: _launch(nproc, Path(tmp) / f"{mode}-{hidden}.json", mode, hidden, vocab, layers, experts,
                                  seq_len, micro_batch, steps, warmup, timeout) for mode in MODES}
            rep, part = runs["replicated"], runs["partitioned"]
            results[str(hidden)] = {
                **runs,
                "embedding_memory_ratio": part["embedding_bytes"] / rep["embedding_bytes"],
                "model_memory_ratio": part["model_state_bytes"] / rep["model_state_bytes"],
                "peak_rss_ratio": part["peak_rss_bytes"] / rep["peak_rss_bytes"],
                "tokens_per_s_ratio": part["tokens_per_s"] / rep["tokens_per_s"],
            }
    return {
        "config": {"vocab": vocab, "hiddens": list(hiddens), "nproc": nproc, "layers": layers, "experts": experts,
                   "top_k": 1, "tie_embeddings": True, "seq_len": seq_len, "micro_batch": micro_batch,
                   "steps": steps, "warmup": warmup, "backend": "gloo", "device": "cpu"},
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "results": results,
    }


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worker", action="store_true", help="run as one torchrun rank (internal)")
    p.add_argument("--out", default="")
    p.add_argument("--mode", choices=MODES, default="replicated")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    return p.parse_args(argv)


if __name__ == "__main__":
    ns = _parse()
    if ns.worker:
        worker(ns)
    else:
        print(json.dumps(run_embedding_bench(vocab=ns.vocab, layers=ns.layers, experts=ns.experts,
                                             seq_len=ns.seq_len, micro_batch=ns.micro_batch, steps=ns.steps,
                                             warmup=ns.warmup), indent=2))
