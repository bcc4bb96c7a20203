"""Checkpoint control: train.keep_checkpoints keeps the newest N (the count the plan's disk bytes use);
train.resume_from=step_N|none starts there, moving later checkpoints aside, and trains as the run did from there;
a step that does not exist, a malformed value and a damaged checkpoint are one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config import ConfigError, MoesysConfig, TrainConfig, config_from_dict
from runtime.errors import UserError
from runtime.parallel.groups import build_groups
from runtime.train.run_setup import prepare_run_dir
from runtime.files.run_dir import read_metrics
from runtime.plan.disk import KEEP_CHECKPOINTS, kept_checkpoints
from runtime.train.checkpoint import latest_checkpoint
from runtime.train.loop import train
from runtime.files.paths import SUPERSEDED
from runtime.files.resume import apply_resume_from, checkpoint_steps, chosen_checkpoint
from tests.trained_run import SMALL_MOE


def config(run_dir: Path, steps: int = 4, **train_keys) -> MoesysConfig:
    keys = {"max_steps": steps, "micro_batch_size": 2, "seq_len": 16, "warmup_steps": 1, "checkpoint_every": 1,
            "run_dir": str(run_dir), **train_keys}
    cfg = MoesysConfig(model=SMALL_MOE, train=TrainConfig(**keys))
    cfg.topology.nproc_per_node = 1
    return cfg


def run(cfg: MoesysConfig) -> list[float]:
    """Launch as `moesys train` does (resume_from applied first); the losses in metrics.jsonl."""
    cfg.train.run_dir = str(Path(cfg.train.run_dir).resolve())
    apply_resume_from(cfg)
    path = prepare_run_dir(cfg)
    train(cfg, path, build_groups(1, 0, 1, 1), torch.device("cpu"))
    return [m["loss"] for m in read_metrics(path) if "loss" in m]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[float]]:
    """4 steps, a checkpoint each, all kept."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    return run_dir, run(config(run_dir, keep_checkpoints=4))


def copy_run(source: Path, run_dir: Path) -> Path:
    """A copy of a run directory's config, metrics and checkpoints (the module's run stays whole)."""
    for path in [source / "config.yaml", source / "metrics.jsonl", *(source / "checkpoints").rglob("*")]:
        target = run_dir / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    return run_dir


@pytest.mark.parametrize("keep", [1, 3])
def test_keep_checkpoints_keeps_the_newest_n(tmp_path, keep):
    cfg = config(tmp_path / "run", keep_checkpoints=keep)
    run(cfg)
    assert list(checkpoint_steps(tmp_path / "run")) == list(range(5 - keep, 5))
    assert kept_checkpoints(cfg) == keep and MoesysConfig().train.keep_checkpoints == KEEP_CHECKPOINTS == 2


def test_resume_from_a_step_trains_as_the_run_did_from_there_and_moves_the_later_ones_aside(trained, tmp_path):
    source, losses = trained
    run_dir = copy_run(source, tmp_path / "run")
    again = run(config(run_dir, keep_checkpoints=4, resume_from="step_2"))
    assert again == losses  # steps 3 and 4 trained again from step 2: the same numbers
    assert [m.get("resumed_from") for m in read_metrics(run_dir)] == [None, None, 2, None]
    aside = list((run_dir / "checkpoints").glob(f"{SUPERSEDED}*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(run_dir).name == "step_00000004" and list(checkpoint_steps(run_dir)) == [1, 2, 3, 4]


def test_resume_from_none_starts_from_scratch(trained, tmp_path):
    source, losses = trained
    run_dir = copy_run(source, tmp_path / "run")
    cfg = config(run_dir, steps=2, keep_checkpoints=4, resume_from="none")
    assert chosen_checkpoint(cfg) is None
    fresh = run(cfg)
    assert fresh == losses[:2] and [m.get("resumed_from") for m in read_metrics(run_dir)] == [None, None]
    assert len(list((run_dir / "checkpoints").glob(f"{SUPERSEDED}*/step_*"))) == 4
    assert list(checkpoint_steps(run_dir)) == [1, 2]


def test_a_step_without_a_checkpoint_is_refused_naming_the_ones_there(trained):
    source, _ = trained
    with pytest.raises(UserError, match=r"train.resume_from=step_7: .* has no complete checkpoint of step 7 \(it has: "
                                        r"step_1, step_2, step_3, step_4\)"):
        chosen_checkpoint(config(source, resume_from="step_7"))


@pytest.mark.parametrize("value", ["first", "step_", "step_x", "steps_3", "3"])
def test_a_malformed_resume_from_is_one_line(value):
    with pytest.raises(ConfigError, match=f"train.resume_from='{value}' is not latest, none or step_N"):
        config_from_dict({"train": {"resume_from": value}})


def test_keep_checkpoints_below_one_is_refused():
    with pytest.raises(ConfigError, match="train.keep_checkpoints must be >= 1"):
        config_from_dict({"train": {"keep_checkpoints": 0}})


def test_a_damaged_checkpoint_names_the_key_that_skips_it(tmp_path):
    cfg = config(tmp_path / "run", steps=3)
    run(cfg)
    dense = tmp_path / "run" / "checkpoints" / "step_00000003" / "dense.safetensors"
    data = bytearray(dense.read_bytes())
    data[-1] ^= 0xFF
    dense.write_bytes(bytes(data))
    cfg.train.max_steps = 4
    with pytest.raises(UserError) as err:
        run(cfg)
    message = str(err.value)
    assert "damaged" in message and "train.resume_from=step_2 (the newest older checkpoint)" in message
    assert "train.resume_from=none" in message and "\n" not in message
