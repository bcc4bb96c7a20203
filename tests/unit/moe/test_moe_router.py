"""Router: Mixtral weight semantics, top-k for any k, and the training-only gating utilities."""

import pytest
import torch

from runtime.config import ModelConfig
from runtime.moe import Router
from runtime.moe.router import expert_counts, select_top_k


def router(**kw):
    torch.manual_seed(0)
    return Router(ModelConfig(hidden_size=8, num_experts=6, **kw))


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_top_k_weights_are_renormalised_softmax(k):
    r = router(top_k=k).eval()
    x = torch.randn(10, 8)
    out = r(x)
    probs = torch.softmax(x @ r.gate.weight.t(), dim=-1)
    top_w, top_i = probs.topk(k, dim=-1)
    assert torch.equal(out.expert_ids_TK, top_i)
    torch.testing.assert_close(out.weights_TK, top_w / top_w.sum(-1, keepdim=True))
    torch.testing.assert_close(out.probs_TE, probs)
    assert out.weights_TK.sum(-1).allclose(torch.ones(10))


def test_without_normalisation_weights_are_raw_probs():
    r = router(top_k=2, normalize_top_k=False).eval()
    out = r(torch.randn(4, 8))
    torch.testing.assert_close(out.weights_TK, out.probs_TE.gather(1, out.expert_ids_TK))


def test_gating_noise_only_while_training():
    r = router(top_k=2, router_jitter=0.5, router_input_dropout=0.5, router_gumbel=True)
    x = torch.randn(64, 8)
    r.eval()
    a, b = r(x), r(x)
    assert torch.equal(a.logits_TE, b.logits_TE) and torch.equal(a.expert_ids_TK, b.expert_ids_TK)
    r.train()
    c = r(x, torch.Generator().manual_seed(1))
    d = r(x, torch.Generator().manual_seed(1))
    assert torch.equal(c.expert_ids_TK, d.expert_ids_TK) and torch.equal(c.logits_TE, d.logits_TE)
    assert not torch.equal(c.logits_TE, a.logits_TE)


def test_jitter_is_multiplicative_within_eps():
    r = router(top_k=1, router_jitter=0.1).train()
    x = torch.randn(200, 8)
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(6, 8))
    scale = r(x, torch.Generator().manual_seed(0)).logits_TE / x[:, :6]
    assert scale.min() >= 0.9 - 1e-6 and scale.max() <= 1.1 + 1e-6 and scale.std() > 0.03


def test_gumbel_keeps_first_choice_and_samples_the_rest_by_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20000, 4)
    ids = select_top_k(logits, 2, gumbel=True, generator=torch.Generator().manual_seed(0))
    assert (ids[:, 0] == 0).all() and (ids[:, 1] != 0).all()
    freq = torch.bincount(ids[:, 1], minlength=4)[1:].float() / ids.shape[0]
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.02, rtol=0)


def test_gumbel_does_not_change_weights_formula():
    r = router(top_k=2, router_gumbel=True).train()
    out = r(torch.randn(32, 8), torch.Generator().manual_seed(3))
    w = out.probs_TE.gather(1, out.expert_ids_TK)
    torch.testing.assert_close(out.weights_TK, w / w.sum(-1, keepdim=True))
    assert (out.expert_ids_TK[:, 0] == out.logits_TE.argmax(-1)).all()


def test_expert_counts_equal_bincount_without_reading_the_ids_back():
    """The plain reference is torch.bincount; the scatter-add gives its counts at a size fixed in advance (an id
    absent from the tail still has its zero), so nothing waits for the largest id on a GPU."""
    ids = torch.randint(0, 5, (7, 2), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_counts(ids, 8), torch.bincount(ids.reshape(-1), minlength=8))
    assert expert_counts(ids[:0], 3).tolist() == [0, 0, 0]
