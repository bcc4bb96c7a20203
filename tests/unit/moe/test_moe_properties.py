"""Property-based checks (hypothesis) of dispatch/combine, capacity and the whole layer on random shapes."""

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from runtime.config import ModelConfig
from runtime.moe import LocalDispatcher, MoELayer, Routing, expert_capacity, keep_mask, reference_moe_forward


@st.composite
def routings(draw):
    t = draw(st.integers(1, 24))
    e = draw(st.integers(1, 6))
    k = draw(st.integers(1, e))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]  # distinct experts per token
    factor = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5]))
    policy = draw(st.sampled_from(["cut", "random", "routing_weight"]))
    weights = torch.rand(t, k, generator=g)
    routing = Routing(ids, weights, torch.softmax(logits, -1), logits)
    keep = keep_mask(ids, weights, e, expert_capacity(t, e, k, factor), policy, g)
    return routing, keep, expert_capacity(t, e, k, factor)


@settings(max_examples=60, deadline=None)
@given(routings(), st.integers(1, 9))
def test_dispatch_combine_roundtrip(case, d):
    routing, keep, capacity = case
    t, k = routing.expert_ids_TK.shape
    e = routing.num_experts
    x = torch.randn(t, d)
    disp = LocalDispatcher(e)
    x_RD, counts_E, meta = disp.dispatch(x, routing, keep)
    kept_E = torch.bincount(routing.expert_ids_TK[keep], minlength=e)
    assert torch.equal(counts_E, kept_E) and int(counts_E.sum()) == int(keep.sum()) == x_RD.shape[0]
    if capacity is not None:
        assert int(counts_E.max()) <= capacity
    # rows are grouped by expert, and each row is its token's input
    row_expert = torch.repeat_interleave(torch.arange(e), counts_E)
    assert torch.equal(routing.expert_ids_TK.reshape(-1)[keep.reshape(-1)].sort().values, row_expert)
    assert torch.equal(x_RD, x[meta.token_idx_R])
    # unit weights: combine(dispatch(x)) = (kept assignments of t) * x_t, i.e. identity on kept tokens
    unit = Routing(routing.expert_ids_TK, torch.ones(t, k), routing.probs_TE, routing.logits_TE)
    x_RD, _, meta = disp.dispatch(x, unit, keep)
    out = disp.combine(x_RD, meta)
    torch.testing.assert_close(out, x * keep.sum(1, keepdim=True).float())


@settings(max_examples=60, deadline=None)
@given(routings(), st.integers(1, 9))
def test_combine_gradients_equal_autograd_of_a_plain_gather(case, d):
    """The combine's hand-written backward: row gradients and router-weight gradients (0 where dropped)."""
    routing, keep, _ = case
    t, k = routing.expert_ids_TK.shape
    w_TK = routing.weights_TK.clone().requires_grad_(True)
    with_w = Routing(routing.expert_ids_TK, w_TK, routing.probs_TE, routing.logits_TE)
    x_RD, _, meta = LocalDispatcher(routing.num_experts).dispatch(torch.randn(t, d), with_w, keep)
    assume(x_RD.shape[0] > 0)
    rows_RD = torch.randn(x_RD.shape, requires_grad=True)  # stands in for the experts' outputs
    out = LocalDispatcher(routing.num_experts).combine(rows_RD, meta)
    ref = ((w_TK * keep)[..., None] * rows_RD[meta.row_of_slot_TK]).sum(1)
    g = torch.randn_like(out)
    torch.testing.assert_close(out, ref)
    for got, want in zip(torch.autograd.grad(out, (rows_RD, w_TK), g), torch.autograd.grad(ref, (rows_RD, w_TK), g)):
        torch.testing.assert_close(got, want)


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    d=st.sampled_from([4, 5, 8]),
    e=st.integers(1, 5),
    k_frac=st.floats(0, 1),
    factor=st.sampled_from([0.0, 0.5, 1.25]),
    policy=st.sampled_from(["cut", "routing_weight"]),
    kind=st.sampled_from(["gelu", "swiglu"]),
    bias=st.booleans(),
)
def test_layer_equals_reference(lead, d, e, k_frac, factor, policy, kind, bias):
    k = 1 + int(k_frac * (e - 1))
    torch.manual_seed(len(lead) * 100 + d * 10 + e)
    cfg = ModelConfig(hidden_size=d, ffn_hidden_size=8, num_experts=e, top_k=k, capacity_factor=factor,
                      drop_policy=policy, expert_type=kind, bias=bias)
    layer = MoELayer(cfg)
    x = torch.randn(*lead, d)
    y, stats = layer(x)
    assert y.shape == x.shape
    x_TD = x.reshape(-1, d)
    routing = layer.router(x_TD)
    cap = expert_capacity(x_TD.shape[0], e, k, factor)
    keep = keep_mask(routing.expert_ids_TK, routing.weights_TK, e, cap, policy)
    ref = reference_moe_forward(x_TD, routing.expert_ids_TK, routing.weights_TK, **layer.experts.weights(),
                                kind=kind, keep_TK=keep)
    torch.testing.assert_close(y.reshape(-1, d), ref, rtol=1e-5, atol=1e-5)
    routed = stats.metrics["expert_routed_fraction"].sum()
    torch.testing.assert_close(routed, stats.metrics["gate_routed"])
    if factor == 0:
        assert stats.metrics["gate_routed"].item() == 1.0
