"""The next token from a step's logits, with OpenAI's sampling settings: `logit_bias` added to the logits, presence
and frequency penalties over the tokens generated so far, then greedy, or temperature, top-k and nucleus (top-p)
sampling. Everything runs on the device (no host read), so the static decode step stays free of host syncs.

Legend: B rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.inference.errors import InferError

MAX_LOGIT_BIAS = 100.0
"""A logit bias lies in -100..100 (OpenAI's bound): -100 bans a token, 100 all but forces it."""
MAX_PENALTY = 2.0
"""Presence and frequency penalties lie in -2..2 (OpenAI's bound)."""


@dataclass(frozen=True)
class Sampling:
    """How a generation picks each token (the fields of `infer.*` and of an OpenAI request)."""

    temperature: float = 0.0
    """0 is greedy (the most likely token after logit_bias and the penalties)."""
    top_k: int = 0
    """Sample from the k most likely tokens; 0 means all."""
    top_p: float = 1.0
    """Nucleus sampling: the most likely tokens whose probabilities first add up to top_p; 1 means all."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token generated at least once."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it has been generated."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits."""

    @classmethod
    def of(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, presence_penalty: float = 0.0,
           frequency_penalty: float = 0.0,
           logit_bias: Mapping[int, float] | Mapping[str, float] | Mapping[int | str, float] | None = None) -> Sampling:
        """Settings whose logit_bias is a mapping of token ids (ints, or their decimal strings as JSON keys)."""
        bias = tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items()))
        return cls(float(temperature), int(top_k), float(top_p), float(presence_penalty), float(frequency_penalty),
                   bias)

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def sample_next(logits_BV: Tensor, temperature: float, top_k: int, generator: torch.Generator | None,
                top_p: float = 1.0) -> Tensor:
    """Next ids [B], on the device: argmax when temperature is 0, else a draw from softmax(logits / temperature)
    over the top k, then over the nucleus of top_p. The draw is torch.multinomial's own for one sample (argmax of
    probs / Exp(1) noise from the same generator: the same ids) without its validity checks, which read the
    probabilities on the host."""
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = warped_logits(logits_BV, temperature, top_k, top_p).softmax(dim=-1)
    return probs_BV.div_(torch.empty_like(probs_BV).exponential_(1, generator=generator)).argmax(dim=-1)


def warped_logits(logits_BV: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """fp32 logits / temperature, -inf outside the top k, then -inf outside the nucleus: keeping the most likely
    tokens while the probability of those more likely than each is below top_p (so at least one is kept)."""
    logits_BV = logits_BV.float() / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True, stable=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        beyond_BV = (probs_BV.cumsum(dim=-1) - probs_BV) >= top_p
        logits_BV = logits_BV.masked_fill(beyond_BV.scatter(-1, order_BV, beyond_BV), float("-inf"))
    return logits_BV


class Sampler:
    """One generation's sampling state on the device: its generator (seeded; none when greedy), the logit bias as
    a [V] vector and, with a penalty, each row's counts of the tokens it has generated. `begin(rows)` before each
    batch of rows; then calling it with a step's logits gives the step's ids and counts them."""

    def __init__(self, sampling: Sampling, vocab_size: int, device: torch.device, seed: int = 0):
        self.sampling = sampling
        self.generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(seed)
        self.bias_V: Tensor | None = None
        if sampling.logit_bias:
            ids, biases = zip(*sampling.logit_bias, strict=True)
            if not all(0 <= t < vocab_size for t in ids):
                bad = next(t for t in ids if not 0 <= t < vocab_size)
                raise InferError(f"logit_bias token id {bad} is outside the vocabulary 0..{vocab_size - 1}")
            self.bias_V = torch.zeros(vocab_size, device=device).index_put_(
                (torch.tensor(ids, device=device),), torch.tensor(biases, device=device))
        self.vocab_size, self.device = vocab_size, device
        self.counts_BV: Tensor | None = None

    def begin(self, rows: int) -> None:
        """A new batch of `rows` sequences, none of whose tokens has been generated yet."""
        self.counts_BV = torch.zeros(rows, self.vocab_size, device=self.device) if self.sampling.penalised else None

    def adjusted(self, logits_BV: Tensor) -> Tensor:
        """OpenAI's `logits[j] + bias[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty` (fp32), c[j]
        the times the row has generated token j; the logits themselves when no setting changes them."""
        s = self.sampling
        if self.bias_V is None and self.counts_BV is None:
            return logits_BV
        logits_BV = logits_BV.float()
        if self.bias_V is not None:
            logits_BV = logits_BV + self.bias_V
        if self.counts_BV is not None:
            logits_BV = (logits_BV - self.counts_BV * s.frequency_penalty
                         - (self.counts_BV > 0).float() * s.presence_penalty)
        return logits_BV

    def __call__(self, logits_BV: Tensor) -> Tensor:
        s = self.sampling
        ids_B = sample_next(self.adjusted(logits_BV), s.temperature, s.top_k, self.generator, s.top_p)
        if self.counts_BV is not None:
            self.counts_BV.scatter_add_(1, ids_B[:, None], torch.ones_like(self.counts_BV[:, :1]))
        return ids_B
