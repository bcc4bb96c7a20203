"""Router losses and gate metrics against values worked out by hand on a 4-token, 2-expert input."""

import math

import pytest
import torch

from runtime.config import ModelConfig
from runtime.moe import MoELayer
from runtime.moe.losses import (importance_loss, load_balancing_loss, second_place_ratio, sparsity_l1_loss,
                                z_loss)

L3 = math.log(3.0)
# logits [ln3, 0] give probs [3/4, 1/4]; tokens 0, 1, 3 prefer expert 0, token 2 prefers expert 1
X = torch.tensor([[L3, 0.0], [L3, 0.0], [0.0, L3], [L3, 0.0]])


def layer(top_k, **kw):
    cfg = ModelConfig(hidden_size=2, ffn_hidden_size=4, num_experts=2, top_k=top_k, **kw)
    m = MoELayer(cfg)
    with torch.no_grad():
        m.router.gate.weight.copy_(torch.eye(2))
    return m


def test_each_loss_by_hand():
    _, stats = layer(1)(X)
    # f = [3/4, 1/4]; P = [(3 * 3/4 + 1/4) / 4, (3 * 1/4 + 3/4) / 4] = [5/8, 3/8]; 2 * (15/32 + 3/32)
    assert stats.losses["load_balancing"].item() == pytest.approx(2 * (0.75 * 0.625 + 0.25 * 0.375))
    assert stats.losses["load_balancing"].item() == pytest.approx(1.125)
    assert stats.losses["z"].item() == pytest.approx(math.log(4.0) ** 2)  # logsumexp(ln3, 0) = ln 4
    # p / ||p||_2 = [3, 1] / sqrt(10): L1 = 4 / sqrt(10)
    assert stats.losses["sparsity"].item() == pytest.approx(4 / math.sqrt(10))
    # importance = [5/2, 3/2]: mean 2, population variance 1/4, CV^2 = 1/16
    assert stats.losses["importance"].item() == pytest.approx(1 / 16)


def test_top2_load_balancing_and_second_place():
    _, stats = layer(2)(X)
    # every token uses both experts: f = [1/2, 1/2]; 2 * (1/2 * 5/8 + 1/2 * 3/8) = 1
    assert stats.losses["load_balancing"].item() == pytest.approx(1.0)
    assert stats.metrics["second_place_ratio"].item() == pytest.approx(1 / 3)
    assert stats.metrics["gate_probability"].item() == pytest.approx(0.5)  # mean of 3/4 and 1/4
    assert second_place_ratio(torch.tensor([[0.5, 0.25], [0.8, 0.2]])).item() == pytest.approx(0.375)


def test_metrics_by_hand_with_capacity():
    m = layer(1, capacity_factor=1.0)  # capacity ceil(1 * 4 * 1 / 2) = 2: expert 0 drops token 3 (cut)
    y, stats = m(X)
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert stats.metrics["gate_entropy"].item() == pytest.approx(entropy)
    assert stats.metrics["gate_probability"].item() == pytest.approx(0.75)
    assert stats.metrics["gate_routed"].item() == pytest.approx(0.75)
    assert stats.metrics["expert_fraction"].tolist() == pytest.approx([0.75, 0.25])
    assert stats.metrics["expert_routed_fraction"].tolist() == pytest.approx([0.5, 0.25])
    assert math.isnan(stats.metrics["second_place_ratio"].item())
    assert torch.count_nonzero(y[3]) == 0


def test_aux_loss_is_the_weighted_sum():
    weights = dict(aux_loss_weight=0.1, z_loss_weight=0.2, sparsity_loss_weight=0.3, importance_loss_weight=0.4)
    _, stats = layer(1, **weights)(X)
    expected = 0.1 * 1.125 + 0.2 * math.log(4.0) ** 2 + 0.3 * 4 / math.sqrt(10) + 0.4 / 16
    assert stats.aux_loss.item() == pytest.approx(expected)
    assert stats.aux_loss.requires_grad


def test_loss_gradients_match_autograd_of_the_formulas():
    logits = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0], [1], [1], [2], [1], [0]])
    fns = [lambda l: load_balancing_loss(torch.softmax(l, -1), ids), z_loss,
           lambda l: sparsity_l1_loss(torch.softmax(l, -1)), lambda l: importance_loss(torch.softmax(l, -1))]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (logits,))


def test_balanced_router_has_unit_load_balancing_and_zero_importance():
    probs = torch.full((8, 4), 0.25)
    ids = torch.arange(8).remainder(4)[:, None]
    assert load_balancing_loss(probs, ids).item() == pytest.approx(1.0)
    assert importance_loss(probs).item() == pytest.approx(0.0)
    assert sparsity_l1_loss(probs).item() == pytest.approx(2.0)  # sqrt(E) when uniform


def plain_pooled_loss(probs_per_layer, top_k):
    """transformers' load_balancing_loss_func written out: every layer's tokens as one batch, choices counted with a
    loop, E * sum_e (choices of e / tokens) * (mean probability of e)."""
    probs = torch.cat(probs_per_layer)
    tokens, experts = probs.shape
    counts = torch.zeros(experts)
    for row in probs:
        for e in torch.topk(row, top_k).indices.tolist():
            counts[e] += 1
    return experts * sum(counts[e] / tokens * probs[:, e].mean() for e in range(experts))


def test_pooled_load_balancing_is_the_model_s_one_loss_over_all_layers():
    from runtime.model.transformer import Transformer

    cfg = ModelConfig(hidden_size=16, num_layers=3, num_heads=2, vocab_size=32, ffn_hidden_size=8, num_experts=4,
                      top_k=2, max_seq_len=16, load_balancing="pooled", aux_loss_weight=0.3, moe_layers=[0, 2])
    model = Transformer(cfg)
    probs = []
    for layer in model.moe_layers():
        layer.router.register_forward_hook(lambda _m, _i, routing: probs.append(routing.probs_TE.detach()))
    out = model(torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(0)))
    assert len(probs) == 2 and all(s.load is not None for s in out.moe_stats)
    assert out.aux_loss.item() == pytest.approx(0.3 * plain_pooled_loss(probs, 2).item(), rel=1e-6)
    switch = sum(s.losses["load_balancing"] for s in out.moe_stats)  # the per-layer losses, still reported
    assert out.aux_loss.item() != pytest.approx(0.3 * switch.item(), rel=1e-3)
    out.aux_loss.backward()
    assert model.moe_layers()[0].router.gate.weight.grad.abs().sum() > 0
