"""What lets a CPU decode token read its weights at the memory's bandwidth (llama.cpp's batch-1 decode sits near
the DRAM bound): the weights on transparent huge pages, and one-row products through aten's GEMV.

- Huge pages: a token streams every weight it uses once; on 4 KiB pages the hardware prefetchers stop at each page
  boundary and every page costs a TLB walk, on 2 MiB pages neither. Weights copied onto a CPU for inference
  (`empty_weight`) get anonymous memory advised MADV_HUGEPAGE where the kernel offers it.
- One-row products: oneDNN's bf16 matmul repacks the weight for every call, which for one row reads it at a third
  of the bandwidth; aten's own bf16 GEMV (fp32 accumulation) streams it in place, and runtime/model/cpu_gemv.py
  gives its numbers at the memory's pace. A decode step turns oneDNN off for its duration (`decode_kernels`);
  prompts, whose many rows oneDNN's GEMM serves well, keep it.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
"""Tensors at least this large are worth a huge page (x86-64's PMD size)."""


@functools.lru_cache(maxsize=1)
def huge_pages_available() -> bool:
    """Whether the kernel gives anonymous memory huge pages on request (THP `always` or `madvise`)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def empty_on_huge_pages(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
    """An uninitialised CPU tensor on its own anonymous private mapping, advised MADV_HUGEPAGE before it is touched
    (the tensor keeps the mapping alive; it is unmapped with the last view)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    region = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def empty_weight(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """torch.empty for a weight a decode step will stream: on the CPU, one of at least HUGE_PAGE bytes goes on huge
    pages where the kernel offers them."""
    device = torch.device(device)
    if device.type == "cpu" and torch.Size(shape).numel() * dtype.itemsize >= HUGE_PAGE and huge_pages_available():
        return empty_on_huge_pages(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


@contextmanager
def decode_kernels(device: torch.device) -> Iterator[None]:
    """Around a decode step: on the CPU, oneDNN off, so one-row bf16 products run aten's GEMV, which reads the weight
    in place (the same kernel for a resident layer's grouped GEMM and a streamed expert's product: every mode keeps
    the same arithmetic); restored afterwards. Nothing changes on other devices."""
    if device.type != "cpu":
        yield
        return
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)
