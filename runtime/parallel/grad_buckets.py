"""Gradient buckets: average gradients in fixed-size flat buckets, launched in a fixed order (SE-MoE "Fusion
Communication").

Buckets fill in reverse registration order (as backward produces gradients, like DDP); a bucket's all-reduce
starts as soon as its last gradient arrives and every earlier bucket has started, so all ranks issue the
collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from runtime.parallel.groups import ProcessGroup, group_size


def assign_buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices into `params`, grouped into buckets: reverse order, <= bucket_bytes each (or one oversized param).

    A new bucket also starts where dtype or device changes, since a bucket is one flat buffer.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive (got {bucket_bytes})")
    buckets: list[list[int]] = []
    used = 0
    key = None
    for i in reversed(range(len(params))):
        p = params[i]
        size = p.numel() * p.element_size()
        if not buckets or (p.dtype, p.device) != key or used + size > bucket_bytes:
            buckets.append([])
            used, key = 0, (p.dtype, p.device)
        buckets[-1].append(i)
        used += size
    return buckets


class _Bucket:
    """One flat buffer holding the gradients of a few parameters."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.ready: set[int] = set()
        self.work: dist.Work | None = None
        self.launched = False

    def view(self, k: int) -> torch.Tensor:
        p = self.params[k]
        return self.buffer[self.offsets[k]:self.offsets[k] + p.numel()].view_as(p)


class GradBucketReducer:
    """Averages the gradients of `params` over `group` with bucketed, overlapped all-reduces.

    Build once; call finish() after every backward (before the optimizer step). Parameters that got no gradient
    this step count as zero, so ranks that skip a parameter never hang. A group of one process is a no-op.
    """

    def __init__(self, params: Iterable[torch.Tensor], group: ProcessGroup = None,
                 bucket_bytes: int = 25 * 2**20):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = group_size(group)
        self.bucket_index = assign_buckets(self.params, bucket_bytes)
        self.buckets = [_Bucket([self.params[i] for i in idx]) for idx in self.bucket_index]
        self._where = {}
        for b, bucket in enumerate(self.buckets):
            for k, p in enumerate(bucket.params):
                self._where[id(p)] = (b, k)
        self._next = 0
        self._sync = True
        self._handles = []
        if self.world > 1:
            self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        b, k = self._where[id(p)]
        bucket = self.buckets[b]
        if bucket.launched:
            raise RuntimeError("a gradient arrived for a bucket already reduced this step; call finish() after "
                               "each synced backward and run accumulation backwards inside no_sync()")
        assert p.grad is not None, "the hook runs once the gradient is accumulated"
        bucket.view(k).copy_(p.grad)
        bucket.ready.add(k)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            bucket.launched = True
            self._next += 1

    def finish(self) -> None:
        """Reduce what is left (missing gradients as zeros), wait, and write the averages into p.grad."""
        if self.world == 1:
            return
        for bucket in self.buckets[self._next:]:
            for k in range(len(bucket.params)):
                if k not in bucket.ready:
                    bucket.view(k).zero_()
                    bucket.ready.add(k)
        self._launch_ready()
        for bucket in self.buckets:
            assert bucket.work is not None, "every bucket was launched above"
            bucket.work.wait()
            bucket.buffer.div_(self.world)
            for k, p in enumerate(bucket.params):
                if p.grad is None:
                    p.grad = bucket.view(k).clone()
                else:
                    p.grad.copy_(bucket.view(k))
            bucket.ready.clear()
            bucket.work, bucket.launched = None, False
        self._next = 0

    wait = finish

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate into p.grad locally; the next backward outside reduces the sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
