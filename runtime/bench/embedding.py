"""Benchmark of the embedding partition in data parallelism (the paper's "Embedding Partition in Data Parallelism",
Table 4): per-rank memory and step tokens/s of a small GPT-MoE with a replicated vs a column-partitioned (tied)
embedding, on torchrun + gloo.

Each (hidden, mode) runs as its own job through the job API (planned once, plan.json beside config.yaml), so every
job's peak RSS is its own; its ranks run runtime/bench/embedding_worker.py on the run directory.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from runtime.bench.embedding_worker import REPORT, SPEC
from runtime.bench.jobs import job_root
from runtime.config import ModelConfig, MoesysConfig
from runtime.host.io import atomic_write_json
from runtime.launch.job import run_job

MODES = ("replicated", "partitioned")
WORKER = "runtime.bench.embedding_worker"


def bench_model_config(vocab: int, hidden: int, layers: int, experts: int) -> ModelConfig:
    """GPT-MoE of Table 4's shape (vocab 50304, tied head, top-1 over `experts` experts), expert width = hidden."""
    return ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 128), vocab_size=vocab,
                       ffn_hidden_size=hidden, num_experts=experts, top_k=1, max_seq_len=1024, tie_embeddings=True)


def bench_config(base: MoesysConfig, run_dir: Path, mode: str, model: ModelConfig, nproc: int, seq_len: int,
                 micro_batch: int, steps: int) -> MoesysConfig:
    """One job's config: `model` with the embedding replicated or partitioned on `nproc` CPU processes, each
    holding every expert (the worker reduces every dense gradient itself), nothing offloaded or checkpointed."""
    cfg = copy.deepcopy(base)
    cfg.model = copy.deepcopy(model)
    cfg.model.embedding_partition = mode == "partitioned"
    t = cfg.topology
    t.nodes, t.gpus_per_node, t.nproc_per_node, t.expert_parallel = 1, 0, nproc, 1
    cfg.parallel.ranks_per_node = 0
    cfg.storage.offload = "none"
    tr = cfg.train
    tr.seq_len, tr.micro_batch_size, tr.max_steps = seq_len, micro_batch, steps
    tr.checkpoint_every, tr.final_checkpoint, tr.max_restarts = 0, False, 0
    tr.run_dir = str(run_dir)
    return cfg


def _run(cfg: MoesysConfig, warmup: int, steps: int, timeout: float) -> dict:
    def write_spec(run_dir: Path) -> None:
        atomic_write_json(run_dir / SPEC, {"warmup": warmup, "steps": steps})

    run_dir = run_job(cfg, worker=WORKER, prepare=write_spec, time_limit_s=timeout).or_raise().run_dir
    return json.loads((run_dir / REPORT).read_text())


def run_embedding_bench(base: MoesysConfig, vocab: int = 50304, hiddens: tuple[int, ...] = (1024, 2048),
                        nproc: int = 2, layers: int = 2, experts: int = 4, seq_len: int = 256, micro_batch: int = 1,
                        steps: int = 3, warmup: int = 1, timeout: float = 900, workdir: Path | None = None) -> dict:
    """Replicated vs partitioned on `nproc` gloo ranks for each hidden size; returns a JSON-ready dict. `base`: the
    resolved config the jobs start from (data, tokenizer); the run directories go in `workdir` (kept) or a temporary
    directory.

    Ratios are partitioned / replicated: memory below 1 and tokens/s at or above 1 is the Table 4 direction.
    """
    results = {}
    with job_root("moesys-bench-embedding-", workdir) as root:
        for hidden in hiddens:
            model = bench_model_config(vocab, hidden, layers, experts)
            runs = {mode: _run(bench_config(base, root / f"{mode}-{hidden}", mode, model, nproc, seq_len,
                                            micro_batch, warmup + steps), warmup, steps, timeout) for mode in MODES}
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
