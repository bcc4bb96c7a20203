"""The bandwidth bound of a decode token: a token is no faster than the bytes it reads can be read, so bound = the
tiers' read times summed, each tier's bytes over its measured bandwidth.

The bytes are those a token reads (the dense weights, its routed experts' weights, the KV cache at the context),
and the bandwidths are measured as the decoder reads: with its thread count, from memory placed as its weights are
(huge pages on the CPU, runtime/inference/cpu_bandwidth.py), and for experts streamed from the host tier, along
the path they take (PCIe copies, or the CPU computing over host memory: a checkpoint's mapped pages on a CPU).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from runtime.inference.cpu_bandwidth import empty_weight
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param


def _best_s(fn, device: torch.device, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


@contextmanager
def cpu_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` (unchanged when None) for the block."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def read_bandwidth(device: torch.device, nbytes: int = 256 << 20, threads: int | None = None) -> float:
    """Bytes/s a reduction reads from `device`'s memory (best of a few; more than any cache holds), on the CPU with
    `threads` threads from memory allocated as weights are (huge pages where offered)."""
    x = empty_weight((nbytes // 4,), torch.float32, device).fill_(1.0)
    with cpu_threads(threads):
        return nbytes / _best_s(x.sum, device)


def mapped_read_bandwidth(path: Path, threads: int | None = None) -> float:
    """Bytes/s a reduction on the CPU reads from `path` memory-mapped (its pages in the page cache after the first
    pass): the memory an `--offload auto` layer streamed on a CPU computes on."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    words = torch.frombuffer(mapped, dtype=torch.uint8, count=len(mapped) // 4 * 4).view(torch.float32)
    with cpu_threads(threads):
        return words.numel() * 4 / _best_s(lambda: words.float().sum(), torch.device("cpu"), repeats=3)


def host_to_device_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes/s of a copy from pinned host memory to the CUDA `device` (PCIe); 0 elsewhere."""
    if device.type != "cuda":
        return 0.0
    src = torch.ones(nbytes // 4).pin_memory()
    dst = torch.empty_like(src, device=device)
    return nbytes / _best_s(lambda: dst.copy_(src, non_blocking=True), device)


def token_bytes(model: Transformer) -> tuple[int, int]:
    """(dense bytes a token reads, bytes of one expert) for `model` in its dtype: every non-expert weight but the
    embedding table, of which a token reads one row (all of it when the head is tied to it)."""
    cfg = model.cfg
    size = model.tok_embeddings.weight.element_size()
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not is_expert_param(n))
    if model.output is not None:
        dense -= (cfg.vocab_size - 1) * cfg.hidden_size * size
    matrices = 3 if cfg.expert_type == "swiglu" else 2
    per_expert = (matrices * cfg.hidden_size * cfg.ffn_size
                  + (cfg.ffn_size * (matrices - 1) + cfg.hidden_size if cfg.bias else 0)) * size
    return dense, per_expert


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, positions: int, element_size: int = 2,
                   batch: int = 1) -> int:
    """Bytes of keys and values a token's attention reads over `positions` cached positions (a static cache
    attends over its whole capacity, masked)."""
    return 2 * layers * batch * kv_heads * positions * head_dim * element_size


def decode_bound(device_bytes: float, device_bw: float, host_bytes: float = 0.0, host_bw: float = 0.0) -> float:
    """Tokens/s if reading were all a token did: device_bytes at device_bw plus host_bytes (streamed or copied from
    the host tier) at host_bw."""
    seconds = device_bytes / device_bw + (host_bytes / host_bw if host_bytes else 0.0)
    return 1.0 / seconds if seconds > 0 else 0.0
