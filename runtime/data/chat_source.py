"""A run's chat data: the template that renders it (the model's own when train.init_from ships one, copied into the
run directory, else the ChatML template `moesys serve` renders chat with, so training and serving build the same
prompt), its samples encoded once by `moesys train` before launch (RUN_DIR/tokens), and the dataset of train.data or
train.eval_data that a worker trains or evaluates on."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from runtime.config import MoesysConfig
from runtime.data.chat_data import ChatDataset, ChatSamples, Render, encode_samples, samples_cache
from runtime.data.chat_records import is_chat
from runtime.data.pretokenize import data_sources, run_cache_dir
from runtime.data.tokenizer import Tokenizer, tokenizer_digest
from runtime.files.paths import CHAT_TEMPLATE_FILE
from runtime.host.io import atomic_write_text


def model_chat_template(directory: str | Path) -> Optional[str]:
    """The chat template a model directory ships: its chat_template.jinja, else tokenizer_config.json's
    chat_template (the one named default of a list); None without one."""
    directory = Path(directory)
    for where in (directory, directory.parent.parent):  # a step directory's run directory too
        if (where / CHAT_TEMPLATE_FILE).is_file():
            return (where / CHAT_TEMPLATE_FILE).read_text()
    config = directory / "tokenizer_config.json"
    try:
        template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def run_chat_template(cfg: MoesysConfig) -> Optional[str]:
    """The template a run renders chat with: RUN_DIR/chat_template.jinja, else train.init_from's own; None: ChatML."""
    saved = Path(cfg.train.run_dir) / CHAT_TEMPLATE_FILE if cfg.train.run_dir else None
    if saved is not None and saved.is_file():
        return saved.read_text()
    return model_chat_template(cfg.train.init_from) if cfg.train.init_from else None


def chat_renderer(tokenizer: Tokenizer, template: Optional[str]) -> Render:
    """Render with `template` (None: ChatML) and encode with `tokenizer`; the assistant's ids are marked."""
    from runtime.data.chat_template import CHATML, encode_chat

    def render(messages):
        tokens = encode_chat(tokenizer, messages, template=template or CHATML)
        return tokens.ids, tokens.assistant_mask()

    return render


def _digest(cfg: MoesysConfig, tokenizer: Tokenizer, template: Optional[str]) -> str:
    tr = cfg.train
    text = f"{tokenizer_digest(tokenizer)}\0{template or ''}\0{tr.seq_len}\0{tr.long_samples}"
    return hashlib.sha256(text.encode()).hexdigest()


def run_samples(cfg: MoesysConfig, tokenizer: Tokenizer, key: str, path: str,
                render: Optional[Render] = None) -> ChatSamples:
    """A chat source's samples: the run's cache when `moesys train` wrote it, else encoded here."""
    template = run_chat_template(cfg)
    cache_dir = run_cache_dir(cfg)
    cached = samples_cache(cache_dir, key, path, _digest(cfg, tokenizer, template)) if cache_dir else None
    if cached is not None and cached.is_file():
        return ChatSamples.load(cached)
    return encode_samples(path, render or chat_renderer(tokenizer, template), cfg.train.seq_len,
                          cfg.train.long_samples, key)


def open_chat_dataset(cfg: MoesysConfig, tokenizer: Tokenizer, key: str, path: str, seed: Optional[int] = None,
                      render: Optional[Render] = None) -> ChatDataset:
    """The rows of one of the run's chat sources, padded with the tokenizer's eos (0 without one)."""
    tr = cfg.train
    pad = getattr(tokenizer, "eos_id", None)
    return ChatDataset(run_samples(cfg, tokenizer, key, path, render), tr.seq_len, tr.seed if seed is None else seed,
                       tr.pack, pad if pad is not None else 0, f"{key}={path}", cfg.model.vocab_size)


def chat_sources(cfg: MoesysConfig) -> dict[str, str]:
    """The run's sources that are chat data, by key."""
    return {key: path for key, path in data_sources(cfg).items() if is_chat(path, cfg.train.data_format)}


def prepare_chat_data(cfg: MoesysConfig, tokenizer: Tokenizer) -> list[str]:
    """What `moesys train` does before launch for chat data: the model's template into the run directory, each chat
    source encoded into the run's cache (malformed lines and refused samples stop it here, not in every worker).
    Returns a note per source whose long samples were cut."""
    run_dir = Path(cfg.train.run_dir)
    template = model_chat_template(cfg.train.init_from) if cfg.train.init_from else None
    if template is not None and not (run_dir / CHAT_TEMPLATE_FILE).is_file():
        atomic_write_text(run_dir / CHAT_TEMPLATE_FILE, template)
    template = run_chat_template(cfg)
    notes = []
    for key, path in chat_sources(cfg).items():
        target = samples_cache(run_cache_dir(cfg), key, path, _digest(cfg, tokenizer, template))
        if target.is_file():
            samples = ChatSamples.load(target)
        else:
            samples = encode_samples(path, chat_renderer(tokenizer, template), cfg.train.seq_len,
                                     cfg.train.long_samples, key)
            target.parent.mkdir(parents=True, exist_ok=True)
            samples.save(target)
        if samples.cut:
            notes.append(f"note: {key}={path}: {samples.cut} of {samples.count} samples are longer than train.seq_len "
                         f"+ 1 = {cfg.train.seq_len + 1} tokens and were cut to it (train.long_samples=cut)")
    return notes
