"""Multi-process (gloo, CPU) tests of the embedding partition (the paper's "Embedding Partition in Data Parallelism"),
started with torchrun.

Two ranks here; four ranks in test_embedding_partition_gloo_w4.py (one torchrun job per file keeps each short).
"""

from __future__ import annotations

from pathlib import Path

from tests.distributed.torchrun import assert_checks_passed, torchrun

WORKER = Path(__file__).with_name("_worker_embedding.py")
EXPECTED_CHECKS = {"lookup_varlen", "lookup_empty_rank", "train_tied", "train_untied", "reshard"}


def check_world(world_size: int, tmp_path: Path) -> None:
    """Run the worker on world_size ranks and assert every rank passed every check."""
    proc = torchrun(world_size, WORKER, "--out", str(tmp_path), timeout=120)
    assert_checks_passed(proc, tmp_path, world_size, EXPECTED_CHECKS)


def test_embedding_partition_matches_replicated_2_ranks(tmp_path):
    check_world(2, tmp_path)
