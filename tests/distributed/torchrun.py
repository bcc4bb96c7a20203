"""Start a test worker the way users start jobs: torchrun, gloo, CPU, one OS process per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def assert_checks_passed(proc: subprocess.CompletedProcess, out: Path, world_size: int, expected: set[str]) -> None:
    """Every rank wrote out/rank{r}.json with {"checks": {name: {"ok", "detail"}}}, ran `expected`, and passed."""
    reports = {}
    for r in range(world_size):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report\n{proc.stderr[-4000:]}"
        reports[r] = json.loads(path.read_text())["checks"]
    failed = {r: {k: v["detail"] for k, v in c.items() if not v["ok"]} for r, c in reports.items()}
    assert not any(failed.values()), f"failed checks: {failed}"
    for r, c in reports.items():
        assert set(c) == expected, f"rank {r} ran {sorted(c)}"
    assert proc.returncode == 0, proc.stderr[-4000:]
