"""The experts' grouped GEMM: where torch._grouped_mm can run on given tensors, and the GEMM as an operator
torch.compile treats as one opaque call (torch.library custom ops): the compiler's meta kernel of torch._grouped_mm
takes bf16 only, so a compiled block (train.compile) calls these, which run torch._grouped_mm itself in every dtype
it has, forward and backward (the gradients autograd gives it, bit for bit).

Legend: R rows grouped by expert (offs: each expert's end row, int32), K in features, N out features, e experts.
"""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_mm_ok(*tensors: Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides (CPU and sm90+ CUDA in torch 2.13)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dev = tensors[0].device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (9, 0):
        return False
    if dev.type not in ("cpu", "cuda"):
        return False
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def grouped_mm_in_place(*weights: Tensor | None) -> bool:
    """torch._grouped_mm reads these weights where they lie: `grouped_mm_ok`, and each one's data 16-byte aligned
    (an offloader's slot views may not be). None entries (an absent w3) are skipped."""
    given = [w for w in weights if w is not None]
    return all(w.data_ptr() % 16 == 0 for w in given) and grouped_mm_ok(*given)


@torch.library.custom_op("moesys::grouped_mm", mutates_args=())
def grouped_mm(a_RK: Tensor, b_eKN: Tensor, offs_e: Tensor) -> Tensor:
    """[R, K] x [e, K, N] -> [R, N]: each expert's rows times its matrix."""
    return torch._grouped_mm(a_RK, b_eKN, offs=offs_e)


@grouped_mm.register_fake
def _(a_RK: Tensor, b_eKN: Tensor, offs_e: Tensor) -> Tensor:
    return a_RK.new_empty(a_RK.shape[0], b_eKN.shape[-1])


@torch.library.custom_op("moesys::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(a_RK: Tensor, grad_RN: Tensor, offs_e: Tensor) -> Tensor:
    """The [e, K, N] gradient of grouped_mm's matrices: each expert's rows transposed times its rows' gradient."""
    return torch._grouped_mm(a_RK.t(), grad_RN, offs=offs_e)


@grouped_mm_weight_grad.register_fake
def _(a_RK: Tensor, grad_RN: Tensor, offs_e: Tensor) -> Tensor:
    return a_RK.new_empty(offs_e.shape[0], a_RK.shape[1], grad_RN.shape[1])


def _setup(ctx, inputs, output) -> None:
    a_RK, b_eKN, offs_e = inputs
    ctx.save_for_backward(a_RK, b_eKN, offs_e)


def _backward(ctx, grad_RN: Tensor):
    a_RK, b_eKN, offs_e = ctx.saved_tensors
    grad_RN = grad_RN.contiguous()
    grad_a = grouped_mm(grad_RN, b_eKN.transpose(-2, -1), offs_e) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm_weight_grad(a_RK, grad_RN, offs_e) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm.register_autograd(_backward, setup_context=_setup)
