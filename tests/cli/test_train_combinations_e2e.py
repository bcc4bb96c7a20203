"""Features together, as the user combines them: every pair of {storage.offload=ssd, storage.dense_shard=true,
model.embedding_partition=true, a multi-task recipe} that validate() accepts trains 30 steps on 2 gloo processes
with EP 2 and matches the same run without those features within 1e-5 (routing leaves experts idle on most steps),
on the GPT-MoE layout: the features sum in another order, and the runs agree while no router decision near a tie
flips over that rounding (they part by 1.3e-7 at most on it; on recipe=tiny's Mixtral layout multitask+dense_shard
sends one token of layer 1 to another expert at step 15, and the runs then part by up to 5e-4); a SIGKILLed worker
of an offload + dense-shard run resumes to the uninterrupted losses; fp16 with offload in host memory, the delayed
update and dense sharding tracks fp16 resident training; refused combinations exit 2 in one line with nothing
launched."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.cli.conftest import FAST_TINY, GPT_STYLE, losses, run_moesys
from tests.cli.test_train_e2e import wait_for_step, workers
from tests.cli.test_train_signals_e2e import reap, start  # noqa: F401  (reap is a fixture)

pytestmark = pytest.mark.slow
STEPS = 30
FEATURES = {"ssd": "storage.offload=ssd", "dense_shard": "storage.dense_shard=true",
            "embedding_partition": "model.embedding_partition=true"}
MULTITASK = """# @package _global_
defaults:
  - override /model: tiny
  - override /topology: single
  - _self_
recipe: two-tasks
topology: {nproc_per_node: 2, expert_parallel: 2}
train: {seq_len: 64, micro_batch_size: 4, warmup_steps: 2}
tasks:
  heavy: {batch_size: 6, gpus: 1}
  light: {batch_size: 2, gpus: 1}
"""
PAIRS = [("ssd", "dense_shard"), ("ssd", "embedding_partition"), ("dense_shard", "embedding_partition"),
         ("multitask", "ssd"), ("multitask", "dense_shard"), ("multitask", "embedding_partition")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("combinations")
    (path / "two-tasks.yaml").write_text(MULTITASK)
    return path


def train(workdir: Path, name: str, features: tuple[str, ...]) -> list[float]:
    base = [f"recipe={workdir / 'two-tasks.yaml'}"] if "multitask" in features else FAST_TINY
    overrides = [FEATURES[f] for f in features if f != "multitask"]
    run_dir = workdir / name
    if not (run_dir / "summary.json").exists():  # the baselines are shared by several pairs
        proc = run_moesys("train", *base, *GPT_STYLE, *overrides, f"train.max_steps={STEPS}",
                          f"train.run_dir={run_dir}", "--json", cwd=workdir, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in records if "loss" in m]
    assert len(steps) == STEPS
    assert sum(any(v == 0 for layer in m["expert_load"] for v in layer) for m in steps) > STEPS // 2
    return [m["loss"] for m in steps]


EXTENDED_PAIRS = {("ssd", "dense_shard"), ("ssd", "embedding_partition"), ("dense_shard", "embedding_partition"),
                  ("multitask", "ssd"), ("multitask", "embedding_partition")}


@pytest.mark.parametrize("pair", [pytest.param(p, marks=[pytest.mark.extended] if p in EXTENDED_PAIRS else [],
                                               id="+".join(p)) for p in PAIRS])
def test_a_pair_of_features_trains_like_the_run_without_them(workdir, pair):
    baseline = ("multitask",) if "multitask" in pair else ()
    ref = train(workdir, "+".join(baseline) or "plain", baseline)
    got = train(workdir, "+".join(pair), pair)
    assert got == pytest.approx(ref, rel=1e-5)


@pytest.mark.extended
def test_a_killed_worker_of_an_offload_and_dense_shard_run_resumes_to_the_same_losses(workdir, reap):  # noqa: F811
    """With one MoE layer's experts kept on the device: its checkpoint holds both kinds of expert files."""
    ref = train(workdir, "ssd+dense_shard", ("ssd", "dense_shard"))
    run_dir = workdir / "killed"
    proc = start(*FAST_TINY, FEATURES["ssd"], FEATURES["dense_shard"], "storage.resident_layers=1",
                 f"train.max_steps={STEPS}", "train.checkpoint_every=5", "train.max_restarts=1",
                 f"train.run_dir={run_dir}",
                 cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_step(run_dir, 12, proc)
    workers(run_dir)[-1].send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "worker restarted (1 of 1 restarts)" in out
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["loss"]  # the restarted attempt rewrites the steps after the checkpoint
    assert [by_step[s] for s in range(1, STEPS + 1)] == pytest.approx(ref, rel=1e-5)
    assert losses(run_dir)[-1] == pytest.approx(ref[-1], rel=1e-5)


@pytest.mark.extended
def test_fp16_with_offload_delayed_update_and_dense_sharding_tracks_fp16_resident(workdir):
    """The paper's precision with every offload feature on 2 ranks (one MoE layer kept on the device): the loss
    scale's overflow check spans the CPU optimizer's gradients on both ranks, and the delayed update trains within a
    few percent of the exact run."""
    fp16 = ("train.precision=fp16",)
    ref = run_moesys("train", *FAST_TINY, *fp16, f"train.max_steps={STEPS}", "train.run_dir=fp16", "--json",
                     cwd=workdir, timeout=900)
    got = run_moesys("train", *FAST_TINY, *fp16, "storage.offload=cpu", "storage.delayed_update=true",
                     "storage.resident_layers=1", FEATURES["dense_shard"], f"train.max_steps={STEPS}",
                     "train.run_dir=fp16-all", "--json", cwd=workdir, timeout=900)
    assert ref.returncode == 0 and got.returncode == 0, got.stderr[-3000:]
    ref_losses, got_losses = losses(workdir / "fp16"), losses(workdir / "fp16-all")
    assert len(got_losses) == STEPS and got_losses != ref_losses
    assert got_losses[-1] == pytest.approx(ref_losses[-1], rel=0.05)


def test_a_refused_combination_exits_2_in_one_line_before_launching(workdir):
    proc = run_moesys("train", *FAST_TINY, FEATURES["ssd"], "storage.delayed_update=true", "train.run_dir=refused",
                      cwd=workdir, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "storage.delayed_update=true needs storage.offload=cpu" in proc.stderr
    assert not (workdir / "refused").exists()
