"""Training text, read without torch: a text file, a directory of *.txt files, or a .jsonl file with a text field,
streamed as segments that any tokenizer encodes one at a time (what `moesys train` checks before launching, what
`moesys tokenize` writes and what the workers read).

A document (a file, or a .jsonl record) is stripped of surrounding whitespace, and documents are joined by a blank
line (DOC_SEPARATOR) or, for a tokenizer with eos, marked by DOCUMENT_BREAK, which the tokenizer turns into its eos
(runtime/data/pretokenize.py). Each document is cut into segments at its blank lines (a segment of its own), and a
segment longer than MAX_SEGMENT at its last line break before that length: concatenated, the segments are exactly the
text, and the token stream is the concatenation of each segment's ids, whatever the block size the file was read in.
Text is checked as UTF-8 as it is read: a binary file given as text is refused at its first bad byte
(train.data_errors=replace reads bad bytes as U+FFFD instead).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from runtime.errors import UserError

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
DOC_SEPARATOR = b"\n\n"
DOCUMENT_BREAK = None
"""Where one document ends and the next begins, in `segments(..., breaks=True)`."""
JSONL_SUFFIXES = (".jsonl",)
TOKEN_SUFFIXES = (".bin", ".npy")
BLOCK = 8 << 20
"""Bytes read from a text file at a time."""
MAX_SEGMENT = 1 << 20
"""Longest text a tokenizer encodes in one call; a longer stretch without a blank line is cut at a line break."""

Progress = Callable[[int, int], None]
"""progress(bytes done, bytes in all): called as a source is read, every PROGRESS_EVERY bytes and at the end."""
PROGRESS_EVERY = 1 << 20


DATA_ERRORS = ("strict", "replace")
"""What reading text does with bytes that are not UTF-8 text (train.data_errors): strict refuses the file, naming the
first bad byte's offset; replace reads each bad sequence as U+FFFD."""


class DataError(UserError):
    """Training data that cannot be used; the message names the key and the path."""


def source_name(path: str | Path | None, key: str) -> str:
    return "shipped corpus" if path is None else f"{key}={path}"


def is_token_file(path: str | Path | None) -> bool:
    """Whether `path` names a pre-tokenized file (.bin, .npy) rather than text."""
    return path is not None and Path(path).suffix.lower() in TOKEN_SUFFIXES


def text_files(path: str | Path | None, key: str = "train.data") -> list[Path]:
    """The files a text source reads, in order: the file itself, a directory's *.txt files sorted by name, or
    (None) the corpus shipped with moesys."""
    source = CORPUS_DIR if path is None else Path(path).expanduser()
    if not source.exists():
        raise DataError(f"{key}={source} does not exist")
    if source.is_dir():
        files = sorted(p for p in source.glob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"{key}={source} holds no *.txt files")
        return files
    return [source]


def _cut(text: bytes) -> int:
    """Where to end a segment of an overlong stretch: after its last line break before MAX_SEGMENT, else at the
    last UTF-8 character start before it."""
    newline = text.rfind(b"\n", 0, MAX_SEGMENT)
    if newline >= 0:
        return newline + 1
    cut = MAX_SEGMENT
    while cut > 1 and text[cut] & 0xC0 == 0x80:  # a continuation byte: back to the character's first byte
        cut -= 1
    return cut


def _bounded(part: bytes) -> Iterator[bytes]:
    """A stretch without a blank line as segments of at most MAX_SEGMENT bytes."""
    while len(part) > MAX_SEGMENT:
        cut = _cut(part)
        yield part[:cut]
        part = part[cut:]
    yield part


def _document(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """The segments of one document given as consecutive blocks of its bytes: stripped, cut at blank lines (each
    separator a segment of its own) and at MAX_SEGMENT. Whitespace at the end is held back until text follows."""
    held: list[bytes] = []  # the last segment with text, then whitespace-only segments after it
    carry, started = b"", False

    def emit(segment: bytes) -> Iterator[bytes]:
        nonlocal held
        if segment.strip():
            yield from held
            held = [segment]
        elif held and segment:
            held.append(segment)

    for block in blocks:
        if not started:
            block = block.lstrip()
            if not block:
                continue
            started = True
        parts = (carry + block).split(DOC_SEPARATOR)
        carry = parts.pop()
        for part in parts:
            for segment in _bounded(part):
                yield from emit(segment)
            yield from emit(DOC_SEPARATOR)
        while len(carry) > MAX_SEGMENT + 1:  # its last byte may start a separator the next block completes
            cut = _cut(carry)
            yield from emit(carry[:cut])
            carry = carry[cut:]
    for segment in _bounded(carry):
        yield from emit(segment)
    if held:
        yield held[0].rstrip()


def not_text(where: str, data: bytes, at: int, offset: int) -> DataError:
    """The one line refusing a source whose byte `data[at]` (at `offset` in its file) is not UTF-8 text."""
    kind = " (a NUL: a binary or UTF-16 file?)" if data[at] == 0 else ""
    return DataError(f"{where} is not UTF-8 text: byte 0x{data[at]:02x} at offset {offset:,}{kind}; give UTF-8 "
                     "text, or set train.data_errors=replace to read bad bytes as U+FFFD")


def _utf8(data: bytes, errors: str, final: bool) -> tuple[bytes, int, int]:
    """(the valid UTF-8 prefix of `data` as it is read, bytes of `data` used, index of the first bad byte or -1).
    A character cut at the end is left unused unless `final`; NUL counts as bad under strict (no text holds one)."""
    try:
        _, used = codecs.utf_8_decode(data, "strict", final)
    except UnicodeDecodeError as exc:
        if errors == "strict":
            return b"", 0, exc.start
        text, used = codecs.utf_8_decode(data, "replace", final)
        return text.encode(), used, -1
    nul = data.find(0, 0, used) if errors == "strict" else -1
    return data[:used], used, nul


def _file_blocks(path: Path, where: str, errors: str = "strict") -> Iterator[bytes]:
    """A text file's bytes in blocks, checked as UTF-8 (DATA_ERRORS); a character is never split between blocks."""
    pending, offset = b"", 0
    with open(path, "rb") as f:
        while True:
            block = f.read(BLOCK)
            data = pending + block
            text, used, bad = _utf8(data, errors, final=not block)
            if bad >= 0:
                raise not_text(where, data, bad, offset + bad)
            if text:
                yield text
            pending, offset = data[used:], offset + used
            if not block:
                return


def _jsonl_records(path: Path, key: str, text_key: str, errors: str = "strict") -> Iterator[bytes]:
    with open(path, "rb") as f:
        offset = 0
        for number, raw in enumerate(f, 1):
            text, used, bad = _utf8(raw, errors, final=True)
            if bad >= 0:
                raise not_text(f"{key}={path} line {number}", raw, bad, offset + bad)
            offset += len(raw)
            line = text.decode()
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{key}={path} line {number} is not JSON ({exc}); a .jsonl file holds one JSON "
                                "object a line") from None
            value = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(value, str):
                keys = f" (its keys: {', '.join(sorted(record)[:8])})" if isinstance(record, dict) else ""
                raise DataError(f"{key}={path} line {number} has no {text_key!r} string{keys}; set "
                                "train.data_text_key to the key of its text")
            yield value.encode("utf-8")


def segments(path: str | Path | None, key: str = "train.data", text_key: str = "text",
             progress: Progress | None = None, errors: str = "strict",
             breaks: bool = False) -> Iterator[bytes | None]:
    """The text of a source as segments (see the module docstring), documents joined by DOC_SEPARATOR, or by
    DOCUMENT_BREAK when `breaks`; `progress` is told the bytes read. Bytes that are not UTF-8 text refuse the source,
    or read as U+FFFD with errors="replace" (train.data_errors)."""
    if errors not in DATA_ERRORS:
        raise DataError(f"train.data_errors={errors!r} is not one of {', '.join(DATA_ERRORS)}")
    files = text_files(path, key)
    jsonl = path is not None and Path(path).suffix.lower() in JSONL_SUFFIXES
    total, done, told = sum(f.stat().st_size for f in files), 0, 0
    first = True
    for file in files:
        documents = ([record] for record in _jsonl_records(file, key, text_key, errors)) if jsonl else \
            [_file_blocks(file, f"{key}={file}", errors)]
        for blocks in documents:
            opened = False
            for segment in _document(blocks):
                if not opened and not first:
                    yield DOCUMENT_BREAK if breaks else DOC_SEPARATOR
                opened, first = True, False
                yield segment
                done += len(segment)
                if progress and done - told >= PROGRESS_EVERY:
                    progress(min(done, total), total)
                    told = done
    if progress:
        progress(total, total)
    if first:
        raise DataError(f"{source_name(path, key)} is empty")


def check_token_count(tokens: int, seq_len: int, name: str) -> None:
    if tokens < seq_len + 1:
        raise DataError(f"{name} holds {tokens} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; "
                        "lower train.seq_len or give more text")
