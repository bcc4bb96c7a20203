"""Model FLOP utilisation: the training FLOPs a model does per token (PaLM, appendix B: 6N for the matmuls of
forward and backward over the N parameters a token touches, plus 12 L D T for attention over T positions) against
the peak the device reaches on a large matmul, measured here."""

from __future__ import annotations

import time

import torch

from runtime.config import ModelConfig
from runtime.plan.params import count_parameters


def matmul_flops_per_token(m: ModelConfig) -> float:
    """Forward and backward FLOPs of one token through the weights it touches (6 per parameter): the embedding
    lookup is not a matmul, the output head is."""
    p = count_parameters(m)
    return 6.0 * (p.active - p.embedding + m.vocab_size * m.hidden_size)


def training_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Forward and backward FLOPs of one token: its matmuls and attention over `seq_len` positions."""
    return matmul_flops_per_token(m) + 12.0 * m.num_layers * m.hidden_size * seq_len


def peak_flops(device: torch.device, dtype: torch.dtype, size: int | None = None, seconds: float = 1.0) -> float:
    """FLOP/s of repeated [size, size] matmuls in `dtype` on `device` (best of a second's worth): the ceiling
    MFU is measured against on this machine."""
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best, began = 0.0, time.perf_counter()
    a @ b  # warm-up: kernels chosen, memory touched
    while time.perf_counter() - began < seconds:
        sync()
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * size ** 3 / (time.perf_counter() - start))
    return best
