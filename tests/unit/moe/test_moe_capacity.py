"""Capacity formula and the three drop policies on hand-built routings with known answers."""

import itertools

import pytest
import torch

from runtime.config import ModelConfig
from runtime.moe import MoELayer, expert_capacity, keep_mask, reference_moe_forward

IDS = torch.tensor([[0], [0], [1], [0], [0], [1]])
WEIGHTS = torch.tensor([[0.9], [0.6], [0.8], [0.7], [0.95], [0.5]])


def test_capacity_formula():
    assert expert_capacity(4096, 8, 2, 1.25) == 1280
    assert expert_capacity(10, 3, 1, 1.0) == 4  # ceil(3.33)
    assert expert_capacity(7, 4, 2, 0.5) == 2  # ceil(1.75)
    assert expert_capacity(100, 8, 2, 0.0) is None


def test_cut_drops_latest_tokens_per_expert():
    keep = keep_mask(IDS, WEIGHTS, 2, capacity=2, policy="cut")
    assert keep.view(-1).tolist() == [True, True, True, False, False, True]


def test_routing_weight_keeps_largest_weights():
    keep = keep_mask(IDS, WEIGHTS, 2, capacity=2, policy="routing_weight")
    assert keep.view(-1).tolist() == [True, False, True, False, True, True]


def test_cut_top2_counts_each_expert_separately():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 1]])
    keep = keep_mask(ids, torch.full((4, 2), 0.5), 3, capacity=2, policy="cut")
    # expert 0: tokens 0,1,2 -> drop token 2; expert 1: tokens 0,2,3 -> drop token 3; expert 2: tokens 1,3
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]


def test_random_keeps_capacity_and_depends_only_on_seed():
    seen = set()
    for seed in range(40):
        keep = keep_mask(IDS, WEIGHTS, 2, 2, "random", torch.Generator().manual_seed(seed)).view(-1)
        again = keep_mask(IDS, WEIGHTS, 2, 2, "random", torch.Generator().manual_seed(seed)).view(-1)
        assert torch.equal(keep, again)
        assert keep[[2, 5]].all()  # expert 1 is not over capacity
        kept0 = tuple(t for t in (0, 1, 3, 4) if keep[t])
        assert len(kept0) == 2
        seen.add(kept0)
    assert seen == set(itertools.combinations((0, 1, 3, 4), 2))  # every subset is reachable


@pytest.mark.parametrize("policy", ["cut", "random", "routing_weight"])
def test_under_capacity_and_dropless_keep_everything(policy):
    assert keep_mask(IDS, WEIGHTS, 2, capacity=4, policy=policy).all()
    assert keep_mask(IDS, WEIGHTS, 2, capacity=None, policy=policy).all()


def test_unknown_policy_names_the_key():
    with pytest.raises(ValueError, match="model.drop_policy"):
        keep_mask(IDS, WEIGHTS, 2, capacity=1, policy="oldest")


@pytest.mark.parametrize("policy", ["cut", "routing_weight"])
def test_layer_drops_as_policy_says(policy):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=8, ffn_hidden_size=16, num_experts=2, top_k=1, capacity_factor=1.0,
                      drop_policy=policy, normalize_top_k=False)
    layer = MoELayer(cfg)
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.tensor([[1.0] * 8, [0.0] * 8]))
    x = (0.5 + 0.5 * torch.rand(6, 8)) * torch.tensor([3.0, 1.0, -2.0, 2.0, 4.0, -1.0])[:, None]
    # logit of expert 0 = sum(x) (4..8 x scale), of expert 1 = 0: tokens 0,1,3,4 pick expert 0 (capacity
    # ceil(1 * 6 * 1 / 2) = 3); cut drops the latest (token 4), routing_weight the smallest weight (token 1)
    y, stats = layer(x)
    dropped = 4 if policy == "cut" else 1
    assert torch.count_nonzero(y[dropped]) == 0
    assert all(torch.count_nonzero(y[t]) > 0 for t in range(6) if t != dropped)
    routing = layer.router(x)
    keep = torch.ones(6, 1, dtype=torch.bool)
    keep[dropped] = False
    ref = reference_moe_forward(x, routing.expert_ids_TK, routing.weights_TK, **layer.experts.weights(),
                                kind="gelu", keep_TK=keep)
    torch.testing.assert_close(y, ref)
    assert stats.metrics["gate_routed"].item() == pytest.approx(5 / 6)
    assert stats.metrics["expert_routed_fraction"].tolist() == pytest.approx([3 / 6, 2 / 6])
    assert stats.metrics["expert_fraction"].tolist() == pytest.approx([4 / 6, 2 / 6])
