"""`moesys train` refuses, before starting torchrun, CPU workers that together need more RAM than the machine; under
a real memory cap, what the plan sizes passes that same check."""

from __future__ import annotations

import json
import subprocess

import pytest

from runtime.host import memcap
from tests.cli.conftest import moesys_bin, run_moesys


def test_too_many_cpu_workers_exit_2_before_any_launch(tmp_path):
    run_dir = tmp_path / "run"
    out = run_moesys("train", "recipe=tiny", "topology.nproc_per_node=4096", f"train.run_dir={run_dir}")
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert "topology.nproc_per_node=4096" in out.stderr and "GB of RAM" in out.stderr
    assert not run_dir.exists()  # refused before the run directory, so before torchrun


ISSUE_RUN = ["recipe=tiny", "topology=local", "topology.nproc_per_node=2", "topology.expert_parallel=2",
             "model.hidden_size=1024", "model.ffn_hidden_size=512", "model.num_layers=6", "model.num_heads=8",
             "model.num_experts=240", "model.top_k=1", "model.max_seq_len=64", "train.seq_len=32",
             "storage.offload=ssd", "storage.alpha=0.125", "train.lr=0.0004",
             "train.checkpoint_every=0"]  # memory is judged here: no checkpoints for the disk to hold but the last


def test_under_a_memory_cap_the_plan_sizes_a_cache_its_own_launch_check_accepts(tmp_path):
    why = memcap.available()
    if why:
        pytest.skip(why)
    with memcap.MemoryCap(10 * 2**30, name="moesys-plan-cap-test") as cap:  # topology=local measures the cap
        done = subprocess.run([moesys_bin(), "plan", *ISSUE_RUN, "--json"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=300, preexec_fn=cap.preexec)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    plan = json.loads(done.stdout)
    assert plan["feasible"] and plan["per_rank"]["host"] > 0 and not plan["problems"]
    assert plan["per_rank"]["process_host_bytes"] * 2 <= 10 * 2**30
