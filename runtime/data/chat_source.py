"""A run's chat data: rendered with the run tokenizer's chat template (the model's own when train.init_from ships one,
which the run directory records, else the ChatML template `moesys serve` renders chat with, so training and serving
build the same prompt), its samples encoded once by `moesys train` before launch (RUN_DIR/tokens), and the dataset of
train.data or train.eval_data that a worker trains or evaluates on."""

from __future__ import annotations

import hashlib

from runtime.config import MoesysConfig
from runtime.data.chat_data import ChatDataset, ChatSamples, Render, encode_samples, samples_cache
from runtime.data.chat_records import is_chat
from runtime.data.chat_template import encode_chat, tokenizer_template
from runtime.data.pretokenize import data_sources, run_cache_dir
from runtime.data.tokenizer import Tokenizer, tokenizer_digest


def chat_renderer(tokenizer: Tokenizer) -> Render:
    """Render with the tokenizer's chat template (its model's own, else ChatML) and encode with it; the assistant's
    ids are marked."""

    def render(messages):
        tokens = encode_chat(tokenizer, messages)
        return tokens.ids, tokens.assistant_mask()

    return render


def _digest(cfg: MoesysConfig, tokenizer: Tokenizer) -> str:
    tr, (template, tokens) = cfg.train, tokenizer_template(tokenizer)
    text = f"{tokenizer_digest(tokenizer)}\0{template}\0{sorted(tokens.items())}\0{tr.seq_len}\0{tr.long_samples}"
    return hashlib.sha256(text.encode()).hexdigest()


def run_samples(cfg: MoesysConfig, tokenizer: Tokenizer, key: str, path: str,
                render: Render | None = None) -> ChatSamples:
    """A chat source's samples: the run's cache when `moesys train` wrote it, else encoded here."""
    cache_dir = run_cache_dir(cfg)
    cached = samples_cache(cache_dir, key, path, _digest(cfg, tokenizer)) if cache_dir else None
    if cached is not None and cached.is_file():
        return ChatSamples.load(cached)
    return encode_samples(path, render or chat_renderer(tokenizer), cfg.train.seq_len, cfg.train.long_samples, key)


def open_chat_dataset(cfg: MoesysConfig, tokenizer: Tokenizer, key: str, path: str, seed: int | None = None,
                      render: Render | None = None) -> ChatDataset:
    """The rows of one of the run's chat sources, padded with the tokenizer's eos (0 without one)."""
    tr = cfg.train
    pad = getattr(tokenizer, "eos_id", None)
    return ChatDataset(run_samples(cfg, tokenizer, key, path, render), tr.seq_len, tr.seed if seed is None else seed,
                       tr.pack, pad if pad is not None else 0, f"{key}={path}", cfg.model.vocab_size)


def chat_sources(cfg: MoesysConfig) -> dict[str, str]:
    """The run's sources that are chat data, by key."""
    return {key: path for key, path in data_sources(cfg).items()
            if path is not None and is_chat(path, cfg.train.data_format)}


def prepare_chat_data(cfg: MoesysConfig, tokenizer: Tokenizer) -> list[str]:
    """What `moesys train` does before launch for chat data: each chat source encoded with the run's tokenizer (and
    so its template) into the run's cache (malformed lines and refused samples stop it here, not in every worker).
    Returns a note per source whose long samples were cut."""
    notes = []
    cache = run_cache_dir(cfg)
    if cache is None:
        raise ValueError("chat data is prepared into the run directory: set train.run_dir first")
    for key, path in chat_sources(cfg).items():
        target = samples_cache(cache, key, path, _digest(cfg, tokenizer))
        if target.is_file():
            samples = ChatSamples.load(target)
        else:
            samples = encode_samples(path, chat_renderer(tokenizer), cfg.train.seq_len, cfg.train.long_samples, key)
            target.parent.mkdir(parents=True, exist_ok=True)
            samples.save(target)
        if samples.cut:
            notes.append(f"note: {key}={path}: {samples.cut} of {samples.count} samples are longer than train.seq_len "
                         f"+ 1 = {cfg.train.seq_len + 1} tokens and were cut to it (train.long_samples=cut)")
    return notes
