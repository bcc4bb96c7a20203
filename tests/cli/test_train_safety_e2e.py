"""Data safety and bounded failure, tried as a user would with the installed `moesys` command: a run's expert store
is its own, a resume that does not fit changes nothing, a diverged loss stops in one line, an offloaded run is
servable, and a stuck peer fails the job within train.collective_timeout_s instead of hanging."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.cli.conftest import FAST_TINY, losses, moesys_bin, run_moesys, tmpfs
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
ONE_PROC = ["topology.nproc_per_node=1", "topology.expert_parallel=1"]


def train(cwd: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_moesys("train", *FAST_TINY, *overrides, cwd=cwd, timeout=timeout)


@pytest.mark.extended
def test_runs_started_from_one_directory_keep_their_own_expert_stores(tmp_path):
    ssd = ["storage.offload=ssd", *ONE_PROC, "train.checkpoint_every=3"]
    for args in (["train.max_steps=6", "train.run_dir=runs/control"],  # the same two legs, nothing between
                 ["train.max_steps=9", "train.run_dir=runs/control"],
                 ["train.max_steps=6", "train.run_dir=runs/A"],
                 ["train.max_steps=6", "train.seed=99", "train.run_dir=runs/B"],
                 ["train.max_steps=9", "train.run_dir=runs/A"]):
        proc = train(tmp_path, *ssd, *args)
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runs/A/expert_store").is_dir() and not (tmp_path / "moesys_ssd").exists()
    assert losses(tmp_path / "runs/A") == losses(tmp_path / "runs/control")
    # A store shared on purpose is refused before anything launches, in one line.
    shared = ["storage.ssd_path=shared", "train.max_steps=2"]
    assert train(tmp_path, *ssd, *shared, "train.run_dir=runs/C").returncode == 0
    refused = train(tmp_path, *ssd, *shared, "train.run_dir=runs/D")
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "holds the expert store of another run" in refused.stderr
    assert not (tmp_path / "runs/D").exists()


@pytest.mark.extended
def test_a_resume_with_another_model_is_refused_and_the_run_stays_servable(tmp_path):
    ok = train(tmp_path, "train.max_steps=3", "train.run_dir=run", "storage.offload=ssd")
    assert ok.returncode == 0, ok.stderr
    config = (tmp_path / "run/config.yaml").read_bytes()
    changed = train(tmp_path, "train.max_steps=6", "train.run_dir=run", "model.hidden_size=64")
    assert changed.returncode == 2 and changed.stderr.count("\n") == 1
    assert "cannot resume" in changed.stderr and "has shape" in changed.stderr
    assert (tmp_path / "run/config.yaml").read_bytes() == config
    # Trained with offload=ssd on 2 processes (EP 2), and still servable.
    served = run_moesys("infer", f"checkpoint={tmp_path / 'run'}", "prompt=hello", "infer.max_new_tokens=4",
                        "--json", cwd=tmp_path, timeout=300)
    assert served.returncode == 0, served.stderr


def test_a_diverged_loss_stops_in_one_line_without_a_nan_checkpoint(tmp_path):
    proc = train(tmp_path, "train.max_steps=30", "train.run_dir=run", "train.lr=1e12", "train.grad_clip=0",
                 "train.warmup_steps=1", "train.checkpoint_every=1")
    assert proc.returncode == 3, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "non-finite" in error_lines[0] and "at step" in error_lines[0]
    step = int(error_lines[0].split("at step ")[1].split()[0])
    ckpts = sorted((tmp_path / "run/checkpoints").glob("step_*"))
    assert [p.name for p in ckpts][-1] == f"step_{step - 1:08d}"  # the last good step, nothing after it
    assert all(loss == loss for loss in losses(tmp_path / "run"))  # no NaN reached metrics


def worker_pids(cli: psutil.Process) -> dict[int, int]:
    """{local rank: pid} of the run's torchrun workers (their own sessions, so found through the agent)."""
    found = {}
    for child in cli.children(recursive=True):
        try:
            rank = child.environ().get("LOCAL_RANK")  # set for workers, not for the torchrun agent
            if rank is not None and "worker" in " ".join(child.cmdline()):
                found[int(rank)] = child.pid
        except psutil.Error:
            continue
    return found


def test_a_stuck_peer_fails_the_job_within_the_collective_timeout(tmp_path):
    run_dir = tmp_path / "run"
    cli = subprocess.Popen([moesys_bin(), "train", *FAST_TINY, "train.max_steps=500", f"train.run_dir={run_dir}",
                            "train.collective_timeout_s=5", "train.max_restarts=0"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= 3, what="step 3",
                   timeout=120, process=cli)
        pids = worker_pids(psutil.Process(cli.pid))
        assert set(pids) == {0, 1}, pids
        psutil.Process(pids[1]).send_signal(signal.SIGSTOP)  # rank 1 hangs, as a stuck process would
        _, stderr = cli.communicate(timeout=120)  # a job that hung on it would not end
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode != 0
    error_lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, stderr
    assert "waited more than train.collective_timeout_s=5 s" in error_lines[0] and "step " in error_lines[0]
    assert "local rank 0" in error_lines[0]


def test_a_serving_recipe_is_not_trained_by_accident(tmp_path):
    proc = run_moesys("train", "recipe=mixtral-8x7b", "train.run_dir=run", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "purpose=serve" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture
def small_filesystem(tmp_path):
    """A 100 MB tmpfs: room for what `moesys train` plans to write (its checkpoints), checked before launch."""
    with tmpfs(tmp_path / "small", "100m") as mount:
        yield mount


def test_a_full_disk_stops_at_once_in_one_line_and_leaves_no_partial_checkpoint(small_filesystem):
    """The disk fills after launch (another writer takes all but 5 MB once training runs), so the first checkpoint
    (about 29 MB) meets ENOSPC."""
    run_dir = small_filesystem / "run"
    cli = subprocess.Popen([moesys_bin(), "train", *FAST_TINY, "train.max_steps=10", "train.checkpoint_every=5",
                            "train.run_dir=run"], cwd=small_filesystem, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").exists(), what="training to run", timeout=120, process=cli)
        free = shutil.disk_usage(small_filesystem).free
        (small_filesystem / "ballast").write_bytes(b"\0" * max(0, free - (5 << 20)))
        stdout, stderr = cli.communicate(timeout=300)
    finally:
        if cli.poll() is None:
            cli.kill()
    proc = subprocess.CompletedProcess(cli.args, cli.returncode, stdout, stderr)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: training stopped: No space left on device")
    assert "run the same command again" in proc.stderr and "restarted" not in proc.stdout
    run_dir = small_filesystem / "run"
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert len(list((run_dir / "logs").glob("*/attempt_*"))) <= 2  # not torchrun's three retries
