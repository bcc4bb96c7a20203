"""runtime/plan/compare.py and rank_memory.py on the files of a real (single-process, SSD-offloaded) run: what each
rank measured set beside the plan it was launched with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import runtime.train.loop as loop
from runtime.config import ModelConfig, MoesysConfig, StorageConfig, TopologyConfig, TrainConfig
from runtime.errors import UserError
from runtime.parallel.groups import build_groups
from runtime.files.run_dir import read_metrics, read_rank_memory, save_config
from runtime.plan.compare import TOLERANCE, TierComparison, compare_run, comparison_to_dict, measured_peaks, tier_bytes
from runtime.plan.placement import record
from runtime.train.rank_memory import PER_RANK_KEYS

MB = 2**20


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = MoesysConfig(
        model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64, num_experts=4, top_k=2,
                          max_seq_len=32),
        topology=TopologyConfig(nproc_per_node=1, expert_parallel=1),
        storage=StorageConfig(offload="ssd", ssd_path=str(run_dir / "store"), cpu_cache_experts=3),
        train=TrainConfig(seq_len=16, micro_batch_size=2, max_steps=4, warmup_steps=1, run_dir=str(run_dir)))
    save_config(cfg, run_dir / "config.yaml")
    record(run_dir, cfg)
    loop.train(cfg, run_dir, build_groups(1, 0, 1, 1), torch.device("cpu"))
    return run_dir


def test_every_step_line_holds_each_ranks_measured_memory(run_dir):
    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    assert len(steps) == 4
    for m in steps:
        for key in PER_RANK_KEYS:
            assert len(m[key]) == 1, key
        assert m["memory/peak_rss_anon"][0] > 100 * MB  # torch alone is more
        assert m["memory/cuda_max_allocated"] == [0] and m["memory/pinned_host"] == [0]
        assert m["memory/ssd_bytes"] == [m["offload/ssd_bytes"]] and m["offload/ssd_bytes"] > 0
    peaks = [m["memory/peak_rss_anon"][0] for m in steps]
    assert peaks == sorted(peaks)  # a peak since the worker started
    (file,) = read_rank_memory(run_dir)
    assert file["rank"] == 0 and file["memory/peak_rss_anon"] >= peaks[-1]


def test_compare_sets_the_recorded_plan_beside_the_measured_peaks(run_dir):
    plan = json.loads((run_dir / "plan.json").read_text())["plan"]["per_rank"]
    rows = {(r.rank, r.tier): r for r in compare_run(run_dir)}
    assert sorted(rows) == [(0, "ram"), (0, "ssd")]  # no GPU: one RAM pool
    ram, ssd = rows[0, "ram"], rows[0, "ssd"]
    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    assert ram.predicted_bytes == plan["process_host_bytes"]
    assert ram.measured_bytes == max(steps[-1]["memory/peak_rss_anon"][0],
                                     read_rank_memory(run_dir)[0]["memory/peak_rss_anon"])
    assert ram.ratio == pytest.approx(ram.measured_bytes / ram.predicted_bytes)
    assert ram.within == (abs(ram.ratio - 1) <= TOLERANCE)
    assert ssd.predicted_bytes == plan["ssd"] and ssd.measured_bytes == max(m["memory/ssd_bytes"][0] for m in steps)
    out = comparison_to_dict(run_dir, list(rows.values()))
    assert out["ranks"][0]["tiers"]["ram"]["measured_bytes"] == ram.measured_bytes
    assert out["within_tolerance"] == all(r.within is not False for r in rows.values())


def test_compare_refuses_what_is_not_a_measured_run(run_dir, tmp_path):
    with pytest.raises(UserError, match="not a run directory"):
        compare_run(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    with pytest.raises(UserError, match="no measured memory"):
        compare_run(bare)


@pytest.mark.parametrize("predicted,measured,text,within", [
    (346_370_000, 276_480_000, "0.798", False),  # was printed "0.80" beside "more than 20% off"
    (100, 80, "0.80", True), (100, 120, "1.20", True), (10_000, 12_004, "1.2004", False), (100, 79, "0.79", False)])
def test_the_printed_ratio_agrees_with_the_verdict(predicted, measured, text, within):
    from moesys_cli.plan import _render_compare
    from moesys_cli.render import console

    row = TierComparison(0, "device", predicted, measured)
    assert row.within is within and row.ratio_text == text
    assert (abs(float(row.ratio_text) - 1) <= TOLERANCE) is within
    with console.capture() as table:
        _render_compare(Path("run"), [row])
    assert f" {text} " in table.get()
    assert comparison_to_dict(Path("run"), [row])["ranks"][0]["tiers"]["device"]["ratio"] == measured / predicted


def test_the_host_tier_holds_the_pinned_memory_the_anonymous_rss_leaves_out(tmp_path):
    """With a GPU the stages and gradient staging are pinned: the driver maps them, so the host tier's measured bytes
    are the anonymous RSS and the pinned allocator's peak together, per rank; a run recorded before the pinned key
    counts the RSS alone."""
    lines = [{"step": 1, "memory/peak_rss_anon": [10, 20], "memory/pinned_host": [5, 0],
              "memory/cuda_max_allocated": [7, 8], "memory/ssd_bytes": [0, 0]},
             {"step": 2, "memory/peak_rss_anon": [12, 21], "memory/pinned_host": [5, 9],
              "memory/cuda_max_allocated": [7, 9], "memory/ssd_bytes": [0, 0]},
             {"step": 3, "memory/peak_rss_anon": [11, 40]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "rank0.json").write_text(json.dumps(
        {"rank": 0, "memory/peak_rss_anon": 13, "memory/pinned_host": 6, "memory/cuda_max_allocated": 7}))
    assert tier_bytes("host", lines[1]) == [17, 30] and tier_bytes("ram", lines[1]) == [12, 21]
    assert tier_bytes("host", lines[2]) == [11, 40] and tier_bytes("device", lines[2]) == []
    peaks = measured_peaks(tmp_path)
    assert peaks["host"] == {0: 19, 1: 40} and peaks["ram"] == {0: 13, 1: 40}
    assert peaks["device"] == {0: 7, 1: 9}
