"""`moesys train` when the kernel's OOM killer takes a worker: the job stops at once (no restart loop), with one
line naming the rank, its last measured memory and the plan's estimate, and a non-zero exit; nothing is left
running. The memory limit is a real cgroup (runtime/memcap.py) that the run starts under with room to spare and
that is then lowered to just above what the job holds between steps, as when another job takes the machine's RAM."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from runtime import memcap
from runtime.oom import OUT_OF_MEMORY_EXIT
from tests.cli.conftest import losses, moesys_bin
from tests.cli.test_train_e2e import wait_for_step
from tests.cli.test_train_signals_e2e import job_processes, reap  # noqa: F401 (a fixture)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MB = 2**20


def squeeze(cap: memcap.MemoryCap, run_dir: Path, proc: subprocess.Popen, margin: int = 16 * MB) -> int:
    """Lower the cap to `margin` above the group's smallest anonymous memory over three more logged steps (so between
    two steps' activations), so that the next step's activations do not fit. Returns the limit set."""
    samples, steps = [], len(losses(run_dir))
    wait_until(lambda: samples.append(cap.max_rss()) or len(losses(run_dir)) >= steps + 3,
               what="three more steps to sample the job's memory over", process=proc)
    low = min(samples)
    for extra in range(0, 20):  # the kernel refuses (EBUSY) a limit it cannot reclaim down to: a little higher
        limit = low + margin + extra * 8 * MB
        try:
            (cap.path / "memory.limit_in_bytes").write_text(str(limit))
            return limit
        except OSError:
            continue
    raise AssertionError("could not lower the memory limit")


@pytest.mark.extended
def test_a_worker_the_oom_killer_takes_stops_the_job_with_one_line(tmp_path, reap):  # noqa: F811
    why = memcap.available()
    if why:
        pytest.skip(why)
    run_dir = tmp_path / "run"
    args = ["recipe=tiny", "train.max_steps=100000", "train.checkpoint_every=0", "train.max_restarts=3",
            f"train.run_dir={run_dir}"]
    with memcap.MemoryCap(8 * 2**30, name="moesys-oom-test") as cap:
        proc = subprocess.Popen([moesys_bin(), "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ, COLUMNS="200"), preexec_fn=cap.preexec)
        wait_for_step(run_dir, 3, proc)
        squeeze(cap, run_dir, proc)
        out, err = proc.communicate(timeout=180)
        kills = cap.oom_kills()
    assert kills >= 1, "the squeezed job was never OOM-killed"
    assert proc.returncode == OUT_OF_MEMORY_EXIT, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert re.search(r"rank [01] ran out of memory \(killed by the kernel's OOM killer\)", line), line
    assert re.search(r"last measured 0\.\d\d GB", line) and re.search(r"plan estimate 0\.\d\d GB per rank", line)
    assert "not restarted" in line
    attempts = list((run_dir / "logs").glob("*/attempt_*"))
    assert len(attempts) <= 2, attempts  # the killed attempt and, at most, one torchrun began before it was stopped
    assert out.count("worker restarted") <= 1
    wait_until(lambda: not job_processes(run_dir), what="nothing of the job to be left running", timeout=30)
