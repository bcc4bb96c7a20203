"""MoELayer against the plain per-expert loop: outputs and gradients, zero-token experts, precision."""

import pytest
import torch

from runtime.config import ModelConfig
from runtime.moe import MoELayer, expert_parameters, is_expert_param, reference_moe_forward


def make_layer(expert_type="gelu", bias=True, hidden=16, ffn=32, experts=4, top_k=2, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k,
                      expert_type=expert_type, bias=bias, **kw)
    return MoELayer(cfg)


def reference(layer, x):
    """Independent routing (softmax -> top-k -> renormalise) and the per-expert loop."""
    x_TD = x.reshape(-1, x.shape[-1])
    probs_TE = torch.softmax(x_TD.float() @ layer.router.gate.weight.float().t(), dim=-1)
    top_w, top_i = probs_TE.topk(layer.cfg.top_k, dim=-1)
    if layer.cfg.normalize_top_k:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    y = reference_moe_forward(x_TD, top_i, top_w, **layer.experts.weights(), kind=layer.cfg.expert_type)
    return y.view(x.shape)


def grads(layer, x, fn):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = fn(layer, x)
    torch.manual_seed(1)
    (y * torch.randn_like(y)).sum().backward()
    named = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return y.detach(), x.grad, named


def matches_reference(layer, x) -> dict:
    """The layer's output and gradients (input, every parameter) equal the reference loop's; its parameter
    gradients by name."""
    y, gx, gp = grads(layer, x, lambda m, v: m(v)[0])
    y_ref, gx_ref, gp_ref = grads(layer, x, reference)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    assert set(gp) == set(gp_ref)
    for name in gp:
        torch.testing.assert_close(gp[name], gp_ref[name], rtol=1e-5, atol=1e-5, msg=name)
    return gp


@pytest.mark.parametrize("impl", ["auto", "expert_threads", "bmm", "loop"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("expert_type", ["gelu", "swiglu"])
def test_dropless_top2_matches_reference_loop(expert_type, bias, impl):
    layer = make_layer(expert_type, bias)
    layer.experts.impl = impl
    gp = matches_reference(layer, torch.randn(3, 7, 16))
    assert len(gp) == (3 if expert_type == "gelu" else 4) + (0 if not bias else 2 if expert_type == "gelu" else 3)


@pytest.mark.parametrize("impl", ["auto", "grouped_mm", "expert_threads", "bmm", "loop"])
def test_fine_grained_top8_of_128_matches_reference_loop(impl):
    """Qwen3-MoE's regime at tiny dims: 128 experts, top-8, normalised top-k weights, no bias (some experts get no
    rows at 40 tokens)."""
    layer = make_layer("swiglu", False, hidden=32, ffn=16, experts=128, top_k=8, normalize_top_k=True)
    layer.experts.impl = impl
    gp = matches_reference(layer, torch.randn(5, 8, 32))
    assert set(gp) == {"router.gate.weight", "experts.w1", "experts.w2", "experts.w3"}
    idle = torch.count_nonzero(gp["experts.w1"].flatten(1), dim=1) == 0
    assert 0 < int(idle.sum()) < 128  # idle experts' gradients are zeros, the others' are not


def test_grouped_mm_path_is_used_for_aligned_shapes():
    from runtime.moe.grouped_mm_op import grouped_mm_ok
    assert grouped_mm_ok(torch.zeros(2, 16), torch.zeros(4, 32, 16))
    assert not grouped_mm_ok(torch.zeros(2, 6), torch.zeros(4, 32, 6))


def test_unaligned_hidden_falls_back_and_matches():
    layer = make_layer("swiglu", True, hidden=6, ffn=10, experts=3, top_k=2)
    x = torch.randn(11, 6)
    y, gx, gp = grads(layer, x, lambda m, v: m(v)[0])
    y_ref, gx_ref, gp_ref = grads(layer, x, reference)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for name in gp:
        torch.testing.assert_close(gp[name], gp_ref[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("impl", ["auto", "bmm"])
def test_unused_experts_get_zero_grad(impl):
    layer = make_layer("swiglu", True, experts=5, top_k=2)
    layer.experts.impl = impl
    with torch.no_grad():  # x > 0, so experts 2..4 (negative gate rows) never win
        layer.router.gate.weight.copy_(torch.tensor([1.0, 0.5, -1.0, -2.0, -3.0])[:, None].expand(5, 16))
    x = torch.rand(9, 16) + 0.1
    y, gx, gp = grads(layer, x, lambda m, v: m(v)[0])
    y_ref, _, gp_ref = grads(layer, x, reference)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for name, g in gp.items():
        if name.startswith("experts."):
            assert torch.count_nonzero(g[2:]) == 0, name
            assert torch.count_nonzero(g[:2]) > 0, name
    _, stats = layer(x)
    assert stats.metrics["expert_fraction"].tolist() == [0.5, 0.5, 0.0, 0.0, 0.0]


def test_router_fp32_under_bf16():
    layer = make_layer("gelu", True).to(torch.bfloat16)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    routing = layer.router(x)
    assert routing.logits_TE.dtype == routing.probs_TE.dtype == routing.weights_TK.dtype == torch.float32
    expected = x.float() @ layer.router.gate.weight.float().t()
    torch.testing.assert_close(routing.logits_TE, expected, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.router(x.float()).logits_TE.dtype == torch.float32
    y, stats = layer(x)
    assert y.dtype == torch.bfloat16 and stats.aux_loss.dtype == torch.float32
    torch.testing.assert_close(y.float(), reference(layer, x).float(), rtol=0.05, atol=0.05)


def test_aux_loss_is_differentiable_and_weighted():
    layer = make_layer(aux_loss_weight=0.5, z_loss_weight=0.25)
    x = torch.randn(8, 16)
    _, stats = layer(x)
    expected = 0.5 * stats.losses["load_balancing"] + 0.25 * stats.losses["z"]
    torch.testing.assert_close(stats.aux_loss.detach(), expected)
    stats.aux_loss.backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0
    assert all(not v.requires_grad for v in list(stats.losses.values()) + list(stats.metrics.values()))


def test_expert_parameters_finds_exactly_the_experts():
    layer = make_layer("swiglu", True)
    model = torch.nn.ModuleDict({"moe": layer, "other": torch.nn.Linear(2, 2)})
    names = sorted(n for n, _ in expert_parameters(model))
    assert names == sorted(f"moe.experts.{n}" for n in ("w1", "w2", "w3", "b1", "b2", "b3"))
    assert [n for n, _ in model.named_parameters() if is_expert_param(n)] == [
        n for n, _ in model.named_parameters() if n in names]
    shapes = {n.split(".")[-1]: tuple(p.shape) for n, p in expert_parameters(model)}
    assert shapes == {"w1": (4, 32, 16), "w2": (4, 16, 32), "w3": (4, 32, 16), "b1": (4, 32), "b2": (4, 16),
                      "b3": (4, 32)}


def test_local_experts_without_dispatcher_is_rejected():
    with pytest.raises(ValueError, match="expert-parallel"):
        MoELayer(ModelConfig(hidden_size=8, num_experts=4), num_local_experts=2)


@pytest.mark.parametrize("policy", ["cut", "routing_weight"])
def test_gradients_with_drops_match_reference(policy):
    from runtime.moe import expert_capacity, keep_mask
    layer = make_layer("swiglu", True, capacity_factor=0.5, drop_policy=policy)
    x = torch.randn(13, 16)

    def ref_with_drops(m, v):
        routing = m.router(v)
        cap = expert_capacity(v.shape[0], 4, 2, 0.5)
        keep = keep_mask(routing.expert_ids_TK, routing.weights_TK, 4, cap, policy)
        assert not keep.all()
        return reference_moe_forward(v, routing.expert_ids_TK, routing.weights_TK, **m.experts.weights(),
                                     kind="swiglu", keep_TK=keep)

    y, gx, gp = grads(layer, x, lambda m, v: m(v)[0])
    y_ref, gx_ref, gp_ref = grads(layer, x, ref_with_drops)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    for name in gp:
        torch.testing.assert_close(gp[name], gp_ref[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("expert_type", ["gelu", "swiglu"])
def test_decode_gathers_the_routed_experts_and_matches_the_reference(expert_type, bias):
    """MoELayer.decode (routed experts' weights gathered by index, no sort) equals the per-expert loop, for [B, 1]
    decode tokens and for a few tokens of any leading shape."""
    layer = make_layer(expert_type, bias).eval()
    for shape in ((4, 1, 16), (2, 3, 16)):
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(layer.decode(x), reference(layer, x), rtol=1e-5, atol=1e-5)


def test_decode_with_a_capacity_that_could_drop_is_forwards():
    """Capacity 1 per expert for 8 tokens: which assignments are dropped depends on the sort, so decode is forward
    (the gather has no notion of a drop); with one token nothing can be dropped and the gather runs."""
    layer = make_layer("swiglu", False, experts=4, capacity_factor=0.5).eval()
    x = torch.randn(8, 1, 16)
    with torch.no_grad():
        dropped = layer(x)[0]
        assert not torch.allclose(dropped, reference(layer, x), atol=1e-3)  # drops happened
        torch.testing.assert_close(layer.decode(x), dropped)
        one = x[:1]
        torch.testing.assert_close(layer.decode(one), reference(layer, one), rtol=1e-5, atol=1e-5)
