"""`moesys train` end to end, as a scheduler, an OOM killer or a wrapper script treats it: the job never outlives
the command, a stop signal to the command alone stops the job at a checkpoint, restarts and resumes are shown, and
a failure quotes the rank that failed first."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch

from runtime.files.tensorfile import save_tensors
from runtime.train.checkpoint import latest_checkpoint
from tests.cli.conftest import FAST_TINY, losses, moesys_bin, run_moesys
from tests.cli.test_train_e2e import wait_for_step, workers
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def job_processes(root: Path) -> list[psutil.Process]:
    """Live processes with `root` in an argument: the CLI, torchrun and the workers of a run under it."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(root) in a for a in p.info["cmdline"] or []):
            found.append(p)
    return found


@pytest.fixture
def reap(tmp_path):
    """Whatever a failing test leaves running under tmp_path is killed, so that it cannot train on for hours."""
    yield
    for p in job_processes(tmp_path):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def start(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([moesys_bin(), "train", *args], env=dict(os.environ, COLUMNS="200"), text=True, **kwargs)


def test_sigkill_of_the_command_group_ends_torchrun_and_the_workers(tmp_path, reap):
    run_dir = tmp_path / "run"
    proc = start(*FAST_TINY, "train.max_steps=100000", "train.checkpoint_every=0", f"train.run_dir={run_dir}",
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_step(run_dir, 2, proc)
    assert len(workers(run_dir)) == 3  # torchrun and its two workers
    os.killpg(proc.pid, signal.SIGKILL)  # what an OOM killer or a scheduler may do
    proc.wait(timeout=30)
    wait_until(lambda: not job_processes(run_dir), timeout=30, what=lambda: "torchrun and the workers to end with "
               f"the command; still running: {[' '.join(p.info['cmdline'][:4]) for p in job_processes(run_dir)]}")


@pytest.mark.parametrize("sig, code", [pytest.param(signal.SIGINT, 130, id="SIGINT", marks=pytest.mark.extended),
                                       pytest.param(signal.SIGTERM, 143, id="SIGTERM")])
def test_a_stop_signal_to_the_command_alone_checkpoints_stops_and_resumes(tmp_path, reap, sig, code):
    run_dir = tmp_path / "run"
    args = [*FAST_TINY, "train.max_steps=40", "train.checkpoint_every=0", f"train.run_dir={run_dir}"]
    proc = start(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(sig)  # the command's pid only, as a scheduler or a wrapper script does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, (out, err)
    assert not job_processes(run_dir)
    stopped_at = len(losses(run_dir))
    assert stopped_at <= 20, "the workers trained on after the signal"
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and int(ckpt.name.split("_")[1]) == stopped_at
    stop = [line for line in err.splitlines() if "resume with: " in line]
    assert len(stop) == 1 and stop[0].startswith(f"{sig.name}: stopped at step {stopped_at} with checkpoint ")
    assert not [line for line in err.splitlines() if line.startswith("error")]  # a stop the user asked for
    command = shlex.split(err.rsplit("resume with: ", 1)[1].strip())
    assert command[:2] == ["moesys", "train"]
    assert [a for a in command if "train.run_dir=" in a] == [f"train.run_dir={run_dir}"]

    before = losses(run_dir)
    resumed = run_moesys(*command[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {stopped_at}" in resumed.stdout
    assert len(losses(run_dir)) == 40 and losses(run_dir)[:stopped_at] == before


@pytest.mark.extended
def test_progress_says_when_workers_restart_and_when_a_run_resumes(tmp_path, reap):
    run_dir = tmp_path / "run"
    args = [*FAST_TINY, "train.checkpoint_every=3", "train.max_restarts=1", f"train.run_dir={run_dir}"]
    proc = start(*args, "train.max_steps=8", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_step(run_dir, 4, proc)
    at_kill = len(losses(run_dir))
    workers(run_dir)[-1].send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resumed from" not in out
    back = re.search(r"worker restarted \(1 of 1 restarts\), back to step (\d+)", out)
    assert back, out
    assert int(back.group(1)) in (3 * (at_kill // 3), 3 * ((at_kill + 1) // 3))

    again = run_moesys("train", *args, "train.max_steps=10")
    assert again.returncode == 0, again.stderr
    assert "resumed from step 8" in again.stdout and "worker restarted" not in again.stdout


@pytest.mark.extended
def test_a_failure_quotes_the_rank_that_failed_not_its_peer(tmp_path, reap):
    run_dir = tmp_path / "run"
    args = [*FAST_TINY, "train.max_restarts=0", f"train.run_dir={run_dir}"]
    assert run_moesys("train", *args, "train.max_steps=2").returncode == 0
    # A well-formed file rank 1 alone reads, whose RNG state torch refuses: a crash in one rank, not a bad input
    save_tensors(latest_checkpoint(run_dir) / "rng-rank1.safetensors", {"cpu": torch.zeros(3, dtype=torch.uint8)})
    failed = run_moesys("train", *args, "train.max_steps=4")
    assert failed.returncode == 1, failed.stderr
    assert "local rank 1: " in failed.stderr, failed.stderr
    assert "Connection closed" not in failed.stderr and "Connection reset" not in failed.stderr
