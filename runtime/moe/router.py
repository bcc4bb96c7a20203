"""Top-k gating in fp32 (Switch k=1, GShard k=2) with the ORT MoE gating utilities: multiplicative jitter,
input dropout and Gumbel-max sampling (ORT MoE "Gating Utilities"; Switch Transformers section 2.2), and a score
bias that moves the choice but not the weights (ERNIE-4.5's score correction; DeepSeek-V3's auxiliary-loss-free
balancing, section 2.1.2).

Legend: T tokens, D model dim, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.config import ModelConfig


@dataclass(frozen=True)
class Routing:
    """One routing decision. Column 0 of the [T, K] tensors is each token's first choice."""

    expert_ids_TK: Tensor
    """Chosen experts (int64), distinct within a row."""
    weights_TK: Tensor
    """Combine weights (fp32, differentiable): softmax over all experts gathered at the choice, renormalised
    to sum 1 when normalize_top_k."""
    probs_TE: Tensor
    """Softmax over all experts (fp32, differentiable)."""
    logits_TE: Tensor
    """Router logits (fp32, differentiable), without the Gumbel noise used for selection."""

    @property
    def num_tokens(self) -> int:
        return self.expert_ids_TK.shape[0]

    @property
    def top_k(self) -> int:
        return self.expert_ids_TK.shape[1]

    @property
    def num_experts(self) -> int:
        return self.probs_TE.shape[1]


def expert_counts(expert_ids: Tensor, num_experts: int) -> Tensor:
    """int64 [num_experts]: how many of `expert_ids` (any shape, values in [0, num_experts)) name each expert.
    torch.bincount on a GPU reads the largest id back to size its output, a host synchronisation per call; a
    scatter-add into a fixed size does not."""
    ids = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids.long(), torch.ones_like(ids, dtype=torch.int64))


def gumbel_like(t: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Standard Gumbel noise -log(-log U) with the shape of t."""
    u = torch.rand(t.shape, dtype=t.dtype, device=t.device, generator=generator)
    tiny = torch.finfo(t.dtype).tiny
    exp_noise = -torch.log(u.clamp_min(tiny))
    return -torch.log(exp_noise.clamp_min(tiny))


def select_top_k(logits_TE: Tensor, k: int, gumbel: bool = False,
                 generator: torch.Generator | None = None) -> Tensor:
    """Experts chosen per token. With gumbel, the first choice stays the argmax and the 2nd..k-th are drawn
    without replacement from the softmax of the remaining experts (Gumbel-top-k trick, as GShard samples its
    second expert); the noise only affects the selection, never the weights."""
    if not gumbel or k == 1:
        return torch.topk(logits_TE, k, dim=-1, sorted=True).indices
    first_T1 = logits_TE.argmax(dim=-1, keepdim=True)
    noisy_TE = logits_TE + gumbel_like(logits_TE, generator)
    noisy_TE = noisy_TE.scatter(1, first_T1, float("-inf"))
    rest_TK = torch.topk(noisy_TE, k - 1, dim=-1, sorted=True).indices
    return torch.cat([first_T1, rest_TK], dim=1)


def routing_weights(probs_TE: Tensor, expert_ids_TK: Tensor, normalize: bool) -> Tensor:
    """Mixtral semantics: softmax over all experts, gather the chosen ones, divide by their sum."""
    weights_TK = probs_TE.gather(-1, expert_ids_TK)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK


def _fp32(t: Tensor) -> Tensor:
    """t in fp32, without an operator when it already is (a decode token counts them)."""
    return t if t.dtype == torch.float32 else t.float()


class Router(nn.Module):
    """Linear gate D -> E (no bias) computed in fp32 whatever the input dtype; with cfg.router_score_bias, experts
    are chosen by softmax + score_bias [E] (a parameter without gradient) and weighted by the softmax alone."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.jitter = cfg.router_jitter
        self.input_dropout = cfg.router_input_dropout
        self.gumbel = cfg.router_gumbel
        self.normalize_top_k = cfg.normalize_top_k
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.score_bias = (nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
                           if cfg.router_score_bias else None)

    def choose(self, logits_TE: Tensor, probs_TE: Tensor, gumbel: bool = False,
               generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """(expert_ids_TK, weights_TK) from a token's logits and softmax: the top-k of the logits (of the
        probabilities plus score_bias when there is one), weighted by their probabilities."""
        with torch.no_grad():
            scores_TE = logits_TE if self.score_bias is None else probs_TE + _fp32(self.score_bias)
            expert_ids_TK = select_top_k(scores_TE, self.top_k, gumbel, generator)
        return expert_ids_TK, routing_weights(probs_TE, expert_ids_TK, self.normalize_top_k)

    def forward(self, x_TD: Tensor, generator: torch.Generator | None = None) -> Routing:
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            x_TD = _fp32(x_TD)
            if self.training and self.jitter > 0:
                u_TD = torch.rand(x_TD.shape, device=x_TD.device, generator=generator)
                x_TD = x_TD * (1.0 - self.jitter + 2.0 * self.jitter * u_TD)
            if self.training and self.input_dropout > 0:
                if generator is None:
                    x_TD = F.dropout(x_TD, self.input_dropout, training=True)
                else:  # F.dropout takes no generator: build the same mask from it
                    keep = torch.rand(x_TD.shape, device=x_TD.device, generator=generator) >= self.input_dropout
                    x_TD = x_TD * keep / (1.0 - self.input_dropout)
            logits_TE = F.linear(x_TD, _fp32(self.gate.weight))
            probs_TE = torch.softmax(logits_TE, dim=-1)
            expert_ids_TK, weights_TK = self.choose(logits_TE, probs_TE, self.training and self.gumbel, generator)
        return Routing(expert_ids_TK, weights_TK, probs_TE, logits_TE)
