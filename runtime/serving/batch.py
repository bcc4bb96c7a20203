"""Continuous batching: sequences join and leave a shared decode batch at token granularity, each in its own row
of one static KV cache. A sequence joins by a prefill of its prompt alone (as `generate` runs it), then takes a
row; every step decodes all rows at once with `decode_rows`, whose rows are computed as lone decode steps are,
and samples each row with its own sampler: each sequence's tokens are its lone run's (`moesys infer`). With a
compiled step (`BatchDecodeStep`: CUDA graphs per batch-size bucket on a GPU) the rows share one product per weight
instead: greedy tokens agree with the lone run's, bit for bit where the kernels are batch-invariant. A sequence may
also score its prompt (echo): the prefill's logits at every position give each prompt token's log-probability; one
that generates nothing leaves after its prefill without taking a row."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from torch import Tensor

from runtime.inference.decode import CACHE_BUCKET, BatchDecodeStep
from runtime.inference.offload import Offloader
from runtime.inference.rows import decode_rows
from runtime.inference.sampling import Sampler, Sampling
from runtime.model.attention import StaticKVCache
from runtime.model.transformer import Transformer


def _bucket(positions: int) -> int:
    return -(-positions // CACHE_BUCKET) * CACHE_BUCKET


@dataclass
class TokenOut:
    """One token, with its log-probability and the `top` most likely alternatives (when asked)."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    """One sequence being generated: prompt, sampling settings, and its tokens so far."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0
    logprobs: int | None = None
    """None: no log-probabilities; N >= 0: the chosen token's and the N most likely alternatives'."""
    scored: bool = False
    """Each token's log-probability even without `logprobs` (best_of ranks sequences by their sum)."""
    echo: bool = False
    """Score the prompt too (`prompt_outs`), with `logprobs` alternatives per token."""
    tokens: list[int] = field(default_factory=list)
    prompt_outs: list[TokenOut] = field(default_factory=list)
    """With echo: prompt tokens 1.. as TokenOuts (nothing predicts token 0)."""
    sampler: Sampler | None = None

    @property
    def position(self) -> int:
        """Where the last token goes in the cache (the next decode step's input position)."""
        return len(self.prompt_ids) + len(self.tokens) - 1

    @property
    def span(self) -> int:
        """The cache size of this sequence's lone run (`DecodeStep.cache_for`): the slots its attention covers."""
        return _bucket(len(self.prompt_ids) + self.max_tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.max_tokens


S = TypeVar("S", bound=Sequence)


class ContinuousBatch(Generic[S]):
    """Up to `max_rows` sequences decoding together; rows 0..len(rows)-1 of the cache are in use. S: the caller's
    sequence type (a Sequence carrying what the caller needs back with each row)."""

    def __init__(self, model: Transformer, max_rows: int, offloader: Offloader | None = None,
                 step: BatchDecodeStep | None = None):
        """step: decode the rows with this (compiled) step, its bucket's CUDA graphs on CUDA, rather than with
        `decode_rows`, whose rows are lone steps' bit for bit."""
        self.model, self.max_rows, self.offloader, self.decode_step = model, max_rows, offloader, step
        self.device = model.tok_embeddings.weight.device
        self.rows: list[S] = []
        self.steps = 0
        self._cache: StaticKVCache | None = None

    @property
    def free(self) -> int:
        return self.max_rows - len(self.rows)

    def _batch_cache(self) -> StaticKVCache:
        if self._cache is None:
            self._cache = self.model.new_static_cache(self.max_rows, _bucket(self.model.cfg.max_seq_len))
        return self._cache

    @torch.no_grad()
    def join(self, seq: S) -> TokenOut | None:
        """Prefill `seq` alone (a cache of the size its lone run uses), score its prompt when it echoes, and take
        the next row and return its first token; None for a sequence that generates nothing (it takes no row)."""
        if not self.free and seq.max_tokens:
            raise RuntimeError("no free row in the batch")
        length = len(seq.prompt_ids)
        seq.sampler = Sampler(seq.sampling, self.model.cfg.vocab_size, self.device, seq.seed)
        seq.sampler.begin(1)
        if self.offloader is not None:
            if not self.rows:  # its timeline would otherwise grow with every forward for the server's life
                self.offloader.reset_stats()
            self.offloader.reset()
        alone = self.model.new_static_cache(1, seq.span)
        tokens = torch.tensor([seq.prompt_ids], dtype=torch.long, device=self.device)
        if seq.echo:
            logits_SV = self.model(tokens, alone, 0, moe_stats=False).logits[0]
            seq.prompt_outs = _scored(logits_SV[:-1], seq.prompt_ids[1:], seq.logprobs or 0)
            logits_1V = logits_SV[-1:]
        else:
            logits_1V = self.model.prefill(tokens, alone)
        if not seq.max_tokens:
            return None
        cache, row = self._batch_cache(), len(self.rows)
        for mine, its in zip(cache.keys + cache.values, alone.keys + alone.values, strict=True):
            mine[row, :, :length] = its[0, :, :length]
        self.rows.append(seq)
        return self._take(seq, logits_1V)

    @torch.no_grad()
    def step(self) -> list[TokenOut]:
        """One decode step of every row; the new token of each row, in row order."""
        tokens_B = torch.tensor([s.tokens[-1] for s in self.rows], dtype=torch.long, device=self.device)
        pos_B = torch.tensor([s.position for s in self.rows], dtype=torch.long, device=self.device)
        spans = [s.span for s in self.rows]
        with self.offloader.computing() if self.offloader is not None else contextlib.nullcontext():
            if self.decode_step is not None:
                logits_BV = self.decode_step.rows(tokens_B, pos_B, self._batch_cache())
            else:
                logits_BV = decode_rows(self.model, tokens_B, pos_B, self._batch_cache(), spans)
        self.steps += 1
        return [self._take(seq, logits_BV[b:b + 1]) for b, seq in enumerate(list(self.rows))]

    def leave(self, seq: S) -> None:
        """Free `seq`'s row: the last row moves into it, so rows in use stay 0..n-1."""
        row, last = self.rows.index(seq), len(self.rows) - 1
        if row != last:
            cache = self._batch_cache()
            for buf in cache.keys + cache.values:
                buf[row] = buf[last]
            self.rows[row] = self.rows[last]
        self.rows.pop()

    def clear(self) -> None:
        self.rows = []

    def _take(self, seq: Sequence, logits_1V: Tensor) -> TokenOut:
        """Sample the row's next token as a lone run does (its own sampler), and its log-probabilities: the model's,
        before any sampling setting."""
        assert seq.sampler is not None, "a sequence samples only after join() gave it its sampler"
        token = int(seq.sampler(logits_1V)[0])
        seq.tokens.append(token)
        if seq.logprobs is None and not seq.scored:
            return TokenOut(token)
        return _scored(logits_1V, [token], seq.logprobs or 0)[0]


def _scored(logits_SV: Tensor, tokens: list[int], top: int) -> list[TokenOut]:
    """Token s's log-probability under logits_SV[s] and the `top` most likely tokens there, for each s."""
    logp_SV = torch.log_softmax(logits_SV.float(), dim=-1)
    ids_S1 = torch.tensor(tokens, dtype=torch.long, device=logp_SV.device)[:, None]
    chosen = logp_SV.gather(1, ids_S1)[:, 0].tolist()
    if not top:
        return [TokenOut(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    values, ids = logp_SV.topk(top, dim=-1)
    return [TokenOut(t, lp, list(zip(i, v, strict=True)))
            for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)]
