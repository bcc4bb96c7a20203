"""Training beyond memory, as a user runs it: `moesys train` with offload=ssd inside a memory cgroup about half the
size of the model's expert states completes, checkpoints, and gives the losses of the same model trained with its
experts resident (no cap).

The model: 0.4 B expert parameters (4.8 GB of fp32 weights and AdamW moments) in 6 MoE layers of 128 experts,
top-1 routing and 8 tokens per rank per step, so a step touches at most 1/8 of the experts (storage.alpha=0.125):
Eq. 1's CPU tier, 16aS, is what must fit in memory, not 12S. topology=local reads the cap as the machine's memory,
so the plan sizes the CPU cache for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from runtime.host import memcap
from tests.cli.conftest import losses, moesys_bin

pytestmark = pytest.mark.skipif(memcap.available() is not None, reason=f"no memory cap: {memcap.available()}")

CAP = int(2.25 * 2**30)
MODEL = ["recipe=tiny", "topology=local", "topology.nproc_per_node=2", "topology.expert_parallel=2",
         "train.seq_len=8", "train.micro_batch_size=1", "train.warmup_steps=2", "train.max_steps=4",
         "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_layers=6", "model.num_experts=128",
         "model.top_k=1", "storage.alpha=0.125"]


def run(args: list[str], cap: memcap.MemoryCap | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([moesys_bin(), "train", *MODEL, *args], capture_output=True, text=True, timeout=420,
                          env=env, preexec_fn=cap.preexec if cap else None)


def du(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.extended
def test_offloaded_training_in_half_the_memory_of_its_experts_matches_resident(tmp_path):
    capped, resident = tmp_path / "capped", tmp_path / "resident"
    with memcap.MemoryCap(CAP, "moesys-test") as cap:
        done = run(["storage.offload=ssd", f"train.run_dir={capped}"], cap)
        oom_kills = cap.oom_kills()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert oom_kills == 0 and "Traceback" not in done.stderr
    states = du(capped / "expert_store")
    assert states > 1.9 * CAP, (states, CAP)  # the experts' states really are twice the memory the run had
    placement = json.loads((capped / "plan.json").read_text())["placement"]
    assert placement["offload"] == "ssd" and placement["cpu_cache_experts"] < placement["local_experts"] / 2
    assert (capped / "checkpoints" / "step_00000004" / "meta.json").exists()
    shutil.rmtree(capped / "expert_store")  # 4.8 GB; the checkpoint stays for the comparison below

    # The reference also shows train.final_checkpoint=false: a throwaway run leaves no checkpoint (the benchmark's
    # second copy of 38 GB of experts would not fit its disk).
    ref = run(["storage.offload=none", "train.final_checkpoint=false", f"train.run_dir={resident}"])
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert not list((resident / "checkpoints").glob("step_*"))
    want, got = losses(resident), losses(capped)
    assert len(got) == len(want) == 4
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


def test_a_run_the_plan_says_does_not_fit_is_refused_before_launch(tmp_path):
    from tests.cli.conftest import FAST_TINY, run_moesys

    done = run_moesys("train", *FAST_TINY, "topology.cpu_memory_gb=0.9", "storage.offload=ssd",
                      f"train.run_dir={tmp_path}")
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip()
    assert "the plan says this run does not fit" in line and "moesys plan" in line and "Traceback" not in line
    assert len(line.splitlines()) == 1 and not (tmp_path / "logs").exists()
