"""The embedding partition on four gloo ranks (see test_embedding_partition_gloo.py for two)."""

from __future__ import annotations

import pytest

from tests.distributed.test_embedding_partition_gloo import check_world


@pytest.mark.extended
def test_embedding_partition_matches_replicated_4_ranks(tmp_path):
    check_world(4, tmp_path)
