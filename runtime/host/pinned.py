"""How torch's caching host allocator treats moesys's large pinned blocks.

The allocator rounds every pinned block up to a power of two, so that a freed block serves the next request of its
size class, and keeps freed blocks for reuse. A layer's stages or its gradients' staging in training, a layer's
pinned experts in inference, are one block each, allocated once and held for the whole run: rounding them only
wastes host memory, the tier offloading runs short of (a 1.2 GB layer of Qwen3-30B-A3B's bf16 stages would take
2 GB, its staging as much again). Above
EXACT_PINNED_ABOVE_MB a block is therefore allocated at its size and given back when freed; smaller ones (an SSD
cache slot's stage, which comes and goes with the slot) keep the allocator's reuse.
"""

from __future__ import annotations

import contextlib

import torch

EXACT_PINNED_ABOVE_MB = 1024
"""MiB: pinned blocks above this are neither rounded up nor cached by torch's host allocator."""
PINNED_KEYS = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
"""The allocator settings (PYTORCH_ALLOC_CONF) that say it."""


def exact_large_pinned_blocks() -> str:
    """Set PINNED_KEYS to EXACT_PINNED_ABOVE_MB in torch's allocator settings, beside whatever the user's
    PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF) holds; a user's own value of either key is left as it is, and
    settings torch refuses to take again at run time leave the allocator as it was (the blocks rounded, nothing
    else changed). Call before the first pinned allocation. Returns the settings in force."""
    current = torch._C._accelerator_getAllocatorSettings()
    if not any(key in current for key in PINNED_KEYS):
        ours = ",".join(f"{key}:{EXACT_PINNED_ABOVE_MB}" for key in PINNED_KEYS)
        with contextlib.suppress(RuntimeError):
            torch._C._accelerator_setAllocatorSettings(f"{current},{ours}" if current else ours)
    return torch._C._accelerator_getAllocatorSettings()
