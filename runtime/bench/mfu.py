"""Model FLOP utilisation: the training FLOPs a model does per token (PaLM, appendix B: 6N for the matmuls of
forward and backward over the N parameters a token touches, plus 12 L D T for attention over T positions) against
the peak the device reaches on a large matmul, measured here."""

from __future__ import annotations

import time

import torch

from runtime.plan.step_time import matmul_flops_per_token, training_flops_per_token  # noqa: F401 (one formula)


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


SPEC_DENSE_TFLOPS = {"H200": 989.4, "H100": 989.4, "GH200": 989.4, "B200": 2250.0, "A100": 312.0, "L40S": 362.1,
                     "A10": 125.0}
"""Dense bf16/fp16 tensor-core TFLOP/s of a GPU's data sheet (SXM parts, no sparsity), by a word of its name: the peak
Megatron reports MFU against, beside the measured GEMM rate."""


def spec_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The data-sheet dense FLOP/s of `device` at bf16/fp16 (fp32 matmuls run at their own, lower rate: None), or None
    for a CPU or a GPU not in SPEC_DENSE_TFLOPS."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device).upper()
    for word, tflops in SPEC_DENSE_TFLOPS.items():
        if word in name.replace("-", " ").split():
            return tflops * 1e12
    return None
