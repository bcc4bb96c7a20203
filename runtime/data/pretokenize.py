"""Text to token ids: a text source encoded segment batch by segment batch (runtime/data/text.py), its documents
joined by the tokenizer's eos (by a blank line for a tokenizer without one), written as a token file (`moesys
tokenize`), or cached in the run directory by `moesys train` before launch, so that every rank maps the ids instead
of tokenizing the whole corpus itself and reads only the windows of its own share.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from pathlib import Path

import numpy as np

from runtime.config import MoesysConfig
from runtime.data.chat_records import is_chat
from runtime.data.text import DOCUMENT_BREAK, DataError, Progress, is_token_file, segments, source_name, text_files
from runtime.data.token_file import open_token_file, write_token_file
from runtime.data.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    run_tokenizer,
    token_dtype,
    tokenizer_digest,
)
from runtime.files.paths import TOKENIZER_FILE, TOKENS, run_dir_of
from runtime.host.io import atomic_write_text, remove_stale_temps

BATCH_BYTES = 4 << 20
"""Text handed to the tokenizer at once (its threads encode the segments of a batch in parallel)."""

def _encode_text(tokenizer: Tokenizer, pieces: list[bytes]) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):  # the bytes are the ids: no decoding, no copy per byte
        return np.frombuffer(b"".join(pieces), dtype=np.uint8)
    ids = tokenizer.encode_pieces(pieces)
    return np.fromiter(chain.from_iterable(ids), dtype=token_dtype(tokenizer.vocab_size),
                       count=sum(len(i) for i in ids))


def _encode(tokenizer: Tokenizer, batch: list[bytes | None]) -> np.ndarray:
    """The ids of a batch of segments, each DOCUMENT_BREAK as the eos id (only a tokenizer with eos reads breaks)."""
    parts: list[np.ndarray] = []
    run: list[bytes] = []
    for segment in batch:
        if segment is None:  # DOCUMENT_BREAK
            parts += [_encode_text(tokenizer, run), np.array([tokenizer.eos_id], token_dtype(tokenizer.vocab_size))]
            run = []
        else:
            run.append(segment)
    parts.append(_encode_text(tokenizer, run))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def encode_source(path: str | Path | None, tokenizer: Tokenizer, key: str = "train.data", text_key: str = "text",
                  progress: Progress | None = None, errors: str = "strict") -> Iterator[np.ndarray]:
    """The ids of a text source in order, one array per batch of segments (`errors`: train.data_errors); documents
    are joined by eos, or by a blank line for a tokenizer without eos."""
    batch, size = [], 0
    for segment in segments(path, key, text_key, progress, errors, breaks=tokenizer.eos_id is not None):
        batch.append(segment)
        size += len(segment) if segment is not DOCUMENT_BREAK else 0
        if size >= BATCH_BYTES:
            yield _encode(tokenizer, batch)
            batch, size = [], 0
    if batch:
        yield _encode(tokenizer, batch)


def tokenize_to_file(path: str | Path | None, out: str | Path, tokenizer: Tokenizer, key: str = "data",
                     text_key: str = "text", progress: Progress | None = None, errors: str = "strict") -> dict:
    """Write a text source's ids as a token file; the `moesys tokenize --json` summary, its fields in this order:
    data (the source given), out (the token file, absolute), tokens (ids written), dtype (uint16 or uint32),
    tokenizer (its name), text_bytes (bytes of the text files read), seconds."""
    if is_token_file(path):
        raise DataError(f"{key}={path} is a token file already; give text (a file, a directory of *.txt, a .jsonl)")
    began = time.perf_counter()
    files = text_files(path, key)
    count = write_token_file(out, encode_source(path, tokenizer, key, text_key, progress, errors),
                             tokenizer.vocab_size)
    remove_stale_temps(Path(out).expanduser())  # what a tokenize killed mid-write left beside it
    return {"data": str(path) if path else "shipped corpus", "out": str(Path(out).expanduser().resolve()),
            "tokens": count, "dtype": token_dtype(tokenizer.vocab_size), "tokenizer": tokenizer.name,
            "text_bytes": sum(f.stat().st_size for f in files), "seconds": round(time.perf_counter() - began, 3)}


def cache_file(cache_dir: Path, key: str, path: str | Path | None, tokenizer: Tokenizer, text_key: str,
               errors: str = "strict") -> Path:
    """Where a text source's ids are cached: named after the key and a digest of the tokenizer, the text key, how
    bad bytes were read and each file's path, size and modification time (a changed file is tokenized again)."""
    replaced = "" if errors == "strict" else f"\0{errors}"  # a strict read's cache keeps its earlier name
    digest = hashlib.sha256(f"{tokenizer_digest(tokenizer)}\0{text_key}{replaced}".encode())
    for file in text_files(path, key):
        stat = file.stat()
        digest.update(f"\0{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return Path(cache_dir) / f"{key}-{digest.hexdigest()[:16]}.bin"


def prepare_tokens(cache_dir: Path, sources: Mapping[str, str | None], tokenizer: Tokenizer, text_key: str,
                   progress: Callable[[str, int, int], None] | None = None,
                   errors: str = "strict") -> dict[str, Path]:
    """Tokenize each text source of `sources` ({key: path}) into the cache once; earlier caches of a key go.
    progress(key, bytes done, bytes in all). Returns {key: cache file}."""
    made = {}
    for key, path in sources.items():
        if is_token_file(path):
            continue
        target = cache_file(cache_dir, key, path, tokenizer, text_key, errors)
        if not target.exists():
            report = (lambda done, total, key=key: progress(key, done, total)) if progress else None
            write_token_file(target, encode_source(path, tokenizer, key, text_key, report, errors),
                             tokenizer.vocab_size)
        for stale in Path(cache_dir).glob(f"{key}-*.bin"):
            if stale != target:
                stale.unlink(missing_ok=True)
        made[key] = target
    return made


def read_tokens(path: str | Path | None, tokenizer: Tokenizer, key: str = "train.data", text_key: str = "text",
                cache_dir: Path | None = None, errors: str = "strict") -> np.ndarray:
    """A source's ids: a token file or the run's cache of a text source as a memory map, else the text encoded
    here (a process that trains without `moesys train`, as tests do)."""
    if path is not None and is_token_file(path):
        return open_token_file(path, tokenizer.vocab_size, key)
    if cache_dir is not None:
        cached = cache_file(cache_dir, key, path, tokenizer, text_key, errors)
        if cached.exists():
            return open_token_file(cached, tokenizer.vocab_size, source_name(path, key))
    return np.concatenate(list(encode_source(path, tokenizer, key, text_key, errors=errors)))


def run_cache_dir(cfg: MoesysConfig) -> Path | None:
    """RUN_DIR/tokens, where `moesys train` tokenized the run's text sources before launch."""
    return Path(cfg.train.run_dir) / TOKENS if cfg.train.run_dir else None


def data_sources(cfg: MoesysConfig) -> dict[str, str | None]:
    """Every source a run reads, by the key that names it: train.data (or each task's data), train.eval_data,
    distill.heldout_data."""
    sources = {f"tasks.{name}.data": task.data for name, task in cfg.tasks.items()} if cfg.tasks else \
        {"train.data": cfg.train.data}
    if cfg.train.eval_data:
        sources["train.eval_data"] = cfg.train.eval_data
    if cfg.distill.teacher and cfg.distill.heldout_data:
        sources["distill.heldout_data"] = cfg.distill.heldout_data
    return sources


def prepare_run_data(cfg: MoesysConfig, progress: Callable[[str, int, int], None] | None = None) -> None:
    """What `moesys train` writes into the run directory before launch: its tokenizer (tokenizer.json, read by the
    workers, checkpoints and exports) and its text sources as token files (TOKENS/), documents joined by the run
    tokenizer's eos (the model's own where the run directory records train.init_from's generation facts)."""
    run_dir = run_dir_of(cfg)
    atomic_write_text(run_dir / TOKENIZER_FILE, load_tokenizer(cfg.train.tokenizer, vocab_size=cfg.model.vocab_size)
                      .to_str())
    tokenizer = run_tokenizer(cfg)  # the copy just written, with the run's generation facts: as the workers read it
    text = {key: path for key, path in data_sources(cfg).items() if not is_chat(path, cfg.train.data_format)}
    prepare_tokens(run_dir / TOKENS, text, tokenizer, cfg.train.data_text_key, progress,
                   cfg.train.data_errors)
