"""runtime/files/run_dir.py: the run directory is made or refused with a UserError, left untouched by a resume that does
not fit its checkpoint, and locked while a job runs in it; metrics lines are read whole."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, TrainConfig
from runtime.errors import UserError
from runtime.parallel.groups import build_groups
from runtime.files.paths import CONFIG
from runtime.files.run_dir import RunLock, clear_fatal, is_run_dir, load_config, read_fatal, record_fatal
from runtime.train.run_setup import prepare_run_dir
from runtime.train.loop import train


def test_prepare_run_dir_writes_the_config(tmp_path):
    cfg = MoesysConfig()
    cfg.train.run_dir = str(tmp_path / "run")
    run_dir = prepare_run_dir(cfg)
    assert (run_dir / CONFIG).is_file() and (run_dir / "logs").is_dir()
    assert load_config(run_dir).train.run_dir == str(run_dir)


def test_an_unwritable_run_dir_is_a_user_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    cfg = MoesysConfig()
    cfg.train.run_dir = str(tmp_path / "file" / "run")
    with pytest.raises(UserError, match="cannot write the run directory .*; set train.run_dir"):
        prepare_run_dir(cfg)


@pytest.mark.parametrize("files", [("config.yaml", "meta.json", "model.safetensors"),  # a moesys export
                                   ("config.json", "model.safetensors"),  # a Hugging Face model
                                   ("config.yaml",)], ids=["moesys-export", "hf", "config-only"])
def test_a_directory_holding_a_model_or_a_config_is_refused_before_anything_is_written(tmp_path, files):
    model = tmp_path / "model"
    model.mkdir()
    for name in files:
        (model / name).write_text(name)
    cfg = MoesysConfig()
    cfg.train.run_dir = str(model)
    with pytest.raises(UserError, match=r"train.run_dir=.*model holds a model or a config \(.*\) and is not a moesys "
                                        r"run directory; .*choose a new train.run_dir"):
        prepare_run_dir(cfg)
    assert sorted(p.name for p in model.iterdir()) == sorted(files)
    assert all((model / name).read_text() == name for name in files)
    (tmp_path / "empty").mkdir()
    cfg.train.run_dir = str(tmp_path / "empty")
    assert is_run_dir(prepare_run_dir(cfg))  # an empty directory becomes a run directory, and stays one


def trained(tmp_path) -> MoesysConfig:
    """A run directory with a real checkpoint: one training step of a small MoE, single process."""
    cfg = MoesysConfig(model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=64,
                                         num_experts=4, max_seq_len=32),
                       train=TrainConfig(max_steps=1, micro_batch_size=1, seq_len=16, warmup_steps=1,
                                         run_dir=str(tmp_path / "run")))
    cfg.topology.nproc_per_node = 1
    run_dir = prepare_run_dir(cfg)
    train(cfg, run_dir, build_groups(1, 0, 1, 1), torch.device("cpu"))
    return cfg


def test_a_resume_with_another_model_changes_nothing_in_the_run_dir(tmp_path):
    cfg = trained(tmp_path)
    before = (Path(cfg.train.run_dir) / CONFIG).read_bytes()
    changed = copy.deepcopy(cfg)
    changed.model.hidden_size = 64
    with pytest.raises(UserError, match=r"cannot resume .*tok_embeddings.weight has shape \(256, 32\)"):
        prepare_run_dir(changed)
    assert (Path(cfg.train.run_dir) / CONFIG).read_bytes() == before
    fewer = copy.deepcopy(cfg)
    fewer.model.num_experts = 2
    with pytest.raises(UserError, match=r"gate.weight has shape \(4, 32\) in .*; this config makes \(2, 32\)"):
        prepare_run_dir(fewer)
    same = copy.deepcopy(cfg)
    same.train.max_steps = 5  # a longer resume of the same model is fine
    prepare_run_dir(same)
    assert load_config(cfg.train.run_dir).train.max_steps == 5


def test_a_run_dir_in_use_is_refused_and_freed_when_its_holder_dies(tmp_path):
    lock = RunLock(tmp_path)
    with pytest.raises(UserError, match=rf"run directory {tmp_path} is in use by another moesys train \(pid"):
        RunLock(tmp_path)
    lock.release()
    RunLock(tmp_path).release()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from runtime.files.run_dir import RunLock; "
                               f"lock = RunLock({str(tmp_path)!r}); print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])  # holds it until killed or its stdin closes
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match="in use"):
        RunLock(tmp_path)
    holder.kill()
    holder.wait(timeout=10)
    RunLock(tmp_path).release()  # a killed holder leaves no stale lock
    first, second = RunLock(tmp_path), RunLock(tmp_path, node_rank=1)  # the nodes of one multi-node job
    first.release()
    second.release()


def test_a_verdict_the_run_directory_cannot_take_is_recorded_beside_it_and_read_back(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.write_text("a file where the directory should be: nothing can be written in it")
    assert read_fatal(run_dir) is None
    assert record_fatal(run_dir, 2, "training stopped: No space left on device")
    assert record_fatal(run_dir, 3, "a later rank's echo")  # the first verdict wins
    assert read_fatal(run_dir) == (2, "training stopped: No space left on device")
    clear_fatal(run_dir)
    assert read_fatal(run_dir) is None
