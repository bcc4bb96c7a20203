"""Generation with a KV cache: greedy or sampled (runtime/inference/sampling.py), several prompts per batch,
prefill and decode timed apart, each prompt ending at a stop token (the tokenizer's eos) or its length;
`run_inference` is what `moesys infer` calls (load, offload as the paper's "Ring Memory Offloading" and its
successors, generate).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from runtime.host.memory_probe import PeakMemory, disk_read_bytes
from runtime.inference.decode import DecodeStep, compile_default
from runtime.inference.errors import InferError
from runtime.inference.load import resolve_infer_config
from runtime.inference.offload import Offloader
from runtime.inference.offloaders import open_for_inference
from runtime.inference.sampling import Sampler, Sampling
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param


@dataclass
class Generation:
    """New token ids per prompt (prompt order), timings and, when asked, the logits of every new token."""

    tokens: list[list[int]]
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    kv_cache_bytes: int = 0
    logits: list[Tensor] = field(default_factory=list)
    """Per prompt [max_new_tokens, V] (fp32, CPU), only with keep_logits."""

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def check_prompts(prompts: list[list[int]], max_new_tokens: int, vocab_size: int, max_seq_len: int) -> None:
    """One-line InferError for an empty batch, an empty prompt, an id outside the vocab or too long a sequence."""
    if not prompts:
        raise InferError('no prompt: give prompt="..." or infer.prompt_ids=[1,2,3]')
    if max_new_tokens < 1:
        raise InferError(f"infer.max_new_tokens must be positive (got {max_new_tokens})")
    for ids in prompts:
        if not ids:
            raise InferError("a prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InferError(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
        if len(ids) + max_new_tokens > max_seq_len:
            raise InferError(f"prompt of {len(ids)} tokens + infer.max_new_tokens={max_new_tokens} exceeds "
                             f"model.max_seq_len={max_seq_len}; shorten the prompt or generate fewer tokens")


STOP_CHECK_EVERY = 8
"""Decode steps between two looks (one host read) at whether every row of a batch has made a stop token: a batch
that has ends at most this many steps later, and the tokens past each row's stop are dropped."""


def until_stop(ids: list[int], stop_ids: Sequence[int]) -> list[int]:
    """`ids` up to and including the first stop id (as transformers' generate gives them)."""
    for n, token in enumerate(ids):
        if token in stop_ids:
            return ids[:n + 1]
    return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, offloader: Offloader | None = None,
             keep_logits: bool = False, on_token: Callable[[list[int], Tensor], None] | None = None,
             step: DecodeStep | None = None, sampling: Sampling | None = None,
             stop_ids: Sequence[int] = ()) -> Generation:
    """Prompts of equal length run as one batch (no padding: a row never sees another row's tokens, though its
    logits may differ from a lone run's by float rounding, which can flip a greedy near-tie); each batch is one
    prefill forward into a static KV cache, then up to max_new_tokens - 1 decode steps (`step`, eager when not
    given; pass one to reuse its cache and compiled code across calls), none of which reads the device on the host
    but every STOP_CHECK_EVERY-th when `stop_ids` are given: a prompt's tokens end with the first of them.

    on_token(members, ids_B), when given, sees each step's new ids (on the device) of the batch made of
    prompts[members], between forwards: a streaming server sends them on, and an exception it raises stops the
    generation there (its client has gone) without leaving a forward half done.

    sampling, when given, is every setting (top_p, penalties, logit_bias too) and temperature and top_k are not
    read; the seed seeds one generator for all the prompts."""
    cfg = model.cfg
    check_prompts(prompts, max_new_tokens, cfg.vocab_size, cfg.max_seq_len)
    device = model.tok_embeddings.weight.device
    step = step if step is not None else DecodeStep(model)
    sampler = Sampler(sampling or Sampling(temperature, top_k), cfg.vocab_size, device, seed)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device) if stop_ids else None
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    out = Generation(tokens=[[] for _ in prompts])
    logits_of: list[list[Tensor]] = [[] for _ in prompts]
    for length, members in by_length.items():
        if offloader is not None:
            offloader.reset()
        tokens_BS = torch.tensor([prompts[i] for i in members], dtype=torch.long, device=device)
        sampler.begin(len(members))
        cache = step.cache_for(len(members), length + max_new_tokens)
        positions = torch.arange(length, length + max_new_tokens, device=device)
        new: list[Tensor] = []
        stopped_B = torch.zeros(len(members), dtype=torch.bool, device=device)
        _sync(device)
        began = time.perf_counter()
        for n in range(max_new_tokens):
            if stops is not None and n % STOP_CHECK_EVERY == 0 and n and bool(stopped_B.all()):
                break
            if n == 0:
                logits_BV = step.prefill(tokens_BS, cache)
            elif offloader is not None:
                with offloader.computing():
                    logits_BV = step(new[-1][:, None], positions[n - 1:n], cache)
            else:
                logits_BV = step(new[-1][:, None], positions[n - 1:n], cache)
            new.append(sampler(logits_BV))
            if stops is not None:
                stopped_B |= torch.isin(new[-1], stops)
            if on_token is not None:
                on_token(members, new[-1])
            if keep_logits:
                for row, i in enumerate(members):
                    logits_of[i].append(logits_BV[row].float().cpu())
            if n == 0:
                _sync(device)
                now = time.perf_counter()
                out.prefill_s += now - began
                out.prefill_tokens += tokens_BS.numel()
                began = now
        _sync(device)
        out.decode_s += time.perf_counter() - began
        out.decode_tokens += len(members) * (len(new) - 1)
        out.kv_cache_bytes = max(out.kv_cache_bytes, sum(t.numel() * t.element_size()
                                                         for t in cache.keys + cache.values if t is not None))
        ids_BN = torch.stack(new, dim=1).cpu()
        for row, i in enumerate(members):
            out.tokens[i] = until_stop(ids_BN[row].tolist(), stop_ids)
    if keep_logits:
        out.logits = [torch.stack(rows[:len(tokens)]) for rows, tokens in zip(logits_of, out.tokens, strict=True)]
    return out


def infer_sampling(inf: Any) -> Sampling:
    """The sampling settings of an infer config section."""
    return Sampling.of(inf.temperature, inf.top_k, inf.top_p, inf.presence_penalty, inf.frequency_penalty,
                       inf.logit_bias)


def _prompt_ids(loaded, cfg, prompts: list[str] | None, prompt_ids: list[list[int]] | None) -> list[list[int]]:
    texts = list(prompts or []) or ([cfg.infer.prompt] if cfg.infer.prompt is not None else [])
    ids = [list(p) for p in (prompt_ids or [])] or ([list(cfg.infer.prompt_ids)] if cfg.infer.prompt_ids else [])
    if texts and loaded.tokenizer is None:
        raise InferError(f"checkpoint={loaded.path} has no tokenizer; give the prompt as ids: infer.prompt_ids=[1,2,3]")
    return [loaded.tokenizer.encode(t) for t in texts] + ids


def run_inference(checkpoint: str | Path, infer_overrides: dict[str, Any] | None = None,
                  prompts: list[str] | None = None, prompt_ids: list[list[int]] | None = None,
                  offload: str | None = None, device: str | torch.device | None = None,
                  cache_dir: Path | None = None) -> dict[str, Any]:
    """Open a checkpoint (streamed: experts are read where they lie), apply infer.* overrides (offload overrides
    infer.offload), place the experts, generate; a JSON-ready dict of tokens, speed, memory and bytes moved."""
    with PeakMemory() as host_peak:
        opened = open_for_inference(checkpoint, resolve_infer_config, infer_overrides, offload, device)
        loaded, cfg, device = opened.loaded, opened.cfg, opened.device
        inf = cfg.infer
        ids = _prompt_ids(loaded, cfg, prompts, prompt_ids)
        check_prompts(ids, inf.max_new_tokens, cfg.model.vocab_size, cfg.model.max_seq_len)
        model = loaded.model
        dense_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not is_expert_param(n))
        offloader = opened.place(cache_dir)
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            read_before = disk_read_bytes()
            step = DecodeStep(model, compile=compile_default(device) if inf.compile is None else inf.compile)
            gen = generate(model, ids, inf.max_new_tokens, seed=inf.seed, offloader=offloader, step=step,
                           sampling=infer_sampling(inf), stop_ids=loaded.stop_ids)
            disk_read = disk_read_bytes() - read_before
            stats = offloader.stats()
        finally:
            offloader.close()
    new_tokens = sum(len(t) for t in gen.tokens)
    per_token = (lambda n: n / new_tokens) if new_tokens else (lambda n: 0.0)
    device_peak = {"dense": dense_bytes, "experts": stats["expert_device_bytes"], "kv_cache": gen.kv_cache_bytes}
    device_peak["total"] = sum(device_peak.values())
    if device.type == "cuda":
        device_peak["allocated_peak"] = torch.cuda.max_memory_allocated(device)
    tok = loaded.tokenizer
    return {
        "checkpoint": str(loaded.path), "kind": loaded.kind, "device": str(device), "offload": inf.offload,
        "ring_slots": inf.ring_slots if offloader.budget_slots is not None else None, "moe_layers": stats["moe_layers"],
        "compiled": step.compiled,
        "placement": stats["placement"],
        "prompt_tokens": ids, "tokens": gen.tokens,
        "text": [tok.decode(t[:-1] if t and t[-1] in loaded.stop_ids else t) for t in gen.tokens]
                if tok is not None else None,
        "stop_token_ids": list(loaded.stop_ids),
        "prefill_tokens_per_s": gen.prefill_tokens_per_s, "decode_tokens_per_s": gen.decode_tokens_per_s,
        "prefill_tokens": gen.prefill_tokens, "decode_tokens": gen.decode_tokens,
        "peak_bytes": {"device": device_peak, "host": {"experts": stats["expert_host_bytes"]}},
        "peak_rss_anon_bytes": host_peak.peak,
        "copied_bytes": stats["copied_bytes"],
        "copied_bytes_per_token": per_token(stats["copied_bytes"]),
        "store_bytes_per_token": per_token(stats["store_bytes"]),
        "disk_read_bytes_per_token": per_token(disk_read),
        "page_cache_bytes_per_token": per_token(max(0, stats["store_bytes"] - disk_read)),
        "copy_s": stats["copy_s"], "copy_hidden_share": stats["copy_hidden_share"],
        "timeline": stats["timeline"],  # spans of copy/compute/wait of the last decoded token (moesys report)
        **offloader.mode_fields(stats),
    }
