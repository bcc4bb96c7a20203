"""The experts' decode forms: for a few tokens (a decode step) `routed_ffn` gathers each token's routed experts'
weights by index (gpt-fast's `w1[expert_ids]`): no sort, no row counts, nothing read on the host. For one token in
eager mode it reads them in place instead (a grouped GEMM with offsets computed on the device), with the same
numbers. `combine_choices` is the one combine of every form.

Legend: T tokens, K top-k, D model dim, F ffn dim, R rows, e experts.
Weights follow nn.Linear's [out, in] layout: w1 [e, F, D], w2 [e, D, F], w3 [e, F, D], b1 [e, F], b2 [e, D].
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.model import cpu_gemv
from runtime.moe.grouped_mm_op import grouped_mm_in_place, grouped_mm_ok

W = TypeVar("W", Tensor, list[Tensor])
"""A projection's weight: one expert's matrix, or a token's K experts' matrices (`listed_ffn`)."""

ROUTED_FORMS = ("auto", "gather")
"""How `routed_ffn` reads the routed experts' weights: auto (in place for one token where a grouped GEMM takes
them, else gathered) or gather (always gathered by index: what a compiler fuses into its own one-row reductions)."""


def routed_ffn(x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor, w1: Tensor, w2: Tensor,
               w3: Tensor | None = None, b1: Tensor | None = None, b2: Tensor | None = None,
               b3: Tensor | None = None, kind: str = "gelu", form: str = "auto") -> Tensor:
    """y_TD = sum over k of weights_TK[t, k] * expert expert_ids_TK[t, k]'s FFN of x_TD[t] (leading dims of x, ids
    and weights may be any, e.g. [B, 1]). Reads only routed experts and never the host, so it is for a few tokens:
    with form auto one token reads its experts' weights in place (`grouped_routed_ffn`) where a grouped GEMM takes
    them, else (and with form gather) each token gathers its own K experts' weights (`gather_routed_ffn`); the same
    numbers either way."""
    in_place = form == "auto" and one_token_in_place(x_TD, w1, w2, w3)
    ffn = grouped_routed_ffn if in_place else gather_routed_ffn
    return ffn(x_TD, expert_ids_TK, weights_TK, w1, w2, w3, b1, b2, b3, kind)


def gather_routed_ffn(x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor, w1: Tensor, w2: Tensor,
                      w3: Tensor | None = None, b1: Tensor | None = None, b2: Tensor | None = None,
                      b3: Tensor | None = None, kind: str = "gelu") -> Tensor:
    """`routed_ffn` from the routed experts' weights gathered by index (gpt-fast's `w1[expert_ids]`)."""
    pick = lambda t: None if t is None else t[expert_ids_TK]  # noqa: E731
    return gathered_ffn(x_TD, weights_TK, w1[expert_ids_TK], w2[expert_ids_TK], pick(w3), pick(b1), pick(b2), pick(b3),
                        kind)


@functools.lru_cache(maxsize=16)
def _expert_range(num_experts: int, device: torch.device) -> Tensor:
    """arange(num_experts), made once per device (a decode step would otherwise launch it every layer)."""
    return torch.arange(num_experts, device=device)


def one_token_in_place(x_TD: Tensor, *weights: Tensor | None) -> bool:
    """Whether `grouped_routed_ffn` computes this step: one token (its K choices are K distinct experts, one row
    each) and a grouped GEMM that takes these weights: 16-byte aligned (an offloader's slot views may not be), bf16
    on CUDA, and bf16 when torch.compile traces it (the grouped GEMM's meta kernel takes bf16 only; a model's own
    parameters are aligned by their allocator, and addresses cannot be read while tracing)."""
    if x_TD.numel() != x_TD.shape[-1]:
        return False
    given = [w for w in weights if w is not None]
    if torch.compiler.is_compiling():
        return given[0].dtype == torch.bfloat16 and grouped_mm_ok(*given) and grouped_mm_ok(x_TD.reshape(1, -1))
    if given[0].device.type == "cuda" and given[0].dtype != torch.bfloat16:
        return False
    return grouped_mm_in_place(*given) and grouped_mm_ok(x_TD.reshape(1, -1))


def grouped_routed_ffn(x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor, w1: Tensor, w2: Tensor,
                       w3: Tensor | None = None, b1: Tensor | None = None, b2: Tensor | None = None,
                       b3: Tensor | None = None, kind: str = "gelu") -> Tensor:
    """`routed_ffn` for one token, its routed experts' weights read in place: its K rows grouped by expert with
    offsets computed on the device, one grouped GEMM per projection (each group one row), then the rows put back
    in choice order and combined as gathered_ffn combines them. One row per group is the gathered per-token
    product's arithmetic (tests/unit/moe/test_experts.py checks it bit for bit), without copying the weights."""
    K = expert_ids_TK.shape[-1]
    if expert_ids_TK.dtype == torch.int64 and all(cpu_gemv.applies(x_TD, w) for w in (w1, w2, w3) if w is not None):
        return combine_choices(_routed_rows(x_TD.reshape(1, -1), expert_ids_TK.reshape(K), w1, w2, w3, b1, b2, b3,
                                            kind).view(*expert_ids_TK.shape, -1), weights_TK)
    sorted_ids, order_K, offs_e = sort_by_expert(expert_ids_TK.reshape(K), w1.shape[0])
    x_KD = x_TD.reshape(1, -1).expand(K, -1).contiguous()  # every choice's row is the token itself
    y_KD = sorted_ffn(x_KD, sorted_ids, offs_e, w1, w2, w3, b1, b2, b3, kind).index_select(0, torch.argsort(order_K))
    return combine_choices(y_KD.view(*expert_ids_TK.shape, -1), weights_TK)


def _routed_rows(x_1D: Tensor, ids_K: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, b1: Tensor | None,
                 b2: Tensor | None, b3: Tensor | None, kind: str) -> Tensor:
    """y_KD of one token's K distinct routed experts in choice order through `cpu_gemv.routed_mm`: the products
    `sorted_ffn` makes (one row per expert), without sorting the choices by expert and back."""
    def proj(a, w, b):
        out = cpu_gemv.routed_mm(a, w, ids_K)
        return out if b is None else out + b.index_select(0, ids_K)

    return _ffn(proj, x_1D, w1, w2, w3, b1, b2, b3, kind)


def _ffn(proj: Callable[[Tensor, W, Tensor | None], Tensor], x: Tensor, w1: W, w2: W, w3: W | None,
         b1: Tensor | None, b2: Tensor | None, b3: Tensor | None, kind: str) -> Tensor:
    """An expert FFN with `proj(a, w, b)` as each projection (product, then bias): gelu(x w1) w2, or swiglu's
    (silu(x w1) * x w3) w2."""
    h = proj(x, w1, b1)
    if kind == "gelu":
        h = F.gelu(h)
    else:
        assert w3 is not None, "a swiglu expert has w3"
        h = F.silu(h) * proj(x, w3, b3)
    return proj(h, w2, b2)


def sort_by_expert(ids_R: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(sorted ids, the order that sorts them, each expert's end offset in int32): rows grouped by expert for a
    grouped GEMM, computed on the device."""
    sorted_ids, order_R = torch.sort(ids_R, stable=True)
    experts = torch.arange(num_experts, device=ids_R.device) if torch.compiler.is_compiling() else \
        _expert_range(num_experts, ids_R.device)  # a compiled step holds the range as a constant
    offs_e = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return sorted_ids, order_R, offs_e


def sorted_ffn(x_RD: Tensor, sorted_ids: Tensor, offs_e: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None = None,
               b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
               kind: str = "gelu") -> Tensor:
    """Each row's expert FFN for rows sorted by expert (`sort_by_expert`), the weights read in place: one grouped
    GEMM per projection, a bias added per row after its product."""
    def proj(a, w, b):
        out = cpu_gemv.grouped_mm(a, w, offs_e)
        return out if b is None else out + b.index_select(0, sorted_ids)

    return _ffn(proj, x_RD, w1, w2, w3, b1, b2, b3, kind)


def gathered_ffn(x_TD: Tensor, weights_TK: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None = None,
                 b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
                 kind: str = "gelu") -> Tensor:
    """`routed_ffn` on weights already gathered per token and choice (w1 [..., K, F, D]: token t's k-th expert's w1
    at [t, k]; w2 [..., K, D, F]; biases [..., K, F] and [..., K, D]), wherever they were gathered from: the same
    operators on the same shapes, so the same result bit for bit. Weights in x's dtype; the combine runs in it
    too, as `LocalDispatcher.combine` does."""
    def proj(a, w, b, spec):
        out = torch.einsum(spec, a, w)
        return out if b is None else out + b

    h_TKF = proj(x_TD, w1, b1, "...d,...kfd->...kf")
    if kind == "gelu":
        h_TKF = F.gelu(h_TKF)
    else:
        h_TKF = F.silu(h_TKF) * proj(x_TD, w3, b3, "...d,...kfd->...kf")
    y_TKD = proj(h_TKF, w2, b2, "...kf,...kdf->...kd")
    return combine_choices(y_TKD, weights_TK)


def combine_choices(y_TKD: Tensor, weights_TK: Tensor) -> Tensor:
    """y_TD = sum over k of weights_TK[t, k] * y_TKD[t, k]: the one combine of every decode form, in fp32 (the
    router's weights; y is promoted to them) and rounded once to y's dtype, written as operators that eager mode and
    a compiled step (inductor) compute alike, so that compiled tokens are eager tokens in bf16 too."""
    weights_TK1 = weights_TK.unsqueeze(-1)
    if weights_TK1.dtype != torch.float32:
        weights_TK1 = weights_TK1.float()
    y_TD = (y_TKD * weights_TK1).sum(dim=-2)
    return y_TD if y_TD.dtype == y_TKD.dtype else y_TD.to(y_TKD.dtype)


def listed_ffn(x_1D: Tensor, experts: Sequence[Mapping[str, Tensor | None]], kind: str = "gelu") -> Tensor | None:
    """y_KD: one token through each of its K routed experts, experts[k] the k-th's weights where they lie (w1, w2, w3;
    no biases): `row_ffn`'s arithmetic for each, one kernel call per projection for all K (`cpu_gemv.listed_mm`).
    None where the kernel does not apply (the caller runs `row_ffn` per expert)."""
    names = ("w1", "w2") if kind == "gelu" else ("w1", "w2", "w3")
    by_name = {n: [w for e in experts if (w := e.get(n)) is not None] for n in names}
    if x_1D.numel() != x_1D.shape[-1] or any(e.get(b) is not None for e in experts for b in ("b1", "b2", "b3")) or \
            not all(len(ws) == len(experts) and all(cpu_gemv.applies(x_1D, w) for w in ws) for ws in by_name.values()):
        return None
    return _ffn(lambda a, w, b: cpu_gemv.listed_mm(a, w), x_1D.reshape(1, -1), by_name["w1"], by_name["w2"],
                by_name.get("w3"), None, None, None, kind)


def row_ffn(x_1D: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None = None, b1: Tensor | None = None,
            b2: Tensor | None = None, b3: Tensor | None = None, kind: str = "gelu") -> Tensor:
    """One token's FFN through one expert whose weights are given where they lie (a mapped file, a slot): the
    arithmetic of gathered_ffn's per-token product (a one-row product, then the bias), with no copy."""
    def proj(a, w, b):
        out = cpu_gemv.linear(a, w)
        return out if b is None else out + b

    return _ffn(proj, x_1D, w1, w2, w3, b1, b2, b3, kind)
