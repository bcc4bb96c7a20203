"""Single-process parts of runtime/parallel/alltoall.py: chunk reordering, world-of-one short-circuit, checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from runtime.parallel.alltoall import (all_to_all_rows, chunk_transpose_index, hierarchical_all_to_all_rows,
                                       make_all_to_all)
from runtime.parallel.groups import build_groups


@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_chunk_transpose_index_matches_python_reference(a, b, data):
    counts = data.draw(st.lists(st.integers(0, 3), min_size=a * b, max_size=a * b))
    counts_AB = torch.tensor(counts).view(a, b)
    rows, start = {}, 0
    for i in range(a):
        for j in range(b):
            rows[i, j] = list(range(start, start + counts[i * b + j]))
            start += counts[i * b + j]
    want = [r for j in range(b) for i in range(a) for r in rows[i, j]]
    assert chunk_transpose_index(counts_AB).tolist() == want


def test_world_of_one_is_identity_with_gradient():
    g = build_groups(1, 0, expert_parallel=1, nproc_per_node=1)
    x = torch.randn(5, 3, requires_grad=True)
    for fn in (make_all_to_all("flat", g), make_all_to_all("hierarchical", g)):
        y, recv = fn(x, torch.tensor([5]))
        assert torch.equal(y, x) and recv == [5]
    y, recv = hierarchical_all_to_all_rows(torch.zeros(0, 3), [0], g)
    assert y.shape == (0, 3) and recv == [0]


def test_counts_are_checked():
    x = torch.randn(4, 2)
    with pytest.raises(ValueError, match="sum to the 4 rows"):
        all_to_all_rows(x, [3])
    with pytest.raises(ValueError, match="2 entries for a group of 1"):
        all_to_all_rows(x, [2, 2])


def test_unknown_kind_lists_the_choices():
    g = build_groups(1, 0, expert_parallel=1, nproc_per_node=1)
    with pytest.raises(ValueError, match="flat, hierarchical"):
        make_all_to_all("ring", g)
