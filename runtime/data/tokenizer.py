"""Tokenizers: the byte-level one (token ids are the UTF-8 bytes of the text, vocab 256) and any Hugging Face
tokenizer.json, loaded with the `tokenizers` library. Both are written as tokenizer.json, so a run, its checkpoints
and its exports carry the tokenizer they were trained with (train.tokenizer=bytes|PATH).

Documents are separated by a blank line (b"\\n\\n") in the text itself; there is no special token.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from runtime.config import BYTE_VOCAB, MoesysConfig
from runtime.errors import UserError
from runtime.files.paths import CHECKPOINTS, TOKENIZER_FILE

if TYPE_CHECKING:
    import torch

BYTES = "bytes"


class TokenizerError(UserError):
    """A tokenizer that cannot be loaded; the message names the key and the path."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters, which the ByteLevel pre-tokenizer and decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@lru_cache(maxsize=1)
def byte_tokenizer_json() -> str:
    """The byte tokenizer as tokenizer.json: a BPE model whose vocabulary is the 256 bytes (id = byte value) and
    no merges, behind the ByteLevel pre-tokenizer and decoder, so it gives exactly ByteTokenizer's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size: int = BYTE_VOCAB
    name: str = BYTES

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> "torch.Tensor":
        """Raw bytes (a file's contents) as a uint8 tensor of ids, without decoding them first."""
        import torch

        if not data:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def encode_pieces(self, pieces: Sequence[bytes]) -> list[Sequence[int]]:
        """Each piece of raw text as its ids (its bytes, undecoded)."""
        return list(pieces)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; ids outside 0..255 are skipped and invalid UTF-8 becomes U+FFFD."""
        if hasattr(ids, "reshape"):  # a tensor or an array
            ids = ids.reshape(-1).tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def to_str(self) -> str:
        """This tokenizer as tokenizer.json."""
        return byte_tokenizer_json()


class JsonTokenizer:
    """A Hugging Face tokenizer.json (any model the `tokenizers` library reads: byte-level BPE, WordPiece, ...)."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_str(cls, text: str, name: str) -> "JsonTokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text), name)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_pieces(self, pieces: Sequence[bytes]) -> list[Sequence[int]]:
        """Each piece of raw text (UTF-8, invalid bytes as U+FFFD) as its ids; the library's threads do the work."""
        texts = [p.decode("utf-8", errors="replace") for p in pieces]
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)  # fast: no offsets
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; ids outside the vocabulary are skipped."""
        if hasattr(ids, "reshape"):  # a tensor or an array
            ids = ids.reshape(-1).tolist()
        return self.tokenizer.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=False)

    def to_str(self) -> str:
        return self.tokenizer.to_str()


Tokenizer = ByteTokenizer | JsonTokenizer


def load_tokenizer(spec: str | Path = BYTES, key: str = "train.tokenizer") -> Tokenizer:
    """`bytes`, or the tokenizer.json at the path `spec`; a TokenizerError of one line naming `key` otherwise."""
    if str(spec) == BYTES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise TokenizerError(f"{key}={spec} {what}; give bytes or the path of a Hugging Face tokenizer.json "
                             "(moesys tokenizer train writes one)")
    try:
        tokenizer = JsonTokenizer.from_str(path.read_text(encoding="utf-8"), str(path))
    except Exception as exc:  # OSError, UnicodeDecodeError, and the library's plain Exception on bad JSON
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenizerError(f"{key}={spec} is not a Hugging Face tokenizer.json ({reason}); give bytes or the "
                             "path of one (moesys tokenizer train writes one)") from None
    return ByteTokenizer() if tokenizer.to_str() == byte_tokenizer_json() else tokenizer


def run_tokenizer(cfg: MoesysConfig) -> Tokenizer:
    """The tokenizer a run trains with: bytes, or the copy of train.tokenizer `moesys train` wrote into the run
    directory (the file the user named may change or go while the run lives), else that file."""
    if cfg.train.tokenizer == BYTES:
        return ByteTokenizer()
    saved = Path(cfg.train.run_dir) / TOKENIZER_FILE if cfg.train.run_dir else None
    if saved is not None and saved.is_file():
        return load_tokenizer(saved, "train.tokenizer")
    return load_tokenizer(cfg.train.tokenizer)


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """A digest of the tokenizer's JSON: equal digests give equal ids."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def token_dtype(vocab_size: int) -> str:
    """The numpy dtype of a token file for this vocabulary: uint16 up to 65,536 ids, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def checkpoint_tokenizer_file(path: Path, step_dir: Path) -> Path | None:
    """The tokenizer.json a checkpoint carries: in its step directory (or the export), else in the directory given,
    else in the run directory above a step directory; None for checkpoints written before tokenizers were saved."""
    step_dir = Path(step_dir)
    candidates = [step_dir / TOKENIZER_FILE, Path(path) / TOKENIZER_FILE]
    if step_dir.parent.name == CHECKPOINTS:
        candidates.append(step_dir.parent.parent / TOKENIZER_FILE)
    return next((c for c in candidates if c.is_file()), None)


def checkpoint_tokenizer(path: Path, step_dir: Path, cfg: MoesysConfig) -> Tokenizer | None:
    """The tokenizer of a moesys checkpoint or export (its tokenizer.json; without one, train.tokenizer as its config
    names it), or None when there is none its model can take (prompts must then be token ids)."""
    found = checkpoint_tokenizer_file(path, step_dir)
    if found is not None:
        tokenizer = load_tokenizer(found, "tokenizer")
    elif cfg.train.tokenizer == BYTES:
        tokenizer = ByteTokenizer()
    else:
        try:
            tokenizer = load_tokenizer(cfg.train.tokenizer)
        except TokenizerError:
            return None
    return tokenizer if tokenizer.vocab_size <= cfg.model.vocab_size else None


def hf_tokenizer_config(max_length: int) -> dict:
    """tokenizer_config.json beside tokenizer.json in a Hugging Face export: transformers' AutoTokenizer then loads
    the file as it is (the generic fast tokenizer, no token added), so its ids are moesys's."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
            "clean_up_tokenization_spaces": False}
