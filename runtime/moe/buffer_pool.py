"""Reused flat buffers for large activations on CPU.

glibc serves blocks over 32 MB with mmap and unmaps them on free, so an activation of that size allocated fresh
every step pays a page fault per 4 KB page on first write and an munmap at the end (benchmarks/cpu-kernels_*.md).
CUDA's caching allocator already reuses memory; this does the same for the few CPU tensors where it matters. A
buffer is taken in forward and given back when its last reader is done (in backward), so the pool never holds more
than the most buffers that were in use at once. Pinned host buffers (the gradients of offloaded experts coming
home) are pooled the same way: pinning memory costs far more than the copy into it.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor


class BufferPool:
    """Free flat buffers, taken by size and given back when their contents are no longer needed."""

    def __init__(self, pinned: bool = False) -> None:
        """pinned: buffers in page-locked host memory (for copies from a GPU), whatever device `like` is on."""
        self.free: list[Tensor] = []
        self.pinned = pinned
        self.made = 0
        """Buffers allocated so far (the rest of the takes were served from the pool)."""
        self._lock = threading.Lock()  # taken on one thread, given back on another

    def take(self, like: Tensor, at_least: int = 0) -> tuple[Tensor, Tensor]:
        """(buffer, view shaped like `like`) from a free buffer at least as large, or a new one of at least
        `at_least` elements (a size every later take of its kind fits: sizes that vary from step to step then
        never make a new buffer). When none fits, the largest smaller buffer is dropped, so a pool that sees shapes
        grow does not keep the old sizes."""
        n = like.numel()
        device = torch.device("cpu") if self.pinned else like.device
        with self._lock:
            same = [i for i, b in enumerate(self.free) if b.dtype == like.dtype and b.device == device]
            fits = [i for i in same if self.free[i].numel() >= n]
            buf = self.free.pop(min(fits, key=lambda i: self.free[i].numel())) if fits else None
            if buf is None and same:
                self.free.pop(max(same, key=lambda i: self.free[i].numel()))
        if buf is None:
            buf = torch.empty(max(n, at_least), dtype=like.dtype, device=device, pin_memory=self.pinned)
            self.made += 1
        return buf, buf[:n].view(like.shape)

    def give(self, buf: Tensor) -> None:
        with self._lock:
            self.free.append(buf)

    def clear(self) -> None:
        """Drop the free buffers (their memory goes back to the allocator); buffers in use are not the pool's."""
        with self._lock:
            self.free.clear()
