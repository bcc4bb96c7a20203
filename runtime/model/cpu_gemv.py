"""One-row bf16 products on an x86 CPU at the memory's bandwidth, with aten's arithmetic bit for bit.

aten's bf16 GEMV (what a one-row F.linear runs with oneDNN off, as a decode step runs it) converts the row to fp32
again for every output, work that keeps it below one core's read bandwidth. `cpu_gemv.cpp` converts
the row once and keeps aten's accumulators, summation tree and final reduction, so it gives the very numbers while
streaming the weight at the memory's pace. Built once per machine with torch's C++ extension loader (cached under
`TORCH_EXTENSIONS_DIR`), used only where the CPU has AVX-512 and a probe on random rows finds aten's bits; anywhere
else (other devices, dtypes, shapes, several rows, oneDNN on, a failed build) the call is aten's own.

Legend: R rows, N out features, D in features, E experts.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

NAME = "moesys_cpu_gemv"
"""The extension's name: its build directory under TORCH_EXTENSIONS_DIR."""
CHUNK = 64
"""The kernel's in-feature step: D must be a multiple of it."""
_ENABLED = [True]


def set_enabled(on: bool) -> bool:
    """Use the kernel where it applies (True, the default) or always aten's product (benches compare the two in one
    process); the previous setting."""
    before, _ENABLED[0] = _ENABLED[0], on
    return before


def _avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


@functools.lru_cache(maxsize=1)
def kernel():
    """The built extension, or None where it cannot run here or does not give aten's bits (checked once)."""
    if not _avx512():
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        build = Path(_get_build_directory(NAME, verbose=False))
        if not any(build.glob("*.so")):
            print(f"moesys: building the CPU decode kernel once for this machine (about a minute; cached in {build})",
                  file=sys.stderr, flush=True)
        mod = load(NAME, [str(Path(__file__).with_name("cpu_gemv.cpp"))],
                   extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp"],
                   extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no headers: aten's product serves
        log.info("cpu_gemv: the kernel did not build (%s); one-row products stay aten's", exc)
        return None
    return mod if _gives_aten_bits(mod) else None


def _gives_aten_bits(mod) -> bool:
    """Whether the kernel's rows equal aten's one-row products bit for bit (oneDNN off), on random rows and weights
    of a few scales: the summation order is fixed by the code, not the values."""
    gen = torch.Generator().manual_seed(0)
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        for n, d, scale in ((512, 1024, 0.02), (384, 3584, 0.5), (64, 128, 3.0)):
            w = (torch.randn(n, d, generator=gen) * scale).to(torch.bfloat16)
            x = torch.randn(1, 1, d, generator=gen).to(torch.bfloat16)
            off_line = torch.cat((w.new_zeros(16), w.flatten()))[16:].view(n, d)  # 32 bytes off a cache line
            aten = F.linear(x, w)
            if not all(torch.equal(y, aten) for y in (mod.linear_rows(x, w), mod.linear_rows(x, off_line))) or \
                    not torch.equal(mod.list_rows(x[0], [off_line, w]), torch.cat((aten[0], aten[0]))):
                log.info("cpu_gemv: the kernel's bits differ from aten's here; one-row products stay aten's")
                return False
            e = torch.randint(0, 4, (3,), generator=gen).unique()
            ws = (torch.randn(4, n, d, generator=gen) * scale).to(torch.bfloat16)
            rows = torch.randn(e.numel(), d, generator=gen).to(torch.bfloat16)
            offs = torch.searchsorted(e, torch.arange(4), right=True, out_int32=True)
            aten = torch._grouped_mm(rows, ws.transpose(-2, -1), offs=offs)
            if not torch.equal(mod.grouped_rows(rows, ws, offs), aten):
                return False
        return True
    finally:
        torch._C._set_mkldnn_enabled(before)


def applies(x: Tensor, weight: Tensor) -> bool:
    """The kernel's case: eager, CPU, bf16, contiguous, D a multiple of CHUNK, oneDNN off (aten's GEMV is then
    what F.linear runs), and the kernel here."""
    return (not torch.compiler.is_compiling() and _ENABLED[0] and x.device.type == "cpu"
            and x.dtype == weight.dtype == torch.bfloat16 and weight.shape[-1] % CHUNK == 0
            and weight.is_contiguous() and x.is_contiguous() and not torch._C._get_mkldnn_enabled()
            and kernel() is not None)


def _call(name: str, *args: Tensor | list[Tensor]) -> Tensor:
    """The kernel's function `name`, named for torch.profiler while it records (a profile shows its time, and an
    operator count counts it once)."""
    fn = getattr(kernel(), name)
    if not torch._C._autograd._profiler_enabled():
        return fn(*args)
    with torch.profiler.record_function(f"moesys::cpu_gemv.{name}"):
        return fn(*args)


def linear(x_D: Tensor, weight_ND: Tensor, bias_N: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) for x of one row ([..., D], one row in all): the kernel where it applies, else
    aten's product."""
    if bias_N is None and x_D.numel() == x_D.shape[-1] and applies(x_D, weight_ND):
        return _call("linear_rows", x_D, weight_ND)
    return F.linear(x_D, weight_ND, bias_N)


def grouped_mm(x_RD: Tensor, w_END: Tensor, offs_E: Tensor) -> Tensor:
    """torch._grouped_mm(x, w.transpose(-2, -1), offs): rows sorted by expert (offs: each expert's end row, int32)
    times their expert's [N, D] matrix. The kernel where it applies and each expert has at most one row (a one-row
    product; the kernel hands several rows to aten's GEMM itself), else aten's grouped GEMM."""
    if applies(x_RD, w_END) and offs_E.dtype == torch.int32:
        return _call("grouped_rows", x_RD, w_END, offs_E)
    return torch._grouped_mm(x_RD, w_END.transpose(-2, -1), offs=offs_E)


def routed_mm(x_RD: Tensor, w_END: Tensor, ids_K: Tensor) -> Tensor:
    """[K, N]: row k is x[k] (x[0] for every k when x has one row) times expert ids_K[k]'s matrix, a one-row product
    each: one token's routed experts read in place, in choice order, without sorting them by expert (the ids, int64,
    distinct, are read on the host). Only where `applies` (callers check)."""
    return _call("routed_rows", x_RD, w_END, ids_K)


def listed_mm(x_RD: Tensor, w_KND: list[Tensor]) -> Tensor:
    """[K, N]: row k is x[k] (x[0] for every k when x has one row) times w_KND[k], a one-row product each: one
    token's routed experts where each lies apart (a streamed layer's views of a mapped file), in one call. Only where
    `applies` to every weight (callers check)."""
    return _call("list_rows", x_RD, w_KND)
