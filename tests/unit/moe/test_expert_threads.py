"""Expert products spread over the CPU's threads: each expert's product and both of its gradients equal the plain
per-expert product's, whatever the experts' row counts (none included), and auto picks them only where it should."""

import multiprocessing

import pytest
import torch

from runtime.moe.expert_threads import MIN_EXPERTS_PER_THREAD, ExpertLinear, expert_threads, row_bounds
from runtime.moe.experts import resolve_impl


def per_expert(x_RK, w_eNK, counts):
    return torch.cat([x @ w.t() for x, w in zip(x_RK.split(counts), w_eNK)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_products_and_gradients_equal_the_per_expert_products(dtype, threads):
    torch.manual_seed(0)
    counts = [3, 0, 7, 1, 0, 5, 2, 9, 0, 4]
    x = torch.randn(sum(counts), 24, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), 40, 24, dtype=dtype, requires_grad=True)
    y = ExpertLinear.apply(x, w, row_bounds(counts), threads)
    y.sum().backward()  # an expanded gradient
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # each product on one thread, as a worker runs it
    try:
        ref = per_expert(x, w, counts)
        ref.sum().backward()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y, ref)  # the plain product's numbers, bit for bit
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(gx, x.grad, **tol)
    torch.testing.assert_close(gw, w.grad, **tol)
    assert torch.count_nonzero(gw[[1, 4, 8]]) == 0 and gw.is_contiguous()


def test_frozen_weights_get_no_gradient_and_frozen_inputs_none():
    counts = [2, 3]
    x = torch.randn(5, 16)
    w = torch.randn(2, 8, 16, requires_grad=True)
    ExpertLinear.apply(x, w, row_bounds(counts), 2).square().sum().backward()
    assert x.grad is None and w.grad is not None
    x.requires_grad_(True)
    w.requires_grad_(False)
    ExpertLinear.apply(x, w, row_bounds(counts), 2).square().sum().backward()
    assert x.grad is not None


def test_auto_spreads_experts_over_threads_only_for_many_experts_of_enough_work():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        qwen3 = torch.empty(1).expand(1024 * 8, 2048), torch.empty(1).expand(128, 768, 2048)
        assert resolve_impl("auto", *qwen3) == "expert_threads"
        mixtral_like = torch.empty(1).expand(4096 * 2, 512), torch.empty(1).expand(8, 2048, 512)
        assert resolve_impl("auto", *mixtral_like) == "grouped_mm"  # 4 experts a thread
        tiny = torch.empty(1).expand(512 * 8, 128), torch.empty(1).expand(128, 64, 128)
        assert resolve_impl("auto", *tiny) == "grouped_mm"  # a product is microseconds: the C++ loop runs them
        assert expert_threads(qwen3[0], 2 * MIN_EXPERTS_PER_THREAD - 1, 2048, 768) == 0
        torch.set_num_threads(1)
        assert resolve_impl("auto", *qwen3) == "grouped_mm"
    finally:
        torch.set_num_threads(before)


def _in_child(queue) -> None:
    counts = [4, 4, 4]
    x, w = torch.randn(12, 16), torch.randn(3, 8, 16)
    queue.put(bool(torch.equal(ExpertLinear.apply(x, w, row_bounds(counts), 2), per_expert(x, w, counts))))


def test_a_forked_child_gets_its_own_workers():
    counts = [4, 4]
    ExpertLinear.apply(torch.randn(8, 16), torch.randn(2, 8, 16), row_bounds(counts), 2)  # the parent's pool exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue,))
    child.start()
    assert queue.get(timeout=120) is True  # the fork's copy of the pool has no threads: a new one must be made
    child.join()
    assert child.exitcode == 0


def test_weights_that_are_rows_of_a_wider_block_as_offloaded_slots_lie():
    """An offloaded layer's weights are views of one [e, P] block of slots (each expert's tensors side by side)."""
    counts = [5, 0, 3]
    layout = (8 * 16, 16 * 8)  # w1 [8, 16] then w2 [16, 8] in each row
    block = torch.randn(3, sum(layout), requires_grad=False)
    w = block[:, :layout[0]].view(3, 8, 16).detach().requires_grad_(True)
    x = torch.randn(8, 16, requires_grad=True)
    y = ExpertLinear.apply(x, w, row_bounds(counts), 2)
    (y * torch.arange(8.0)[:, None]).sum().backward()
    dense = w.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    ref = per_expert(x2, dense, counts)
    (ref * torch.arange(8.0)[:, None]).sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, dense.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
