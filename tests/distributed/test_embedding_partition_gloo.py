"""Multi-process (gloo, CPU) tests of the embedding partition (seed 004 section 4.3), started with torchrun.

Two ranks here; four ranks in test_embedding_partition_gloo_w4.py (one torchrun job per file keeps each short).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker_embedding.py")
EXPECTED_CHECKS = {"lookup_varlen", "lookup_empty_rank", "train_tied", "train_untied", "reshard"}


def run_torchrun(nproc: int, out: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(WORKER), "--out", str(out)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def check_world(world_size: int, tmp_path: Path) -> None:
    """Run the worker on world_size ranks and assert every rank passed every check."""
    proc = run_torchrun(world_size, tmp_path)
    reports = {}
    for r in range(world_size):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report\n{proc.stderr[-4000:]}"
        reports[r] = json.loads(path.read_text())["checks"]
    failed = {r: {k: v["detail"] for k, v in c.items() if not v["ok"]} for r, c in reports.items()}
    assert not any(failed.values()), f"failed checks: {failed}"
    for r, c in reports.items():
        assert set(c) == EXPECTED_CHECKS, f"rank {r} ran {sorted(c)}"
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_embedding_partition_matches_replicated_2_ranks(tmp_path):
    check_world(2, tmp_path)
