"""runtime/run_dir.py: the run directory is made or refused with a UserError; metrics lines are read whole."""

from __future__ import annotations

import pytest

from runtime.config import MoesysConfig
from runtime.errors import UserError
from runtime.run_dir import CONFIG, load_config, prepare_run_dir


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
