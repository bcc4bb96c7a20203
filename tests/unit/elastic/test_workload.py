"""Workloads from the config and from a finished run's metrics.jsonl."""

import json
from types import SimpleNamespace

import pytest

from runtime.elastic.allocation import AllocationError, allocate
from runtime.elastic.workload import workload_from_config, workload_from_metrics


def _write(run_dir, records):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_from_config():
    tasks = {"a": SimpleNamespace(batch_size=512, cost_per_sample=1.0),
             "b": SimpleNamespace(batch_size=128, cost_per_sample=2.5)}
    assert workload_from_config(tasks) == {"a": (512, 1.0), "b": (128, 2.5)}


def test_measured_cost_is_inverse_mean_rate_normalised(tmp_path):
    _write(tmp_path, [
        {"step": 0, "loss": 3.2},  # a line without task fields is ignored
        {"step": 1, "rank": 0, "task": "fast", "samples_per_s": 90.0},
        {"step": 1, "rank": 1, "task": "fast", "samples_per_s": 110.0},
        {"step": 1, "rank": 2, "task": "slow", "samples_per_s": 25.0},
        "",
        {"step": 2, "rank": 2, "task": "slow", "samples_per_s": 25.0},
    ])
    work = workload_from_metrics(tmp_path, {"fast": 64, "slow": 64})
    assert work["fast"] == (64, 1.0)
    assert work["slow"] == (64, pytest.approx(4.0))
    assert allocate(work, num_gpus=5).gpus == {"fast": 1, "slow": 4}


def test_unknown_and_missing_tasks_are_named(tmp_path):
    _write(tmp_path, [{"task": "a", "samples_per_s": 1.0}, {"task": "ghost", "samples_per_s": 2.0}])
    with pytest.raises(AllocationError, match="'ghost'.*not configured"):
        workload_from_metrics(tmp_path, {"a": 8})
    _write(tmp_path, [{"task": "a", "samples_per_s": 1.0}])
    with pytest.raises(AllocationError, match="configured task 'b'"):
        workload_from_metrics(tmp_path, {"a": 8, "b": 8})


def test_bad_files(tmp_path):
    with pytest.raises(AllocationError, match="does not exist"):
        workload_from_metrics(tmp_path / "run", {"a": 8})
    _write(tmp_path, ["{not json"])
    with pytest.raises(AllocationError, match=":1 is not a JSON line"):
        workload_from_metrics(tmp_path, {"a": 8})
    _write(tmp_path, [{"task": "a", "samples_per_s": 0}])
    with pytest.raises(AllocationError, match="must be positive"):
        workload_from_metrics(tmp_path, {"a": 8})
