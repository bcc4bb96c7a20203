"""train.tensorboard: which TensorBoard tags a step line becomes, steps redone after a resume replace the old ones
for TensorBoard's reader, and a missing tensorboard package is a one-line config error before any launch (the real
run's event files are checked in tests/cli/test_report_e2e.py)."""

from __future__ import annotations

import sys

import pytest

from runtime.config import ConfigError, MoesysConfig, config_from_dict, config_to_dict, validate
from runtime.train.tensorboard import TensorBoardLog, histograms, scalars
from runtime.files.run_dir import task_samples_per_s

RECORD = {"step": 7, "max_steps": 9, "resumed_from": 6, "loss": 4.5, "z_loss": 4.4, "gate_entropy": [2.0, 1.9],
          "expert_load": [[0.5, 0.25, 0.25, 0.0], [0.0, 0.5, 0.5, 0.0]], "memory/peak_rss_anon": [300, 310],
          "memory_bytes_per_rank": [400, 410], "offload/cache_hit_rate": 0.75, "task_loss": {"a": 5.0},
          "lr": 0.001}


def test_a_step_line_becomes_one_scalar_per_number_and_a_histogram_per_layer():
    assert scalars(RECORD) == {
        "loss": 4.5, "z_loss": 4.4, "gate_entropy/layer0": 2.0, "gate_entropy/layer1": 1.9,
        "memory/peak_rss_anon/rank0": 300.0, "memory/peak_rss_anon/rank1": 310.0,
        "memory_bytes_per_rank/rank0": 400.0, "memory_bytes_per_rank/rank1": 410.0,
        "offload/cache_hit_rate": 0.75, "task_loss/a": 5.0, "lr": 0.001}
    assert histograms(RECORD) == {"expert_load/layer0": [0.5, 0.25, 0.25, 0.0],
                                  "expert_load/layer1": [0.0, 0.5, 0.5, 0.0]}
    lines = [{"step": 7, "rank": 0, "task": "a", "samples": 8, "compute_s": 2.0},
             {"step": 7, "rank": 1, "task": "a", "samples": 4, "compute_s": 1.0},
             {"step": 7, "rank": 1, "task": "b", "samples": 4, "compute_s": 1.0}]
    assert task_samples_per_s(lines) == {"a": 8.0, "b": 4.0}


def test_steps_written_again_after_a_resume_replace_the_old_ones(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardLog(tmp_path)
    for step in range(1, 5):  # a worker that got to step 4, whose last checkpoint was step 2
        first.write({"step": step, "loss": float(step), "expert_load": [[1.0, 0.0]]})
    first.close()
    resumed = TensorBoardLog(tmp_path, resumed_from=2)
    for step in (3, 4):
        resumed.write({"step": step, "loss": 10.0 * step, "expert_load": [[0.0, 1.0]]},
                      [{"step": step, "rank": 0, "task": "a", "samples": 2, "compute_s": 0.5}])
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [list(h.histogram_value.bucket) for h in events.Histograms("expert_load/layer0")] == \
        [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]
    assert [(e.step, e.value) for e in events.Scalars("task_samples_per_s/a")] == [(3, 4.0), (4, 4.0)]


def test_a_restart_before_the_first_checkpoint_replaces_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardLog(tmp_path)
    for step in (1, 2, 3):  # a worker killed at step 3 with no checkpoint yet: the restart begins at step 1
        first.write({"step": step, "loss": float(step)})
    first.close()
    restarted = TensorBoardLog(tmp_path, resumed_from=0)
    for step in (1, 2):
        restarted.write({"step": step, "loss": 10.0 * step})
    restarted.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 10.0), (2, 20.0)]


def test_without_the_tensorboard_package_the_key_is_a_one_line_error_at_validation(monkeypatch):
    cfg = MoesysConfig()
    cfg.train.tensorboard = True
    validate(cfg)  # installed here (the test extra)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without the package looks like
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    message = str(refused.value)
    assert "\n" not in message
    assert message == ("train.tensorboard=true needs the tensorboard package, which is not installed: pip install "
                       "'moesys[tensorboard]' (or set train.tensorboard=false)")
    # A run's recorded config still loads without it (moesys infer, plan --compare and report read it).
    assert config_from_dict(config_to_dict(cfg)).train.tensorboard is True
