"""Tokenizers: the byte-level one (token ids are the UTF-8 bytes of the text, then the special tokens) and any
Hugging Face tokenizer.json, loaded with the `tokenizers` library. Both are written as tokenizer.json, so a run, its
checkpoints and its exports carry the tokenizer they were trained with (train.tokenizer=bytes|PATH).

The special tokens (SPECIAL_TOKENS) are eos, which joins the documents of training data, ends generation and pads,
and ChatML's turn markers (runtime/data/chat_template.py). The byte tokenizer gives them ids 256, 257, 258 when the
model has rows for them; with 256 rows (runs made before the special tokens) it is the bytes alone, its documents
joined by a blank line and its generations ended by length only. Text given to `encode` may hold the special
tokens' strings, which become their ids (as transformers' tokenizers read them); training text never does.

The tokenizer of a run started from a released model (train.init_from) carries that model's generation facts
(runtime/data/generation_facts.py): its eos joins documents, pads and ends generation together with the ids its
generation config names, and its chat template renders chat; `run_tokenizer` and `checkpoint_tokenizer` attach them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.config import BYTE_VOCAB, MoesysConfig
from runtime.data.generation_facts import GenerationFacts, checkpoint_facts, ending_ids, recorded_facts
from runtime.errors import UserError
from runtime.files.paths import CHECKPOINTS, TOKENIZER_FILE

if TYPE_CHECKING:  # for annotations only: the library is imported where a JSON tokenizer is made
    import tokenizers

BYTES = "bytes"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END)
"""moesys's special tokens in id order: the byte tokenizer's 256, 257, 258, a trained BPE's 0, 1, 2."""
STOP_TOKENS = (EOS, IM_END)
"""Tokens that end a generation: the end of a document, the end of a chat turn."""
SPECIAL_VOCAB = BYTE_VOCAB + len(SPECIAL_TOKENS)
"""Rows a model needs for the byte tokenizer with its special tokens."""
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


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


@lru_cache(maxsize=2)
def byte_tokenizer_json(specials: bool = True) -> str:
    """The byte tokenizer as tokenizer.json: a BPE model whose vocabulary is the 256 bytes (id = byte value) and
    no merges, behind the ByteLevel pre-tokenizer and decoder, then the special tokens as added tokens 256.., so it
    gives exactly ByteTokenizer's ids. specials=False: the file runs made before the special tokens carry."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if specials:
        tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str()


class SpecialTokens:
    """The special tokens a tokenizer has (`special_ids`: string -> id) and what they mean: moesys's own
    (SPECIAL_TOKENS), or those the model it came with names (`facts`: a released model's eos, its stop ids and chat
    template, runtime/data/generation_facts.py)."""

    special_ids: dict[str, int]
    vocab_size: int
    facts: GenerationFacts | None = None
    """The generation facts of the model this tokenizer belongs to; None: moesys's own tokens and ChatML."""

    def token_id(self, token: str) -> int | None:
        """The id of a special token's string; None when the tokenizer has no such token."""
        return self.special_ids.get(token)

    def _named(self) -> dict[str, str] | None:
        """The model's named special tokens this tokenizer has; None: moesys's own."""
        named = self.facts.special_tokens if self.facts is not None else None
        if named is None:
            return None
        return {name: token for name, token in named.items() if self.token_id(token) is not None}

    @property
    def eos_token(self) -> str | None:
        """The token that joins documents, ends a generation and (moesys's own) pads: the model's eos, else EOS when
        the tokenizer has it; None without one (what /tokenizer_info reports as a Hugging Face tokenizer names it)."""
        named = self._named()
        if named is not None:
            return named.get("eos_token")
        return EOS if EOS in self.special_ids else None

    @property
    def eos_id(self) -> int | None:
        """eos_token's id; None for a tokenizer without eos."""
        token = self.eos_token
        return self.token_id(token) if token is not None else None

    @property
    def pad_token(self) -> str | None:
        """The model's pad; moesys's own pad is eos (as the export's tokenizer_config.json names it)."""
        named = self._named()
        return named.get("pad_token") if named is not None else self.eos_token

    @property
    def bos_token(self) -> str | None:
        """The model's bos; moesys's tokenizers have none."""
        named = self._named()
        return named.get("bos_token") if named is not None else None

    @property
    def template_tokens(self) -> dict[str, str]:
        """The named special tokens a chat template sees (transformers' `special_tokens_map` of the export)."""
        named = self._named()
        if named is not None:
            return named
        return {name: token for name, token in (("eos_token", self.eos_token), ("pad_token", self.pad_token)) if token}

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids a generation ends at: the model's generation config's and its eos, else the STOP_TOKENS this
        tokenizer has."""
        stated: Sequence[int] | None = self.facts.eos_token_ids if self.facts is not None else None
        if stated is None:
            stated = [self.special_ids[t] for t in STOP_TOKENS if t in self.special_ids]
        return ending_ids([i for i in stated if i < self.vocab_size], self.eos_id)

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template; None: ChatML."""
        return self.facts.chat_template if self.facts is not None else None


class ByteTokenizer(SpecialTokens):
    """UTF-8 bytes as token ids 0..255, then (specials=True) SPECIAL_TOKENS as 256, 257, 258."""

    name: str = BYTES

    def __init__(self, specials: bool = True):
        self.special_ids = {t: BYTE_VOCAB + i for i, t in enumerate(SPECIAL_TOKENS)} if specials else {}
        self.vocab_size = BYTE_VOCAB + len(self.special_ids)
        self._tokens = {i: t for t, i in self.special_ids.items()}

    def _parts(self, text: str) -> list[str]:
        """`text` split at the special tokens' strings (odd places hold the specials)."""
        return _SPECIAL_SPLIT.split(text) if self.special_ids else [text]

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`, a special token's string as its id."""
        ids: list[int] = []
        for i, part in enumerate(self._parts(text)):
            if i % 2:
                ids.append(self.special_ids[part])
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and, per id, the (start, end) characters of `text` it comes from."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        at = 0
        for i, part in enumerate(self._parts(text)):
            if i % 2:
                ids.append(self.special_ids[part])
                offsets.append((at, at + len(part)))
            else:
                for k, char in enumerate(part):
                    data = char.encode("utf-8")
                    ids.extend(data)
                    offsets.extend([(at + k, at + k + 1)] * len(data))
            at += len(part)
        return ids, offsets

    def encode_pieces(self, pieces: Sequence[bytes]) -> list[Sequence[int]]:
        """Each piece of raw text as its ids (its bytes, undecoded: training text holds no special token)."""
        return list(pieces)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, a special token as its string; ids outside the vocabulary are skipped and invalid UTF-8
        becomes U+FFFD."""
        if hasattr(ids, "reshape"):  # a tensor or an array
            ids = ids.reshape(-1).tolist()
        text, run = [], bytearray()
        for i in ids:
            if 0 <= i < BYTE_VOCAB:
                run.append(i)
            elif i in self._tokens:
                text += [run.decode("utf-8", errors="replace"), self._tokens[i]]
                run = bytearray()
        return "".join(text) + run.decode("utf-8", errors="replace")

    def to_str(self) -> str:
        """This tokenizer as tokenizer.json."""
        return byte_tokenizer_json(bool(self.special_ids))


class JsonTokenizer(SpecialTokens):
    """A Hugging Face tokenizer.json (any model the `tokenizers` library reads: byte-level BPE, WordPiece, ...);
    its special tokens are those of SPECIAL_TOKENS it holds as special added tokens."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        self.special_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS if t in added}
        self._plain: tokenizers.Tokenizer | None = None

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    @classmethod
    def from_str(cls, text: str, name: str) -> JsonTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text), name)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and, per id, the (start, end) characters of `text` it comes from."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_pieces(self, pieces: Sequence[bytes]) -> list[Sequence[int]]:
        """Each piece of raw text (UTF-8, invalid bytes as U+FFFD) as its ids, a special token's string as text;
        the library's threads do the work."""
        if self._plain is None:  # a copy that reads special tokens' strings as text
            from tokenizers import Tokenizer

            self._plain = Tokenizer.from_str(self.tokenizer.to_str())
            self._plain.encode_special_tokens = True
        plain = self._plain
        texts = [p.decode("utf-8", errors="replace") for p in pieces]
        encode = getattr(plain, "encode_batch_fast", plain.encode_batch)  # fast: no offsets
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; ids outside the vocabulary are skipped."""
        if hasattr(ids, "reshape"):  # a tensor or an array
            ids = ids.reshape(-1).tolist()
        return self.tokenizer.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=False)

    def to_str(self) -> str:
        return self.tokenizer.to_str()


Tokenizer = ByteTokenizer | JsonTokenizer


def byte_tokenizer(vocab_size: int | None = None) -> ByteTokenizer:
    """The byte tokenizer of a model with `vocab_size` rows: with the special tokens when it has rows for them (or
    no size is given), else the bytes alone (a model of 256 rows, as runs made before the special tokens were)."""
    return ByteTokenizer(specials=vocab_size is None or vocab_size >= SPECIAL_VOCAB)


def load_tokenizer(spec: str | Path = BYTES, key: str = "train.tokenizer",
                   vocab_size: int | None = None) -> Tokenizer:
    """`bytes` (for a model of `vocab_size` rows: `byte_tokenizer`), or the tokenizer.json at the path `spec`; a
    TokenizerError of one line naming `key` otherwise."""
    if str(spec) == BYTES:
        return byte_tokenizer(vocab_size)
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
    for specials in (True, False):
        if tokenizer.to_str() == byte_tokenizer_json(specials):
            return ByteTokenizer(specials)
    return tokenizer


def run_tokenizer(cfg: MoesysConfig) -> Tokenizer:
    """The tokenizer a run trains with: bytes (`byte_tokenizer` of model.vocab_size), or the copy of
    train.tokenizer `moesys train` wrote into the run directory (the file the user named may change or go while the
    run lives), else that file; with the generation facts the run directory records."""
    tokenizer: ByteTokenizer | JsonTokenizer
    if cfg.train.tokenizer == BYTES:
        tokenizer = byte_tokenizer(cfg.model.vocab_size)
    else:
        saved = Path(cfg.train.run_dir) / TOKENIZER_FILE if cfg.train.run_dir else None
        tokenizer = load_tokenizer(saved if saved is not None and saved.is_file() else cfg.train.tokenizer,
                                   "train.tokenizer")
    tokenizer.facts = recorded_facts(cfg.train.run_dir) if cfg.train.run_dir else None
    return tokenizer


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """A digest of the tokenizer's JSON and of the eos its model names: equal digests give equal ids (eos joins
    documents)."""
    text = tokenizer.to_str() if tokenizer.facts is None else f"{tokenizer.to_str()}\0eos={tokenizer.eos_id}"
    return hashlib.sha256(text.encode()).hexdigest()


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
    names it) with the checkpoint's generation facts, or None when there is none its model can take (prompts must
    then be token ids)."""
    found = checkpoint_tokenizer_file(path, step_dir)
    if found is not None:
        tokenizer = load_tokenizer(found, "tokenizer")
    elif cfg.train.tokenizer == BYTES:
        tokenizer = byte_tokenizer(cfg.model.vocab_size)
    else:
        try:
            tokenizer = load_tokenizer(cfg.train.tokenizer)
        except TokenizerError:
            return None
    if tokenizer.vocab_size > cfg.model.vocab_size:
        return None
    tokenizer.facts = checkpoint_facts(path, step_dir)
    return tokenizer


def hf_tokenizer_config(max_length: int, tokenizer: Tokenizer | None = None) -> dict:
    """tokenizer_config.json beside tokenizer.json in a Hugging Face export: transformers' AutoTokenizer then loads
    the file as it is (the generic fast tokenizer, no token added), so its ids are moesys's. It names the tokenizer's
    special tokens (moesys's own: eos, also the pad, no bos; a released model's: its own) and the chat template
    `moesys serve` renders with (the model's own, else ChatML)."""
    from runtime.data.chat_template import CHATML

    named: dict[str, str | None] = {"bos_token": None, "eos_token": None, "pad_token": None}
    if tokenizer is not None:
        named.update({**tokenizer.template_tokens, "bos_token": tokenizer.bos_token,
                      "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token})
    template = tokenizer.chat_template if tokenizer is not None else None
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
            "clean_up_tokenization_spaces": False, **named, "chat_template": template or CHATML}
