"""Continuous batching: sequences join and leave a shared decode batch at token granularity, each in its own row
of one static KV cache. A sequence joins by a prefill of its prompt alone (as `generate` runs it), then takes a
row; every step decodes all rows at once with `decode_rows`, whose rows are computed as lone decode steps are,
and samples each row with its own generator: each sequence's tokens are its lone run's (`moesys infer`). With a
compiled step (`BatchDecodeStep`: CUDA graphs per batch-size bucket on a GPU) the rows share one product per weight
instead: greedy tokens agree with the lone run's, bit for bit where the kernels are batch-invariant."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from runtime.inference.decode import CACHE_BUCKET, BatchDecodeStep
from runtime.inference.generate import sample_next
from runtime.inference.offload import Offloader
from runtime.inference.rows import decode_rows
from runtime.model.attention import StaticKVCache
from runtime.model.transformer import Transformer


def _bucket(positions: int) -> int:
    return -(-positions // CACHE_BUCKET) * CACHE_BUCKET


@dataclass
class TokenOut:
    """One new token, with its log-probability and the `top` most likely alternatives (when asked)."""

    token: int
    logprob: Optional[float] = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    """One sequence being generated: prompt, sampling settings, and its tokens so far."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    logprobs: Optional[int] = None
    """None: no log-probabilities; N >= 0: the chosen token's and the N most likely alternatives'."""
    tokens: list[int] = field(default_factory=list)
    generator: Optional[torch.Generator] = None

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


class ContinuousBatch:
    """Up to `max_rows` sequences decoding together; rows 0..len(rows)-1 of the cache are in use."""

    def __init__(self, model: Transformer, max_rows: int, offloader: Optional[Offloader] = None,
                 step: Optional[BatchDecodeStep] = None):
        """step: decode the rows with this (compiled) step, its bucket's CUDA graphs on CUDA, rather than with
        `decode_rows`, whose rows are lone steps' bit for bit."""
        self.model, self.max_rows, self.offloader, self.decode_step = model, max_rows, offloader, step
        self.device = model.tok_embeddings.weight.device
        self.rows: list[Sequence] = []
        self.steps = 0
        self._cache: Optional[StaticKVCache] = None

    @property
    def free(self) -> int:
        return self.max_rows - len(self.rows)

    def _batch_cache(self) -> StaticKVCache:
        if self._cache is None:
            self._cache = self.model.new_static_cache(self.max_rows, _bucket(self.model.cfg.max_seq_len))
        return self._cache

    @torch.no_grad()
    def join(self, seq: Sequence) -> TokenOut:
        """Prefill `seq` alone (a cache of the size its lone run uses), take the next row, return its first token."""
        if not self.free:
            raise RuntimeError("no free row in the batch")
        length = len(seq.prompt_ids)
        if seq.temperature > 0:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.seed)
        if self.offloader is not None:
            if not self.rows:  # its timeline would otherwise grow with every forward for the server's life
                self.offloader.reset_stats()
            self.offloader.reset()
        alone = self.model.new_static_cache(1, seq.span)
        tokens = torch.tensor([seq.prompt_ids], dtype=torch.long, device=self.device)
        logits_1V = self.model.prefill(tokens, alone)
        cache, row = self._batch_cache(), len(self.rows)
        for mine, its in zip(cache.keys + cache.values, alone.keys + alone.values):
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

    def leave(self, seq: Sequence) -> None:
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
        """Sample the row's next token as a lone run does (its own generator), and its log-probabilities."""
        token = int(sample_next(logits_1V, seq.temperature, seq.top_k, seq.generator)[0])
        seq.tokens.append(token)
        out = TokenOut(token)
        if seq.logprobs is not None:
            logp_V = torch.log_softmax(logits_1V[0].float(), dim=-1)
            out.logprob = float(logp_V[token])
            if seq.logprobs > 0:
                values, ids = logp_V.topk(seq.logprobs)
                out.top = list(zip(ids.tolist(), values.tolist()))
        return out
