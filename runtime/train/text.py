"""Training text, read without torch: what `moesys train` checks before launching (the workers tokenize it)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from runtime.errors import UserError

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
DOC_SEPARATOR = b"\n\n"


class DataError(UserError):
    """Training data that cannot be used; the message names the path."""


def read_text_bytes(path: Optional[str | Path] = None, key: str = "train.data") -> bytes:
    """The bytes of a text file, or of a directory's *.txt files (sorted, joined by a blank line).

    None reads the corpus shipped with moesys; `key` is the config key named in errors.
    """
    source = CORPUS_DIR if path is None else Path(path).expanduser()
    if not source.exists():
        raise DataError(f"{key}={source} does not exist")
    if source.is_dir():
        files = sorted(p for p in source.glob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"{key}={source} holds no *.txt files")
        parts = [p.read_bytes().strip() for p in files]
        data = DOC_SEPARATOR.join(p for p in parts if p)
    else:
        data = source.read_bytes().strip()
    if not data:
        raise DataError(f"{key}={source} is empty")
    return data


def check_token_count(tokens: int, seq_len: int, name: str) -> None:
    if tokens < seq_len + 1:
        raise DataError(f"{name} holds {tokens} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; "
                        "lower train.seq_len or give more text")


def check_text(path: Optional[str | Path], seq_len: int, key: str = "train.data") -> None:
    """DataError when the data is missing, empty or shorter than one window (the byte tokenizer: a token a byte)."""
    if seq_len <= 0:
        raise DataError(f"{key}: seq_len must be positive (got {seq_len})")
    check_token_count(len(read_text_bytes(path, key)), seq_len, "shipped corpus" if path is None else f"{key}={path}")
