"""A byte-level tokenizer: token ids are the UTF-8 bytes of the text (vocab 256, nothing to download).

Documents are separated by a blank line (b"\\n\\n") in the text itself; there is no special token.
"""

from __future__ import annotations

from typing import Iterable

import torch

from runtime.config import BYTE_VOCAB


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size: int = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> torch.Tensor:
        """Raw bytes (a file's contents) as a uint8 tensor of ids, without decoding them first."""
        if not data:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; ids outside 0..255 are skipped and invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
