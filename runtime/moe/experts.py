"""Merged experts: all local experts' FFNs computed together on rows grouped by expert (ORT MoE "merged
experts", ORT MoE; MegaBlocks-style grouped GEMM), plus the plain per-expert loop used as the reference. The decode
forms are in runtime/moe/routed.py, the pooled activations in runtime/moe/activations.py.

Legend: R routed rows, D model dim, F ffn dim, e local experts, T tokens, K top-k.
Weights follow nn.Linear's [out, in] layout: w1 [e, F, D], w2 [e, D, F], w3 [e, F, D], b1 [e, F], b2 [e, D].
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.moe.activations import pooled_gelu, pooled_swiglu
from runtime.moe.expert_threads import ExpertLinear, expert_threads, row_bounds
from runtime.moe.grouped_mm_op import grouped_mm, grouped_mm_ok
from runtime.moe.routed import routed_ffn

EXPERT_TYPES = ("gelu", "swiglu")
IMPLS = ("auto", "grouped_mm", "expert_threads", "bmm", "loop")


def _contiguous_grad(t: Tensor) -> Tensor:
    """_grouped_mm's backward rejects expanded (stride 0) gradients, e.g. from y.sum(); make them dense."""
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


class _AddExpertBias(torch.autograd.Function):
    """h_RF[r] += b_eF[expert_R[r]] in place; the bias gradient is each expert's sum of its rows' gradients. One pass
    over h instead of a one-hot [R, e] x [e, F] addmm, many times slower on CPU (benchmarks/cpu-kernels_*.md), and
    each row's expert is found on the device (rows_expert), so nothing is read on the host; _grouped_mm takes no
    differentiable bias."""

    @staticmethod
    def forward(ctx, h_RF: Tensor, b_eF: Tensor, expert_R: Tensor) -> Tensor:
        ctx.save_for_backward(expert_R)
        ctx.experts = b_eF.shape[0]
        h_RF.add_(b_eF.index_select(0, expert_R))
        ctx.mark_dirty(h_RF)
        return h_RF

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RF: Tensor):
        (expert_R,) = ctx.saved_tensors
        grad_b = grad_RF.new_zeros(ctx.experts, grad_RF.shape[1]).index_add_(0, expert_R, grad_RF)
        return grad_RF, grad_b, None


def rows_expert(offs_e: Tensor, rows: int) -> Tensor:
    """The expert of each of `rows` rows grouped by expert (offs_e: each expert's end row), on the device."""
    return torch.searchsorted(offs_e, torch.arange(rows, device=offs_e.device, dtype=offs_e.dtype), right=True)


def _ffn_grouped_mm(x_RD, counts_e, w1, w2, w3, b1, b2, b3, kind):
    """Rows stay packed; one _grouped_mm per projection, then each expert's bias added to its rows in place (traced
    by torch.compile: the grouped GEMM as one custom operator, the bias a gather)."""
    offs_e = torch.cumsum(counts_e, 0, dtype=torch.int32)
    expert_R = rows_expert(offs_e, x_RD.shape[0]) if b1 is not None else None
    compiling = torch.compiler.is_compiling()

    def proj(a, w, b):
        if compiling:
            out = grouped_mm(a, w.transpose(-2, -1), offs_e)
            return out if b is None else out + b.index_select(0, expert_R)
        out = _contiguous_grad(torch._grouped_mm(a, w.transpose(-2, -1), offs=offs_e))
        return out if b is None else _AddExpertBias.apply(out, b, expert_R)

    h_RF = proj(x_RD, w1, b1)
    h_RF = pooled_gelu(h_RF) if kind == "gelu" else pooled_swiglu(h_RF, proj(x_RD, w3, b3))
    return proj(h_RF, w2, b2)


def _ffn_expert_threads(x_RD, counts_e, w1, w2, w3, b1, b2, b3, kind):
    """As _ffn_grouped_mm, each expert's products on one CPU thread (runtime/moe/expert_threads.py)."""
    counts = counts_e.tolist()
    bounds, threads = row_bounds(counts), torch.get_num_threads()
    expert_R = (torch.repeat_interleave(torch.arange(len(counts), device=x_RD.device), counts_e)
                if b1 is not None else None)

    def proj(a, w, b):
        out = ExpertLinear.apply(a, w, bounds, threads)
        return out if b is None else _AddExpertBias.apply(out, b, expert_R)

    h_RF = proj(x_RD, w1, b1)
    h_RF = pooled_gelu(h_RF) if kind == "gelu" else pooled_swiglu(h_RF, proj(x_RD, w3, b3))
    return proj(h_RF, w2, b2)


def _ffn_bmm(x_RD, counts_e, w1, w2, w3, b1, b2, b3, kind):
    """Pad every expert to the largest row count, run the FFN as batched matmuls, then unpad."""
    num_e, rows = counts_e.numel(), x_RD.shape[0]
    cap = int(counts_e.max()) if num_e else 0
    slot_eC = torch.arange(cap, device=x_RD.device).expand(num_e, cap)
    valid_eC = slot_eC < counts_e[:, None]
    dest_R = (slot_eC + torch.arange(num_e, device=x_RD.device)[:, None] * cap)[valid_eC]
    x_eCD = x_RD.new_zeros(num_e * cap, x_RD.shape[1]).index_copy(0, dest_R, x_RD).view(num_e, cap, -1)

    def proj(a, w, b):
        return torch.bmm(a, w.transpose(1, 2)) if b is None else torch.baddbmm(b[:, None, :], a, w.transpose(1, 2))

    h = proj(x_eCD, w1, b1)
    h = F.gelu(h) if kind == "gelu" else F.silu(h) * proj(x_eCD, w3, b3)
    y_eCD = proj(h, w2, b2)
    return y_eCD.reshape(num_e * cap, -1).index_select(0, dest_R) if rows else y_eCD.new_zeros(0, w2.shape[1])


def _row(t: Tensor | None, e: int) -> Tensor | None:
    """Expert e's slice of a stacked weight, or None for a weight the experts do not have."""
    return None if t is None else t[e]


def ffn_one(x_ND: Tensor, w1, w2, w3=None, b1=None, b2=None, b3=None, kind: str = "gelu") -> Tensor:
    """One expert's FFN: gelu: w2(gelu(w1 x + b1)) + b2; swiglu: w2(silu(w1 x + b1) * (w3 x + b3)) + b2."""
    h = F.linear(x_ND, w1, b1)
    h = F.gelu(h) if kind == "gelu" else F.silu(h) * F.linear(x_ND, w3, b3)
    return F.linear(h, w2, b2)


def _ffn_loop(x_RD, counts_e, w1, w2, w3, b1, b2, b3, kind):
    pick = lambda t, i: None if t is None else t[i]  # noqa: E731
    chunks = x_RD.split(counts_e.tolist(), dim=0)
    return torch.cat([ffn_one(c, w1[i], w2[i], pick(w3, i), pick(b1, i), pick(b2, i), pick(b3, i), kind)
                      for i, c in enumerate(chunks)], dim=0)


def resolve_impl(impl: str, x_RD: Tensor, w1: Tensor) -> str:
    """What `expert_ffn(x_RD, ..., w1, impl=impl)` runs: auto picks expert_threads (many experts of enough work on a
    multi-threaded CPU), else grouped_mm where its strides allow, else bmm; the others are themselves."""
    if impl != "auto":
        return impl
    if not torch.compiler.is_compiling() and expert_threads(x_RD, w1.shape[0], w1.shape[2], w1.shape[1]):
        return "expert_threads"
    return "grouped_mm" if grouped_mm_ok(x_RD, w1) else "bmm"


def output_dtype(x_RD: Tensor) -> torch.dtype:
    """The dtype experts compute and answer in: autocast's when it is on, else the rows' own. Every rank must
    answer in it, rows or none: the combine's AlltoAll sends each rank's gradient in its own dtype."""
    device_type = x_RD.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x_RD.dtype


def expert_ffn(x_RD: Tensor, tokens_per_expert_e: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None = None,
               b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
               kind: str = "gelu", impl: str = "auto") -> Tensor:
    """All experts' FFNs on rows grouped by expert (row counts tokens_per_expert_e) -> y_RD.

    A pure function so offloading can pass weights it fetched. impl: auto (expert_threads for many experts of
    enough work on a multi-threaded CPU, else grouped_mm when the shapes allow, else bmm), grouped_mm,
    expert_threads (each expert's products on one CPU thread), bmm (pad to the largest expert), loop (reference,
    one expert at a time).
    Weights are cast to x's dtype.
    """
    if kind not in EXPERT_TYPES:
        raise ValueError(f"model.expert_type={kind!r} is not one of {', '.join(EXPERT_TYPES)}")
    if kind == "swiglu" and w3 is None:
        raise ValueError("swiglu experts need w3")
    # Under autocast the experts run in the autocast dtype (fp32 master weights cast per call); the grouped
    # kernels are not on autocast's op lists, so cast explicitly and keep autocast out of the way.
    device_type = x_RD.device.type
    dtype = output_dtype(x_RD)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    x_RD, w1, w2 = x_RD.to(dtype), w1.to(dtype), w2.to(dtype)
    w3, b1, b2, b3 = map(cast, (w3, b1, b2, b3))
    if kind == "gelu":
        w3 = b3 = None
    counts_e = tokens_per_expert_e.to(device=x_RD.device, dtype=torch.long)
    impl = resolve_impl(impl, x_RD, w1)
    fn = {"grouped_mm": _ffn_grouped_mm, "expert_threads": _ffn_expert_threads, "bmm": _ffn_bmm,
          "loop": _ffn_loop}[impl]
    with torch.autocast(device_type, enabled=False):
        return fn(x_RD, counts_e, w1, w2, w3, b1, b2, b3, kind)


@runtime_checkable
class Experts(Protocol):
    """The seam between a MoE layer and its experts: every local expert's FFN on rows grouped by expert, as
    MoELayer.forward calls it. GroupedExperts holds the weights; each offloader puts a stand-in in its place that
    finds them elsewhere (training's OffloadedGroupedExperts, inference's LayerSlotExperts and StreamedExperts)."""

    def __call__(self, x_RD: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        """y_RD for rows x_RD grouped by expert, tokens_per_expert_e[i] rows for local expert i."""
        ...


@runtime_checkable
class RoutedExperts(Experts, Protocol):
    """Experts a decode step can compute through: the resident ones and inference's stand-ins."""

    def routed(self, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        """y_TD: each token's routed experts' outputs summed with its weights (`routed_ffn`'s contract)."""
        ...


class GroupedExperts(nn.Module):
    """num_experts FFNs stored as stacked weights and run together by `expert_ffn`."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, expert_type: str = "gelu", bias: bool = True,
                 impl: str = "auto"):
        super().__init__()
        if expert_type not in EXPERT_TYPES:
            raise ValueError(f"model.expert_type={expert_type!r} is not one of {', '.join(EXPERT_TYPES)}")
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r} is not one of {', '.join(IMPLS)}")
        self.num_experts, self.hidden, self.ffn = num_experts, hidden, ffn
        self.first_expert = 0
        """Global index of row 0: expert parallelism keeps a block of a layer's experts on each rank."""
        self.expert_type, self.impl = expert_type, impl
        self.routed_form = "auto"
        """`routed_ffn`'s form for a decode step's few tokens (runtime/moe/routed.py's ROUTED_FORMS); the decode
        step sets it."""
        swiglu = expert_type == "swiglu"
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden)) if swiglu else None
        self.b1 = nn.Parameter(torch.empty(num_experts, ffn)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.b3 = nn.Parameter(torch.empty(num_experts, ffn)) if bias and swiglu else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        for name, param in self.named_parameters(recurse=False):
            fan_in = self.ffn if name in ("w2", "b2") else self.hidden
            nn.init.uniform_(param, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def weights(self) -> dict[str, Tensor | None]:
        return {"w1": self.w1, "w2": self.w2, "w3": self.w3, "b1": self.b1, "b2": self.b2, "b3": self.b3}

    def forward(self, x_RD: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        return expert_ffn(x_RD, tokens_per_expert_e, self.w1, self.w2, self.w3, self.b1, self.b2, self.b3,
                          kind=self.expert_type, impl=self.impl)

    def routed(self, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        return routed_ffn(x_TD, expert_ids_TK, weights_TK, self.w1, self.w2, self.w3, self.b1, self.b2, self.b3,
                          kind=self.expert_type, form=self.routed_form)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, ffn={self.ffn}, "
                f"expert_type={self.expert_type}, bias={self.b1 is not None}")


def reference_moe_forward(x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor, w1: Tensor, w2: Tensor,
                          w3: Tensor | None = None, b1: Tensor | None = None, b2: Tensor | None = None,
                          b3: Tensor | None = None, kind: str = "gelu", keep_TK: Tensor | None = None) -> Tensor:
    """The plain MoE: for each expert, index its tokens, run its FFN, index_add the weighted output."""
    keep_TK = torch.ones_like(expert_ids_TK, dtype=torch.bool) if keep_TK is None else keep_TK
    y_TD = torch.zeros_like(x_TD)
    for e in range(w1.shape[0]):
        tok, slot = torch.nonzero((expert_ids_TK == e) & keep_TK, as_tuple=True)
        if tok.numel() == 0:
            continue
        y_ND = ffn_one(x_TD[tok], w1[e], w2[e], _row(w3, e), _row(b1, e), _row(b2, e), _row(b3, e), kind)
        y_TD = y_TD.index_add(0, tok, y_ND * weights_TK[tok, slot].to(y_ND.dtype).unsqueeze(1))
    return y_TD
