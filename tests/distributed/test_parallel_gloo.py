"""Multi-process (gloo, CPU) tests of runtime/parallel, started with torchrun the way users start jobs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.torchrun import torchrun

WORKER = Path(__file__).with_name("_worker_parallel.py")

EXPECTED_CHECKS = {
    "groups_w4_ep2_npn2", "flat_ep2_subgroup", "flat_known_recv_counts", "grad_buckets_match_allreduce",
    "grad_buckets_launch_during_backward", "flat_w4_zero_rows", "flat_w4_all_empty", "flat_w4_random",
    "hier_2x2_trial0", "hier_2x2_trial1", "hier_2x2_trial2", "hier_2x2_no_zeros", "hier_2x2_all_empty", "hier_4x1_random",
    "hier_empty_shape",
}


def test_parallel_world4(tmp_path):
    proc = torchrun(4, WORKER, "--out", str(tmp_path), timeout=90)
    reports = {}
    for r in range(4):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report\n{proc.stderr[-4000:]}"
        reports[r] = json.loads(path.read_text())["checks"]
    failed = {r: {k: v["detail"] for k, v in c.items() if not v["ok"]} for r, c in reports.items()}
    assert not any(failed.values()), f"failed checks: {failed}"
    for r, c in reports.items():
        assert set(c) == EXPECTED_CHECKS, f"rank {r} ran {sorted(c)}"
    assert proc.returncode == 0, proc.stderr[-4000:]
