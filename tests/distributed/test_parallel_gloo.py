"""Multi-process (gloo, CPU) tests of runtime/parallel, started with torchrun the way users start jobs."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.torchrun import assert_checks_passed, torchrun

WORKER = Path(__file__).with_name("_worker_parallel.py")

EXPECTED_CHECKS = {
    "groups_w4_ep2_npn2", "flat_ep2_subgroup", "flat_known_recv_counts", "grad_buckets_match_allreduce",
    "grad_buckets_launch_during_backward", "flat_w4_zero_rows", "flat_w4_all_empty", "flat_w4_random",
    "hier_2x2_trial0", "hier_2x2_trial1", "hier_2x2_trial2", "hier_2x2_no_zeros", "hier_2x2_all_empty", "hier_4x1_random",
    "hier_empty_shape",
}


def test_parallel_world4(tmp_path):
    proc = torchrun(4, WORKER, "--out", str(tmp_path), timeout=90)
    assert_checks_passed(proc, tmp_path, 4, EXPECTED_CHECKS)
