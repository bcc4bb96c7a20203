"""Pre-tokenized corpora, as torchtitan and nanoGPT keep them: a flat array of token ids in a file, read through a
memory map, so a corpus larger than memory trains and each rank's reads touch only the pages of its own windows.

.bin  raw little-endian ids, uint16 when the tokenizer has at most 65,536 tokens, else uint32 (no header)
.npy  a one-dimensional numpy array of uint16 or uint32
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from runtime.data.text import TOKEN_SUFFIXES, DataError
from runtime.data.tokenizer import token_dtype
from runtime.host.io import atomic_file

DTYPES = ("uint16", "uint32")
NPY_HEADER = 128
"""Bytes of the .npy header moesys writes (magic, version, length, the dict padded with spaces): fixed, so that
the header is written before the ids, whose count is known only at the end, and rewritten in place."""


def open_token_file(path: str | Path, vocab_size: int, key: str = "train.data") -> np.ndarray:
    """The ids of a token file as a read-only memory map; nothing is read until a window is sliced. `vocab_size`
    (the tokenizer's) decides a .bin's dtype."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{key}={path} does not exist" if not path.exists() else f"{key}={path} is not a file")
    if path.suffix.lower() == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, SyntaxError) as exc:
            raise DataError(f"{key}={path} is not a readable .npy file ({str(exc).splitlines()[0]})") from None
        if tokens.ndim != 1 or tokens.dtype.name not in DTYPES:
            raise DataError(f"{key}={path} holds a {tokens.dtype.name} array of shape {tokens.shape}; a token "
                            "file is one-dimensional uint16 or uint32 (moesys tokenize writes one)")
        return tokens
    dtype = np.dtype(token_dtype(vocab_size))
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"{key}={path} is {size} bytes, not a whole number of {dtype.name} ids (the tokenizer's "
                        f"{vocab_size} tokens make a .bin file {dtype.name}); was it written for another tokenizer?")
    if size == 0:
        raise DataError(f"{key}={path} is empty")
    return np.memmap(path, dtype=dtype, mode="r")


def check_ids(tokens: np.ndarray, vocab_size: int, name: str, sample: int = 1 << 20) -> None:
    """DataError when the first `sample` ids hold one not below `vocab_size` (a file tokenized for another
    vocabulary); the rest is checked as training reads it."""
    head = np.asarray(tokens[:sample])
    if head.size and int(head.max()) >= vocab_size:
        raise DataError(f"{name} holds token id {int(head.max())}, not below the vocabulary's {vocab_size}; "
                        "tokenize it with the run's train.tokenizer (moesys tokenize)")


def _npy_header(dtype: np.dtype, count: int) -> bytes:
    text = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': ({count},), }}"
    text += " " * (NPY_HEADER - 10 - len(text) - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


def write_token_file(out: str | Path, arrays: Iterable[np.ndarray], vocab_size: int) -> int:
    """Write the ids of `arrays`, in order, to `out` (.bin or .npy, dtype by `vocab_size`) atomically: a failed or
    interrupted write leaves nothing. Returns the number of ids."""
    out = Path(out).expanduser()
    if out.suffix.lower() not in TOKEN_SUFFIXES:
        raise DataError(f"out={out} must end in .bin or .npy")
    dtype = np.dtype(token_dtype(vocab_size)).newbyteorder("<")
    npy = out.suffix.lower() == ".npy"
    count = 0
    with atomic_file(out) as f:
        if npy:
            f.write(_npy_header(dtype, 0))
        for ids in arrays:
            ids = np.asarray(ids)
            if ids.size and int(ids.max()) >= vocab_size:
                raise DataError(f"token id {int(ids.max())} is not below the tokenizer's {vocab_size} tokens")
            f.write(ids.astype(dtype, copy=False).tobytes())
            count += ids.size
        if npy:
            f.seek(0)
            f.write(_npy_header(dtype, count))
    return count

