"""The grouped experts' activations (gelu, silu(h1) * h3) under autograd: on CPU the output lives in a pooled buffer
given back in backward, and backward writes the input gradients over buffers it owns, so a step allocates fewer
fresh [R, F] tensors (runtime/moe/buffer_pool.py says why fresh large CPU tensors cost).

Legend: R routed rows, F ffn dim.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.moe.buffer_pool import BufferPool


class _GeluGradInPlace(torch.autograd.Function):
    """gelu whose backward writes the input gradient over the incoming one, and whose output on CPU lives in a
    pooled buffer given back in backward (the next projection, its only reader, is done by then). Saves the two
    largest fresh [R, F] allocations of a step and, on CPU, their page faults and unmaps. Only for where this module
    uses it: an output read by one projection, a gradient nobody else holds. Reusing the buffer bumps its version,
    so a second backward through a graph whose buffer was taken again fails autograd's in-place check instead of
    reading the new contents."""

    @staticmethod
    def forward(ctx, h_RF: Tensor) -> Tensor:
        ctx.save_for_backward(h_RF)
        out_RF = _pooled_output(ctx, h_RF)
        return F.gelu(h_RF) if out_RF is None else torch.ops.aten.gelu.out(h_RF, out=out_RF)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RF: Tensor) -> Tensor:
        (h_RF,) = ctx.saved_tensors
        _give_back_output(ctx)
        return torch.ops.aten.gelu_backward.grad_input(grad_RF, h_RF, grad_input=grad_RF)


class _SwiGLUGradInPlace(torch.autograd.Function):
    """silu(h1) * h3 on the same terms as _GeluGradInPlace: the output pooled on CPU, both input gradients written
    over buffers backward owns (the incoming gradient and a recomputed silu(h1)). Saves h1 and h3 only, where
    autograd of the plain expression keeps silu(h1) too, and four fresh [R, F] allocations a step."""

    @staticmethod
    def forward(ctx, h1_RF: Tensor, h3_RF: Tensor) -> Tensor:
        ctx.save_for_backward(h1_RF, h3_RF)
        out_RF = _pooled_output(ctx, h1_RF)
        if out_RF is None:
            return F.silu(h1_RF) * h3_RF
        return torch.ops.aten.silu.out(h1_RF, out=out_RF).mul_(h3_RF)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RF: Tensor):
        h1_RF, h3_RF = ctx.saved_tensors
        _give_back_output(ctx)
        grad_h3 = F.silu(h1_RF).mul_(grad_RF)
        grad_h1 = torch.ops.aten.silu_backward.grad_input(grad_RF.mul_(h3_RF), h1_RF, grad_input=grad_RF)
        return grad_h1, grad_h3


activation_pool = BufferPool()
"""The CPU buffers pooled activations are computed into; `clear()` gives the free ones back to the allocator."""
_unpooled = threading.local()


@contextlib.contextmanager
def unpooled_activations():
    """Activations computed inside are fresh tensors, not pooled buffers: a recomputed region (train.recompute)
    drops its forward's activations until backward computes them again, which a buffer held by the forward's
    autograd node would not let it do."""
    depth = getattr(_unpooled, "depth", 0)
    _unpooled.depth = depth + 1
    try:
        yield
    finally:
        _unpooled.depth = depth


def _pooled_output(ctx, like: Tensor) -> Tensor | None:
    """On CPU, a pooled buffer shaped like `like`, kept on ctx until backward gives it back; None elsewhere and in
    unpooled_activations."""
    ctx.buf = None
    if like.device.type != "cpu" or getattr(_unpooled, "depth", 0) > 0:
        return None
    ctx.buf, out = activation_pool.take(like)
    return out


def _give_back_output(ctx) -> None:
    if ctx.buf is not None:
        activation_pool.give(ctx.buf)
        ctx.buf = None


def _autograd_on(t: Tensor) -> bool:
    return torch.is_grad_enabled() and t.requires_grad


def pooled_gelu(h_RF: Tensor) -> Tensor:
    """Pooled gelu under autograd; plain gelu when nothing will run backward (the output is freed right away) or
    torch.compile traces it (it fuses the plain expression itself)."""
    return _GeluGradInPlace.apply(h_RF) if _autograd_on(h_RF) and not torch.compiler.is_compiling() else F.gelu(h_RF)


def pooled_swiglu(h1_RF: Tensor, h3_RF: Tensor) -> Tensor:
    """Pooled silu(h1) * h3 under autograd, the plain expression otherwise (and when compiled)."""
    if (_autograd_on(h1_RF) or _autograd_on(h3_RF)) and not torch.compiler.is_compiling():
        return _SwiGLUGradInPlace.apply(h1_RF, h3_RF)
    return F.silu(h1_RF) * h3_RF
