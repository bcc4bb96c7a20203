"""The bandwidth bound of a decode token: a token is no faster than the bytes it reads can be
read, so bound = the tiers' read times summed, each tier's bytes over its measured bandwidth."""

from __future__ import annotations

import time

import torch

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


def read_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes/s a reduction reads from `device`'s memory (best of a few; more than any cache holds)."""
    x = torch.ones(nbytes // 4, device=device)
    return nbytes / _best_s(x.sum, device)


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
    dense = sum(p.numel() for n, p in model.named_parameters() if not is_expert_param(n)) * size
    if model.output is not None:
        dense -= (cfg.vocab_size - 1) * cfg.hidden_size * size
    matrices = 3 if cfg.expert_type == "swiglu" else 2
    per_expert = (matrices * cfg.hidden_size * cfg.ffn_size
                  + (cfg.ffn_size * (matrices - 1) + cfg.hidden_size if cfg.bias else 0)) * size
    return dense, per_expert


def decode_bound(device_bytes: float, device_bw: float, host_bytes: float = 0.0, host_bw: float = 0.0) -> float:
    """Tokens/s if reading were all a token did: device_bytes at device_bw plus host_bytes (streamed or copied from
    the host tier) at host_bw."""
    seconds = device_bytes / device_bw + (host_bytes / host_bw if host_bytes else 0.0)
    return 1.0 / seconds if seconds > 0 else 0.0
