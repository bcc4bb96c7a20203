"""`moesys train` end to end: real torchrun workers on CPU, faults, signals and resharding."""

from __future__ import annotations

import pytest
import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import torch
from safetensors import safe_open

from runtime.parallel.groups import build_groups
from runtime.files.run_dir import load_config
from runtime.train.build import build_components
from runtime.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.cli.conftest import FAST_TINY, losses, moesys_bin, run_moesys
from tests.waiting import wait_until


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until metrics.jsonl holds `step` steps; fails if the job ends first (before the test could interrupt it)."""
    metrics = run_dir / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and len(losses(run_dir)) >= step, what=f"step {step} in {metrics}",
               timeout=timeout, process=proc)


def workers(run_dir: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "runtime.train.worker" in cmd and str(run_dir) in cmd:
            found.append(p)
    return found


def test_sigkill_restart_resumes_to_the_uninterrupted_losses(tmp_path):
    args = [*FAST_TINY, "train.max_steps=10", "train.checkpoint_every=3", "train.max_restarts=2"]
    clean = run_moesys("train", *args, f"train.run_dir={tmp_path / 'clean'}", "--json")
    assert clean.returncode == 0, clean.stderr
    summary = json.loads(clean.stdout)
    assert summary["steps"] == 10 and summary["final_loss"] < summary["initial_loss"]

    faulty = tmp_path / "faulty"
    proc = subprocess.Popen([moesys_bin(), "train", *args, f"train.run_dir={faulty}", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(faulty, 4, proc)
    victim = workers(faulty)[-1]
    victim.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert list((faulty / "logs").rglob("attempt_1")), "torchrun did not restart the workers"
    assert losses(faulty) == losses(tmp_path / "clean")  # bitwise on CPU
    assert json.loads(out)["final_loss"] == summary["final_loss"]


@pytest.mark.extended
def test_sigint_checkpoints_then_exits_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    args = [*FAST_TINY, "train.checkpoint_every=0", f"train.run_dir={run_dir}"]
    proc = subprocess.Popen([moesys_bin(), "train", *args, "train.max_steps=200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for_step(run_dir, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "train.run_dir=" in err and "resume" in err
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and int(ckpt.name.split("_")[1]) == len(losses(run_dir))
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    stopped_at = len(losses(run_dir))
    resumed = run_moesys("train", *args, f"train.max_steps={stopped_at + 2}", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["steps"] == stopped_at + 2


def test_checkpoint_reshards_from_two_to_one_expert_parallel_ranks(tmp_path):
    run_dir = tmp_path / "ep2"
    done = run_moesys("train", *FAST_TINY, "train.max_steps=3", f"train.run_dir={run_dir}")
    assert done.returncode == 0, done.stderr
    cfg = load_config(run_dir)
    assert cfg.topology.expert_parallel == 2
    cfg.topology.expert_parallel = 1
    cfg.topology.nproc_per_node = 1
    groups = build_groups(1, 0, 1, 1)
    c = build_components(cfg, groups, torch.device("cpu"))
    ckpt = latest_checkpoint(run_dir)
    assert load_checkpoint(ckpt, c.model, c.optimizer, groups) == 3
    files = {f.name: safe_open(str(f), framework="pt") for f in ckpt.glob("experts-ep*.safetensors")}
    assert set(files) == {"experts-ep0.safetensors", "experts-ep1.safetensors"}
    checked = 0
    for name, param in c.model.named_parameters():
        if ".experts." not in name:
            continue
        state = c.optimizer.state[param]
        for g in range(cfg.model.num_experts):
            owner = files[f"experts-ep{g // (cfg.model.num_experts // 2)}.safetensors"]
            torch.testing.assert_close(param[g], owner.get_tensor(f"model.{name}.{g}"), rtol=0, atol=0)
            torch.testing.assert_close(state["exp_avg"][g], owner.get_tensor(f"exp_avg.{name}.{g}"), rtol=0, atol=0)
            torch.testing.assert_close(state["exp_avg_sq"][g], owner.get_tensor(f"exp_avg_sq.{name}.{g}"),
                                       rtol=0, atol=0)
            checked += 1
    assert checked == cfg.model.num_experts * cfg.model.num_layers * 4  # w1, w2, b1, b2 per MoE layer
