"""Every training benchmark launches its jobs through the job API (runtime/launch/job.py): each run directory holds
config.yaml and the launch's plan.json, which its workers read instead of planning (a training worker refuses a run
directory without it), and the benchmark's figures come from those jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.host import memcap
from runtime.config import ModelConfig, MoesysConfig, TopologyConfig, TrainConfig
from runtime.files.paths import CONFIG, PLAN
from runtime.files.run_dir import load_config

SMALL = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, max_seq_len=32),
                     topology=TopologyConfig(nproc_per_node=2, expert_parallel=2),
                     train=TrainConfig(seq_len=16, micro_batch_size=2))


def run_dirs(root: Path) -> list[Path]:
    """The run directories under a benchmark's root, each checked to hold its config and the plan made for it."""
    found = sorted(p.parent for p in root.glob(f"*/{CONFIG}"))
    for run_dir in found:
        recorded = json.loads((run_dir / PLAN).read_text())  # written by the launch, before any worker started
        cfg = load_config(run_dir)
        assert recorded["placement"]["local_experts"] * cfg.topology.expert_parallel == cfg.model.num_experts * \
            cfg.model.num_moe_layers, run_dir
    return found


def test_the_embedding_bench_runs_each_mode_as_a_planned_job(tmp_path):
    from runtime.bench.embedding import run_embedding_bench

    out = run_embedding_bench(SMALL, vocab=512, hiddens=(64,), nproc=2, layers=1, experts=2, seq_len=16, steps=1,
                              warmup=1, workdir=tmp_path)
    dirs = run_dirs(tmp_path)
    assert [d.name for d in dirs] == ["partitioned-64", "replicated-64"]
    assert [load_config(d).model.embedding_partition for d in dirs] == [True, False]
    result = out["results"]["64"]
    assert result["embedding_memory_ratio"] == pytest.approx(0.5)  # 2 ranks: each holds half the columns
    assert result["partitioned"]["tokens_per_s"] > 0 and result["replicated"]["tokens_per_s"] > 0


@pytest.mark.extended
def test_the_train_bench_runs_each_variant_as_a_planned_job(tmp_path):
    from runtime.bench.train import VARIANTS, run_train_bench

    out = run_train_bench(SMALL, steps=2, rounds=1, workdir=tmp_path)
    assert [d.name for d in run_dirs(tmp_path)] == sorted(f"{name}-0" for name in VARIANTS)
    assert out["two_vs_one"] > 0 and out["hierarchical_vs_flat"] > 0


@pytest.mark.extended
def test_the_elastic_bench_runs_each_allocation_as_a_planned_job(tmp_path):
    from runtime.bench.elastic import run_elastic_bench

    out = run_elastic_bench(SMALL, steps=2, rounds=1, workdir=tmp_path)
    dirs = {d.name: load_config(d) for d in run_dirs(tmp_path)}
    assert set(dirs) == {"imbalanced-0", "rebalanced-0", "measure"}
    recorded = json.loads((tmp_path / "rebalanced-0" / PLAN).read_text())["placement"]["task_gpus"]
    assert recorded == out["rebalanced_allocation"] and out["rebalanced_vs_imbalanced"] > 0


@pytest.mark.extended
@pytest.mark.skipif(memcap.available() is not None, reason=f"no memory cap: {memcap.available()}")
def test_the_beyond_memory_bench_trains_its_capped_job_through_the_job_api(tmp_path):
    """A small share of the RAM (the figures of a real run need `ratio` 1.5): the job runs in the cap and its
    plan.json, which the bench reads, is the launch's."""
    from moesys_cli.resolve import resolve_config
    from runtime.bench.beyond_memory import run_beyond_memory_bench

    out = run_beyond_memory_bench(resolve_config([]), ratio=0.02, steps=2, root=str(tmp_path))
    assert out["steps"] == 2 and out["oom_kills"] == 0 and out["plan_rank_bytes"] > 0
    assert len(out["measured_rank_peak_bytes"]) == 2
