"""Grouped expert products on the CPU with the intra-op threads spread over experts: each of n workers (one intra-op
thread each) takes the next expert and runs its whole product, where torch._grouped_mm splits every expert's product
over all n threads. Many small products (128 experts of 768 at a few dozen rows each, Qwen3-MoE's layer) then pay one
OpenMP fork and barrier per expert, and on a shared CPU a barrier waits for a descheduled thread far longer than the
product takes; here the workers meet once per projection.

Legend: R routed rows grouped by expert, K a product's input dim, N its output dim, e local experts.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

MIN_EXPERTS_PER_THREAD = 8
"""Fewer experts than this per thread leave the workers unevenly loaded at the end of a projection: the intra-op
threads split each expert's product then (torch._grouped_mm)."""
MIN_EXPERT_FLOPS = 1 << 24
"""A projection's mean floating-point operations per expert below which the per-expert Python call (microseconds)
is not small beside the product; torch._grouped_mm's loop in C++ runs those."""


def expert_threads(x_RK: Tensor, num_experts: int, in_dim: int, out_dim: int) -> int:
    """How many workers to spread `num_experts` products of rows x_RK by [out_dim, in_dim] weights over: the intra-op
    threads on the CPU when each gets enough experts of enough work, else 0 (use torch._grouped_mm)."""
    threads = torch.get_num_threads()
    if x_RK.device.type != "cpu" or threads < 2 or torch.compiler.is_compiling():
        return 0
    if num_experts < MIN_EXPERTS_PER_THREAD * threads:
        return 0
    mean_flops = 2 * x_RK.shape[0] / num_experts * in_dim * out_dim
    return threads if mean_flops >= MIN_EXPERT_FLOPS else 0


class _Workers:
    """One pool of single-threaded workers per process (made again after a fork, whose child has no threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool, self._size = None, 0

    def pool(self, size: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._size != size:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(size, thread_name_prefix="moesys-experts",
                                                initializer=lambda: torch.set_num_threads(1))
                self._size = size
            return self._pool


_workers = _Workers()


def for_each_expert(fn: Callable[[int], None], experts: list[int], threads: int) -> None:
    """fn(e) for every expert in `experts`, in that order of start, by `threads` workers that each take the next one
    as they finish one (so a worker the OS sets aside holds up no other), without autograd."""
    lock, order = threading.Lock(), iter(experts)

    def take() -> int | None:
        with lock:
            return next(order, None)

    def work() -> None:
        with torch.no_grad():
            while (e := take()) is not None:
                fn(e)

    for future in [_workers.pool(threads).submit(work) for _ in range(threads)]:
        future.result()


def _largest_first(bounds: list[tuple[int, int]]) -> list[int]:
    """Experts by falling row count: the last products to start are the shortest, so the workers end together."""
    return sorted(range(len(bounds)), key=lambda e: bounds[e][0] - bounds[e][1])


class ExpertLinear(torch.autograd.Function):
    """y_RN[rows of e] = x_RK[rows of e] @ w_eNK[e].T for every local expert e (nn.Linear's weight layout), each
    expert's product (and in backward both of its gradients) on one worker. `bounds[e]` = (first row, end row)."""

    @staticmethod
    def forward(ctx, x_RK: Tensor, w_eNK: Tensor, bounds: list[tuple[int, int]], threads: int) -> Tensor:
        y_RN = x_RK.new_empty(x_RK.shape[0], w_eNK.shape[1])

        def one(e: int) -> None:
            lo, hi = bounds[e]
            torch.mm(x_RK[lo:hi], w_eNK[e].t(), out=y_RN[lo:hi])

        for_each_expert(one, [e for e in _largest_first(bounds) if bounds[e][1] > bounds[e][0]], threads)
        ctx.save_for_backward(x_RK, w_eNK)
        ctx.bounds, ctx.threads = bounds, threads
        return y_RN

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RN: Tensor):
        x_RK, w_eNK = ctx.saved_tensors
        bounds = ctx.bounds
        grad_RN = grad_RN.contiguous()  # an expanded gradient (from y.sum()) has zero strides
        grad_x = x_RK.new_empty(x_RK.shape) if ctx.needs_input_grad[0] else None
        grad_w = w_eNK.new_empty(w_eNK.shape) if ctx.needs_input_grad[1] else None

        def one(e: int) -> None:
            lo, hi = bounds[e]
            if grad_x is not None and hi > lo:
                torch.mm(grad_RN[lo:hi], w_eNK[e], out=grad_x[lo:hi])
            if grad_w is not None:  # [N, K] as the weight lies: no transpose to copy afterwards
                torch.mm(grad_RN[lo:hi].t(), x_RK[lo:hi], out=grad_w[e]) if hi > lo else grad_w[e].zero_()

        for_each_expert(one, _largest_first(bounds), ctx.threads)
        return grad_x, grad_w, None, None


def row_bounds(counts: list[int]) -> list[tuple[int, int]]:
    """(first row, end row) of each expert's rows, from its row count."""
    out, at = [], 0
    for count in counts:
        out.append((at, at + count))
        at += count
    return out
