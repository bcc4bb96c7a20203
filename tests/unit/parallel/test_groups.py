"""Rank layout of runtime/parallel/groups.py (pure functions; the real groups are checked under torchrun)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from runtime.parallel.groups import all_group_ranks, build_groups, rank_layout


def test_world4_ep2_two_nodes():
    groups = all_group_ranks(4, expert_parallel=2, nproc_per_node=2)
    assert groups["ep"] == [[0, 1], [2, 3]]
    assert groups["edp"] == [[0, 2], [1, 3]]
    assert groups["dp"] == [[0, 1, 2, 3]]
    assert groups["intra_node"] == [[0, 1], [2, 3]]
    assert groups["inter_node"] == [[0, 2], [1, 3]]
    layout = rank_layout(4, 3, expert_parallel=2, nproc_per_node=2)
    assert (layout.node, layout.local_rank, layout.num_nodes) == (1, 1, 2)
    assert layout.ep_ranks == [2, 3] and layout.edp_ranks == [1, 3] and layout.inter_node_ranks == [1, 3]


@st.composite
def layouts(draw):
    npn = draw(st.integers(1, 4))
    nodes = draw(st.integers(1, 4))
    world = npn * nodes
    ep = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    return world, ep, npn


@given(layouts())
def test_every_kind_partitions_the_world(sizes):
    world, ep, npn = sizes
    for kind, groups in all_group_ranks(world, ep, npn).items():
        members = sorted(r for g in groups for r in g)
        assert members == list(range(world)), kind
    for rank in range(world):
        lay = rank_layout(world, rank, ep, npn)
        assert lay.ep_ranks == list(range(rank - rank % ep, rank - rank % ep + ep))
        assert all(r % ep == rank % ep for r in lay.edp_ranks) and len(lay.edp_ranks) == world // ep
        assert all(r // npn == rank // npn for r in lay.intra_node_ranks) and len(lay.intra_node_ranks) == npn
        assert all(r % npn == rank % npn for r in lay.inter_node_ranks) and len(lay.inter_node_ranks) == world // npn
        assert set(lay.ep_inter_node_ranks) == set(lay.ep_ranks) & set(lay.inter_node_ranks)


@pytest.mark.parametrize("world, ep, npn, message", [
    (4, 3, 2, "expert_parallel=3 must divide"),
    (4, 2, 3, "nproc_per_node=3 must divide"),
    (4, 0, 2, "must be positive"),
])
def test_bad_layouts_name_the_key(world, ep, npn, message):
    with pytest.raises(ValueError, match=message):
        all_group_ranks(world, ep, npn)


def test_single_process_needs_no_process_group():
    g = build_groups(1, 0, expert_parallel=1, nproc_per_node=1)
    assert g.ep_group is None and g.dp_group is None and g.edp_group is None
    assert (g.ep_rank, g.edp_size, g.edp_rank, g.num_nodes) == (0, 1, 0, 1)


def test_multi_process_world_needs_init():
    with pytest.raises(RuntimeError, match="initialised"):
        build_groups(2, 0, expert_parallel=2, nproc_per_node=2)
