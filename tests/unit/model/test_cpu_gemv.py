"""The CPU one-row product kernel against aten's own calls (the reference), bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from runtime.inference.cpu_bandwidth import decode_kernels
from runtime.model import cpu_gemv

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(cpu_gemv.kernel() is None, reason="no AVX-512, no C++ compiler, or other bits here")


def _bf16(*shape, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, d", [(3584, 1024), (1024, 3584), (1000, 192), (7, 64)])
def test_one_row_products_are_aten_gemv_bit_for_bit(n, d, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with decode_kernels(CPU):
            for seed, scale in enumerate((0.02, 1.0, 30.0)):
                x, w = _bf16(1, 1, d, seed=seed), _bf16(n, d, scale=scale, seed=seed + 10)
                got = cpu_gemv.linear(x, w)
                cpu_gemv.set_enabled(False)
                want = cpu_gemv.linear(x, w)
                cpu_gemv.set_enabled(True)
                assert torch.equal(got, want) and torch.equal(want, F.linear(x, w))
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("ids", [[1, 4], [0, 7], [3], [2, 2], [5, 1, 1, 6]])
def test_grouped_rows_are_aten_grouped_gemm_bit_for_bit(ids):
    """One row an expert through the kernel; an expert with several rows hands the call to aten's grouped GEMM."""
    E, N, D = 8, 384, 256
    w = _bf16(E, N, D, scale=0.05, seed=1)
    sorted_ids = torch.tensor(sorted(ids))
    offs = torch.searchsorted(sorted_ids, torch.arange(E), right=True, out_int32=True)
    x = _bf16(len(ids), D, seed=2)
    with decode_kernels(CPU):
        got = cpu_gemv.grouped_mm(x, w, offs)
        assert torch.equal(got, torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


def test_aten_serves_where_the_kernel_does_not_apply():
    """oneDNN on (a prompt), fp32, a bias, several rows: the very call F.linear makes."""
    w, x = _bf16(64, 128), _bf16(1, 128)
    assert torch.equal(cpu_gemv.linear(x, w), F.linear(x, w))  # oneDNN as the process has it
    with decode_kernels(CPU):
        assert torch.equal(cpu_gemv.linear(x.float(), w.float()), F.linear(x.float(), w.float()))
        assert torch.equal(cpu_gemv.linear(x, w, w[:, 0]), F.linear(x, w, w[:, 0]))
        rows = _bf16(3, 128)
        assert torch.equal(cpu_gemv.linear(rows, w), F.linear(rows, w))


@needs_kernel
@pytest.mark.parametrize("kind, bias", [("swiglu", False), ("gelu", True)])
def test_one_tokens_routed_experts_through_the_kernel_are_the_grouped_gemms_bits(kind, bias):
    """routed_ffn for one token: the kernel's rows in choice order equal aten's grouped GEMM over rows sorted by
    expert (the reference), weights read in place either way."""
    from runtime.moe.experts import GroupedExperts
    from runtime.moe.routed import routed_ffn

    torch.manual_seed(0)
    experts = GroupedExperts(8, 128, 192, kind, bias=bias).to(torch.bfloat16)
    x = _bf16(1, 1, 128, seed=3)
    ids, weights = torch.tensor([[[5, 2]]]), torch.tensor([[[0.7, 0.3]]])
    with decode_kernels(CPU), torch.no_grad():
        got = routed_ffn(x, ids, weights, **experts.weights(), kind=kind)
        cpu_gemv.set_enabled(False)
        try:
            want = routed_ffn(x, ids, weights, **experts.weights(), kind=kind)
        finally:
            cpu_gemv.set_enabled(True)
    assert torch.equal(got, want)


def _off_line(w: torch.Tensor, elements: int) -> torch.Tensor:
    """w's values in a view `elements` bf16 values past a cache line (a mapped file's tensors sit where the file
    puts them)."""
    flat = torch.cat((w.new_zeros(elements), w.flatten()))
    return flat[elements:].view(w.shape)


@needs_kernel
@pytest.mark.parametrize("elements", [16, 8, 1])
def test_weights_off_a_cache_line_give_aten_gemv_bits(elements):
    w, x = _bf16(384, 1024, scale=0.5, seed=4), _bf16(1, 1, 1024, seed=5)
    view = _off_line(w, elements)
    assert view.data_ptr() % 64 != 0
    with decode_kernels(CPU):
        assert torch.equal(cpu_gemv.linear(x, view), F.linear(x, w))


@needs_kernel
@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_listed_experts_are_row_ffn_per_expert(kind):
    """One token through K experts lying apart, one kernel call per projection: row_ffn's rows with aten's products
    (the reference), expert by expert."""
    from runtime.moe.routed import listed_ffn, row_ffn

    D, Fh = 256, 384
    experts = [{"w1": _off_line(_bf16(Fh, D, scale=0.05, seed=10 + k), 16 * k),
                "w2": _bf16(D, Fh, scale=0.05, seed=20 + k),
                "w3": _bf16(Fh, D, scale=0.05, seed=30 + k) if kind == "swiglu" else None} for k in range(2)]
    x = _bf16(1, D, seed=6)
    with decode_kernels(CPU), torch.no_grad():
        got = listed_ffn(x, experts, kind)
        cpu_gemv.set_enabled(False)
        try:
            want = torch.cat([row_ffn(x, **e, kind=kind) for e in experts])
        finally:
            cpu_gemv.set_enabled(True)
        assert got is not None and torch.equal(got, want)
        biased = [{**e, "b2": torch.zeros(D, dtype=torch.bfloat16)} for e in experts]
        assert listed_ffn(x, biased, kind) is None  # biases: row_ffn per expert serves
