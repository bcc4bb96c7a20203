"""runtime/launch/job.py, step by step: the plan and its checks refuse before anything is written, the run directory
gets config.yaml, the tokenizer and plan.json from the one plan, a changed config re-plans and says so, a real torchrun
job runs to its end and tells its watcher, a job past its time limit is stopped, and a worker never plans itself."""

from __future__ import annotations

import json
import sys

import psutil
import pytest

from runtime.config import ModelConfig, MoesysConfig, TopologyConfig, TrainConfig
from runtime.errors import UserError
from runtime.files.paths import CONFIG, FATAL, PLAN, TOKENIZER_FILE
from runtime.files.run_dir import read_fatal, record_fatal
from runtime.launch.command import WORKER_MODULE
from runtime.launch.job import Job, JobFailed, JobWatcher, run_job
from runtime.plan.planner import plan_placement


class Recorder(JobWatcher):
    """A watcher that keeps what it is told, in order."""

    def __init__(self):
        self.told: list[tuple] = []

    def note(self, line):
        self.told.append(("note", line))

    def say(self, line):
        self.told.append(("say", line))

    def following(self, total_steps):
        self.told.append(("following", total_steps))

    def step(self, metrics):
        self.told.append(("step", metrics["step"]))


def small(run_dir, steps: int = 2, nproc: int = 1, **train) -> MoesysConfig:
    return MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_experts=4, max_seq_len=32),
                        topology=TopologyConfig(nproc_per_node=nproc, expert_parallel=nproc),
                        train=TrainConfig(seq_len=16, micro_batch_size=2, max_steps=steps, checkpoint_every=0,
                                          max_restarts=0, run_dir=str(run_dir), **train))


def test_the_plan_is_checked_before_anything_is_written(tmp_path):
    cfg = small(tmp_path / "run")
    cfg.topology.cpu_memory_gb = 0.01  # the plan says this does not fit
    with pytest.raises(UserError, match="the plan says this run does not fit"):
        Job(cfg).plan()
    assert not (tmp_path / "run").exists()


def test_the_run_directory_holds_the_config_the_tokenizer_and_the_launchs_plan(tmp_path):
    cfg = small(tmp_path / "run")
    job, seen = Job(cfg), []
    plan = job.plan()
    record_fatal(job.run_dir, 3, "the last launch's verdict")
    run_dir = job.prepare(plan, prepare=lambda path: seen.append(sorted(p.name for p in path.iterdir())))
    assert run_dir == (tmp_path / "run").resolve() and cfg.train.run_dir == str(run_dir)
    assert {CONFIG, TOKENIZER_FILE} <= set(seen[0]) and PLAN not in seen[0]  # `prepare` runs before plan.json
    recorded = json.loads((run_dir / PLAN).read_text())
    assert recorded["plan"]["per_rank"]["process_host_bytes"] == plan.process_host_bytes
    assert read_fatal(run_dir) is None and not (run_dir / FATAL).exists()


def test_a_changed_config_replans_and_the_watcher_is_told(tmp_path):
    first = Job(small(tmp_path / "run"))
    first.prepare(first.plan())
    watcher = Recorder()
    changed = small(tmp_path / "run")
    changed.storage.offload = "cpu"
    again = Job(changed, watcher)
    again.prepare(plan_placement(changed))
    assert ("say", "the config changed since the recorded plan: re-planned (offload none -> cpu, cpu_cache_experts "
                   "0 -> 8)") in watcher.told  # every local expert of both layers
    assert json.loads((again.run_dir / PLAN).read_text())["placement"]["offload"] == "cpu"


def test_a_job_runs_to_its_end_and_tells_its_watcher(tmp_path):
    watcher = Recorder()
    result = run_job(small(tmp_path / "run", steps=2), watcher)
    assert result.ok and result.error is None and result.stopped is None, result
    assert result.summary["steps"] == 2 and result.or_raise() is result
    assert watcher.told[0] == ("following", 2) and ("step", 2) in watcher.told
    assert (result.run_dir / PLAN).is_file()


def test_a_job_past_its_time_limit_is_stopped_with_its_processes(tmp_path):
    result = run_job(small(tmp_path / "run", steps=100000), time_limit_s=0)
    assert result.exit_code == 124 and result.error == "did not finish in 0 s"
    with pytest.raises(JobFailed, match=r"job .*run failed: did not finish in 0 s"):
        result.or_raise()
    left = [p for p in psutil.process_iter(["cmdline"]) if str(result.run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not left


def test_a_worker_refuses_a_run_directory_without_the_launchs_plan(tmp_path, capsys):
    from runtime.train import worker

    job = Job(small(tmp_path / "run"))
    job.prepare(job.plan())
    (job.run_dir / PLAN).unlink()  # as a launcher that did not plan would leave it
    assert worker.main([str(job.run_dir)]) == 2
    assert read_fatal(job.run_dir)[1].startswith(f"{job.run_dir / PLAN} is missing: launch training with moesys train")
    assert "error: " in capsys.readouterr().err


def test_the_command_runs_the_worker_module_asked_for(tmp_path):
    job = Job(small(tmp_path / "run"), worker="runtime.bench.embedding_worker")
    assert job.command().argv[-2:] == ["runtime.bench.embedding_worker", str(job.run_dir)]
    assert Job(small(tmp_path / "run")).command().argv[-2:] == [WORKER_MODULE, str(job.run_dir)]
    assert job.command().argv[-7] == "--no-python" and job.command().argv[-6] == sys.executable
