"""Held-out evaluation, as Megatron-LM and torchtitan report validation loss: the mean next-token cross-entropy and
its perplexity over the first windows of held-out data (train.eval_data every train.eval_every steps while training;
`moesys eval` for any run or export). Windows are those of the data in file order, not overlapping, so the same
checkpoint and data give the same number in both; the ranks of a job split them and each reads its own.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.config import MoesysConfig, config_from_dict
from runtime.data.chat_data import IGNORE, ChatDataset
from runtime.data.chat_records import is_chat
from runtime.data.chat_source import open_chat_dataset
from runtime.data.dataset import TokenDataset, open_dataset
from runtime.data.generation_facts import hf_facts
from runtime.data.pretokenize import read_tokens
from runtime.data.text import DataError, is_token_file
from runtime.data.token_file import open_token_file
from runtime.data.tokenizer import Tokenizer, load_tokenizer, run_tokenizer
from runtime.files.paths import TOKENIZER_FILE
from runtime.parallel.groups import ParallelGroups, build_groups

Evaluate = Callable[[int, nn.Module, contextlib.AbstractContextManager], dict]
"""evaluate(step, model, autocast): the step line's eval_* fields at an evaluation step, {} at any other."""


def window_count(data: TokenDataset, limit: int) -> int:
    """Windows evaluated: the first `limit` of the data (0: all of them)."""
    return data.num_windows if limit <= 0 else min(limit, data.num_windows)


@torch.no_grad()
def heldout_sums(model: nn.Module, data: TokenDataset, count: int, groups: ParallelGroups, micro_batch_size: int,
                 device: torch.device, autocast: contextlib.AbstractContextManager | None = None) -> tuple[float, int]:
    """(summed next-token loss, target tokens) over windows 0 .. count - 1, all ranks together (collective). Rank r
    takes rows r * mbs .. of each group of world x mbs windows; every rank runs the same number of forwards on
    batches of the same shape (rows past `count` are padding, weighted 0), as expert parallelism's AlltoAlls need."""
    world, mbs = groups.world_size, micro_batch_size
    totals = torch.zeros(2, dtype=torch.float64)
    training = model.training
    model.eval()  # no router noise or dropout, and no draw from the generators a resumed run restores
    try:
        for first in range(0, count, world * mbs):
            index = [first + groups.rank * mbs + j for j in range(mbs)]
            real = torch.tensor([i < count for i in index])
            seqs = data.stack([data.window_at(i if i < count else 0) for i in index]).to(device)
            with autocast or contextlib.nullcontext():
                logits = model(seqs[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), seqs[:, 1:].flatten(), reduction="none")
            kept = loss.view(mbs, -1).sum(dim=1).cpu().double()[real]
            totals += torch.stack([kept.sum(), torch.tensor(float(real.sum()) * data.seq_len, dtype=torch.float64)])
    finally:
        model.train(training)
    if world > 1:
        dist.all_reduce(totals)
    return float(totals[0]), int(totals[1])


@torch.no_grad()
def chat_heldout_sums(model: nn.Module, data: ChatDataset, count: int, groups: ParallelGroups, micro_batch_size: int,
                      device: torch.device,
                      autocast: contextlib.AbstractContextManager | None = None) -> tuple[float, int]:
    """heldout_sums over chat rows 0 .. count - 1 (file order): the summed loss of the assistant's tokens and their
    count, all ranks together (collective); rows past `count` are padding whose targets count nothing."""
    world, mbs = groups.world_size, micro_batch_size
    totals = torch.zeros(2, dtype=torch.float64)
    training = model.training
    model.eval()
    try:
        for first in range(0, count, world * mbs):
            index = [first + groups.rank * mbs + j for j in range(mbs)]
            batch = data.batch([i if i < count else 0 for i in index])
            batch.targets[torch.tensor([i >= count for i in index])] = IGNORE
            batch = batch.to(device)
            with autocast or contextlib.nullcontext():
                logits = model(batch.inputs, positions=batch.positions, segments=batch.segments).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE,
                                   reduction="sum")
            totals += torch.tensor([float(loss), float(batch.target_count)], dtype=torch.float64)
    finally:
        model.train(training)
    if world > 1:
        dist.all_reduce(totals)
    return float(totals[0]), int(totals[1])


def summary(loss_sum: float, tokens: int) -> dict:
    """loss (mean nats per token), perplexity and tokens; perplexity is inf past exp's range."""
    loss = loss_sum / tokens
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf, "tokens": tokens}


def evaluation(cfg: MoesysConfig, groups: ParallelGroups, device: torch.device) -> Evaluate:
    """The loop's evaluation of train.eval_data: every train.eval_every steps and at train.max_steps."""
    tr = cfg.train
    if not tr.eval_data:
        return lambda step, model, autocast: {}
    sums: Callable[[nn.Module, contextlib.AbstractContextManager], tuple[float, int]]
    if is_chat(tr.eval_data, tr.data_format):  # the assistant's tokens of the first rows, in file order
        chat = open_chat_dataset(cfg, run_tokenizer(cfg), "train.eval_data", tr.eval_data)
        rows = min(tr.eval_windows or chat.num_rows, chat.num_rows)
        sums = partial(_chat_sums, chat, rows, groups, tr.micro_batch_size, device)
    else:
        text = open_dataset(cfg, run_tokenizer(cfg), "train.eval_data", tr.eval_data)
        sums = partial(_text_sums, text, window_count(text, tr.eval_windows), groups, tr.micro_batch_size, device)

    def evaluate(step: int, model: nn.Module, autocast: contextlib.AbstractContextManager) -> dict:
        if step != tr.max_steps and not (tr.eval_every and step % tr.eval_every == 0):
            return {}
        result = summary(*sums(model, autocast))
        return {f"eval_{key}": value for key, value in result.items()}

    return evaluate


def _chat_sums(data: ChatDataset, count: int, groups: ParallelGroups, micro_batch_size: int, device: torch.device,
               model: nn.Module, autocast: contextlib.AbstractContextManager) -> tuple[float, int]:
    return chat_heldout_sums(model, data, count, groups, micro_batch_size, device, autocast)


def _text_sums(data: TokenDataset, count: int, groups: ParallelGroups, micro_batch_size: int, device: torch.device,
               model: nn.Module, autocast: contextlib.AbstractContextManager) -> tuple[float, int]:
    return heldout_sums(model, data, count, groups, micro_batch_size, device, autocast)


EVAL_KEYS = ("seq_len", "eval_windows", "data_text_key", "data_errors", "micro_batch_size")
"""train.* keys `moesys eval` takes; the checkpoint's own values are the defaults."""


def _tokenizer(loaded) -> Tokenizer | None:
    """The checkpoint's tokenizer as training reads text: a moesys checkpoint's own; a Hugging Face directory's
    tokenizer.json (as moesys's hf export writes it), read with the tokenizers library, with the eos its files name."""
    if loaded.kind == "moesys":
        return loaded.tokenizer
    found = Path(loaded.path) / TOKENIZER_FILE
    if not found.is_file():
        return None
    tokenizer = load_tokenizer(found, "tokenizer")
    tokenizer.facts = hf_facts(loaded.path)
    return tokenizer


def evaluate_checkpoint(checkpoint: str | Path, data: str, overrides: dict[str, Any] | None = None) -> dict:
    """`moesys eval`: the loss, perplexity and tokens of a run's newest checkpoint, a step directory or an export
    (moesys or Hugging Face layout, every expert in memory) on `data`, in the checkpoint's tokenizer."""
    from runtime.inference.load import load_model  # the inference reader: checksums, any layout, its tokenizer

    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(EVAL_KEYS))
    if unknown:
        raise DataError(f"moesys eval takes train.{', train.'.join(EVAL_KEYS)}; not train.{unknown[0]}")
    loaded = load_model(Path(checkpoint).expanduser())
    base = loaded.config_data
    cfg = config_from_dict({**base, "train": {**base.get("train", {}), **overrides}})
    tr = cfg.train
    if tr.seq_len > cfg.model.max_seq_len:
        raise DataError(f"train.seq_len={tr.seq_len} exceeds the model's {cfg.model.max_seq_len} positions")
    tokenizer = _tokenizer(loaded)
    if tokenizer is not None:
        tokens = read_tokens(data, tokenizer, "data", tr.data_text_key, errors=tr.data_errors)
    elif is_token_file(data):  # ids need no tokenizer; the model's vocabulary decides a .bin's dtype
        tokens = open_token_file(data, cfg.model.vocab_size, "data")
    else:
        raise DataError(f"checkpoint={checkpoint} has no tokenizer.json; give data= as a token file (.bin, .npy)")
    dataset = TokenDataset(tokens, tr.seq_len, 0, f"data={data}", cfg.model.vocab_size)
    count = window_count(dataset, tr.eval_windows)
    loss_sum, counted = heldout_sums(loaded.model, dataset, count, build_groups(1, 0, 1, 1), tr.micro_batch_size,
                                     torch.device("cpu"))
    return {"checkpoint": str(loaded.path), "data": str(data), **summary(loss_sum, counted), "windows": count,
            "seq_len": tr.seq_len}
