"""runtime/train/preflight.py's disk check, on resolved configs as `moesys train` runs it before launching: the
expert store and the checkpoints must fit the free space of the filesystems they go to."""

from __future__ import annotations

import pytest

from moesys_cli.resolve import resolve_config
from runtime.errors import UserError
from runtime.train.preflight import check_disk

HUGE = ["recipe=tiny", "model.num_experts=512", "model.hidden_size=8192", "model.ffn_hidden_size=32768",
        "model.num_layers=12", "model.num_heads=64", "train.lr=1e-4"]  # 3.3T parameters: 40 TB a checkpoint
NO_CHECKPOINTS = ["train.checkpoint_every=0", "train.final_checkpoint=false"]


@pytest.mark.parametrize("extra,target,written", [
    ([], "checkpoints", "(3 checkpoints of 39624.76 GB at once, 2 kept and the next being written)"),
    (["storage.offload=ssd", *NO_CHECKPOINTS], "expert_store", "(expert store "),
])
def test_files_the_disk_cannot_hold_are_refused_in_one_line(tmp_path, extra, target, written):
    run_dir = tmp_path / "run"
    with pytest.raises(UserError) as refused:
        check_disk(resolve_config([*HUGE, *extra, f"train.run_dir={run_dir}"]))
    line = str(refused.value)
    assert line.startswith("not enough disk: ") and f"GB to write to {run_dir / target} {written}" in line, line
    assert "but its filesystem has " in line and "set train.run_dir or storage.ssd_path to a larger disk" in line
    assert "\n" not in line and not run_dir.exists()


def test_what_fits_passes_and_a_slurm_jobs_stores_are_not_this_machines(tmp_path):
    check_disk(resolve_config(["recipe=tiny", f"train.run_dir={tmp_path / 'run'}"]))
    check_disk(resolve_config([*HUGE, "storage.offload=ssd", *NO_CHECKPOINTS, "launcher=slurm",
                               f"train.run_dir={tmp_path / 'run'}"]))
