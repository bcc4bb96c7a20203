"""A train.run_dir holding files of the names a run writes (metrics.jsonl, checkpoints/, plan.json, logs/) that moesys
did not write is refused before anything is written, through the real command; an unrelated directory still trains,
and a run directory moesys made still resumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.conftest import FAST_TINY, losses, run_moesys

ONE_PROC = ["topology.nproc_per_node=1", "topology.expert_parallel=1", "train.max_steps=2"]


def _listing(path: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def test_a_users_metrics_and_checkpoints_are_not_taken_over(tmp_path):
    mine = tmp_path / "experiment"
    (mine / "checkpoints" / "epoch_3").mkdir(parents=True)
    (mine / "checkpoints" / "epoch_3" / "model.pt").write_bytes(b"weights")
    (mine / "metrics.jsonl").write_text('{"epoch": 3, "loss": 0.25}\n')
    before = _listing(mine)
    done = run_moesys("train", *FAST_TINY, *ONE_PROC, f"train.run_dir={mine}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and "holds metrics.jsonl, checkpoints/ that moesys did not write" in line
    assert _listing(mine) == before  # not even the lock file
    for name, make in (("plan.json", lambda p: p.write_text("{}")), ("logs", Path.mkdir),
                       ("metrics.jsonl", lambda p: p.write_text(""))):
        one = tmp_path / f"only-{name}"
        one.mkdir()
        make(one / name)
        refused = run_moesys("train", *FAST_TINY, *ONE_PROC, f"train.run_dir={one}", "--dry-run", cwd=tmp_path)
        assert refused.returncode == 2 and f"holds {name}" in refused.stderr, refused.stderr
    foreign = tmp_path / "other-tool"  # another tool's config.yaml beside metrics: not a moesys run either
    foreign.mkdir()
    (foreign / "config.yaml").write_text("lr: 0.1\n")
    (foreign / "metrics.jsonl").write_text("")
    refused = run_moesys("train", *FAST_TINY, *ONE_PROC, f"train.run_dir={foreign}", cwd=tmp_path)
    assert refused.returncode == 2 and "holds a model or a config (config.yaml)" in refused.stderr


@pytest.mark.extended
def test_an_unrelated_directory_trains_and_its_run_resumes(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.txt").write_text("my notes\n")
    first = run_moesys("train", *FAST_TINY, *ONE_PROC, f"train.run_dir={notes}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = run_moesys("train", *FAST_TINY, *ONE_PROC[:2], "train.max_steps=3", f"train.run_dir={notes}",
                       cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert len(losses(notes)) == 3 and (notes / "README.txt").read_text() == "my notes\n"
