"""`moesys train` refuses, before starting torchrun, CPU workers that together need more RAM than the machine."""

from __future__ import annotations

from tests.cli.conftest import run_moesys


def test_too_many_cpu_workers_exit_2_before_any_launch(tmp_path):
    run_dir = tmp_path / "run"
    out = run_moesys("train", "recipe=tiny", "topology.nproc_per_node=4096", f"train.run_dir={run_dir}")
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert "topology.nproc_per_node=4096" in out.stderr and "GB of RAM" in out.stderr
    assert not run_dir.exists()  # refused before the run directory, so before torchrun
