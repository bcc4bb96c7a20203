"""The CPU activation pool (gelu and swiglu): buffers are reused across steps, gradients stay exact, and a stale
graph fails loudly."""

import pytest
import torch

from runtime.moe.activations import activation_pool
from runtime.moe.buffer_pool import BufferPool
from runtime.moe.experts import expert_ffn, reference_moe_forward


def test_take_reuses_the_smallest_fitting_buffer_and_drops_outgrown_ones():
    pool = BufferPool()
    small, view = pool.take(torch.empty(2, 3))
    assert view.shape == (2, 3) and small.numel() == 6
    pool.give(small)
    again, _ = pool.take(torch.empty(3, 2))
    assert again is small  # same size: reused
    pool.give(again)
    big, view = pool.take(torch.empty(4, 4))
    assert big is not small and view.shape == (4, 4)
    assert pool.free == []  # the outgrown buffer was dropped, not kept forever
    pool.give(big)
    reused, view = pool.take(torch.empty(2, 2))
    assert reused is big and view.shape == (2, 2)
    other, _ = pool.take(torch.empty(2, 2, dtype=torch.float64))
    assert other.dtype == torch.float64 and other is not big


def test_a_buffer_made_at_least_as_large_as_asked_serves_every_later_size():
    """The offloaded experts' gradient staging: a layer's active experts vary from step to step, so a buffer sized for
    all of them is made once and every later take fits it (pinning a new one each time cost a step's d2h)."""
    pool = BufferPool()
    first, view = pool.take(torch.empty(3, 5), at_least=8 * 5)
    assert first.numel() == 40 and view.shape == (3, 5)
    pool.give(first)
    for rows in (7, 8, 1, 8):
        buf, view = pool.take(torch.empty(rows, 5), at_least=8 * 5)
        assert buf is first and view.shape == (rows, 5)
        pool.give(buf)
    assert pool.made == 1
    pool.clear()
    assert pool.free == []


def _weights(kind="gelu", e=4, d=16, f=32):
    torch.manual_seed(0)
    w = {"w1": torch.randn(e, f, d, requires_grad=True), "w2": torch.randn(e, d, f, requires_grad=True),
         "b1": torch.randn(e, f, requires_grad=True), "b2": torch.randn(e, d, requires_grad=True)}
    if kind == "swiglu":
        w |= {"w3": torch.randn(e, f, d, requires_grad=True), "b3": torch.randn(e, f, requires_grad=True)}
    return w


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_steps_reuse_the_activation_buffer_and_match_the_plain_loop_every_step(kind):
    w = _weights(kind)
    counts = torch.tensor([5, 0, 7, 4])
    ids = torch.repeat_interleave(torch.arange(4), counts)
    for _ in range(3):
        x = torch.randn(16, 16, requires_grad=True)
        g = torch.randn(16, 16)
        y = expert_ffn(x, counts, **w, kind=kind, impl="grouped_mm")
        grads = torch.autograd.grad(y, [x, *w.values()], g)
        assert len(activation_pool.free) >= 1
        y_ref = reference_moe_forward(x, ids[:, None], torch.ones(16, 1), **w, kind=kind)
        grads_ref = torch.autograd.grad(y_ref, [x, *w.values()], g)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    before = {id(b) for b in activation_pool.free}
    expert_ffn(torch.randn(16, 16, requires_grad=True), counts, **w, kind=kind, impl="grouped_mm")
    after = {id(b) for b in activation_pool.free}
    assert after < before and len(after) == len(before) - 1  # the next forward took a pooled buffer


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_backward_through_a_graph_whose_buffer_was_taken_again_raises(kind):
    w = _weights(kind)
    counts = torch.tensor([4, 4, 4, 4])
    x = torch.randn(16, 16, requires_grad=True)
    y1 = expert_ffn(x, counts, **w, kind=kind, impl="grouped_mm")
    y1.backward(torch.ones_like(y1), retain_graph=True)  # gives the buffer back
    expert_ffn(x, counts, **w, kind=kind, impl="grouped_mm")  # takes it and overwrites it
    with pytest.raises(RuntimeError, match="modified inplace|modified by an inplace operation"):
        y1.backward(torch.ones_like(y1))


def test_no_grad_forward_uses_no_pooled_buffer():
    w = {k: v.detach() for k, v in _weights().items()}
    activation_pool.clear()
    with torch.no_grad():
        expert_ffn(torch.randn(16, 16), torch.tensor([4, 4, 4, 4]), **w, impl="grouped_mm")
    assert activation_pool.free == []
