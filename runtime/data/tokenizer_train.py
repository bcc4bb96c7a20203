"""`moesys tokenizer train`: a byte-level BPE (GPT-2's scheme: the 256 bytes, then learned merges) trained on the
user's text with the Hugging Face `tokenizers` library, written as the tokenizer.json `train.tokenizer` takes. Its
first ids are the special tokens (runtime/data/tokenizer.py: eos 0, then ChatML's <|im_start|> 1 and <|im_end|> 2).

It learns from the same segments training encodes (runtime/data/text.py), so its merges never span a blank line
or a segment cut, and a text it was trained on encodes as training reads it.
"""

from __future__ import annotations

import time
from pathlib import Path

from runtime.data.text import Progress, is_token_file, segments, source_name, text_files
from runtime.data.tokenizer import EOS, SPECIAL_TOKENS, SPECIAL_VOCAB, JsonTokenizer
from runtime.errors import UserError
from runtime.host.io import atomic_write_text, remove_stale_temps

MAX_VOCAB = 1 << 20
"""The largest vocabulary `moesys tokenizer train` learns (1,048,576). The tokenizers library sizes its trainer's
tables by the vocabulary asked for, not by the text: a billion aborts the process on an allocation no machine makes.
Released models use at most 262,144 tokens (Gemma's), and an embedding row per token at any useful hidden size makes
more than a million impractical, so 2^20 leaves room without letting a typo take the machine's memory."""


def train_bpe(path: str | Path | None, vocab_size: int, out: str | Path, key: str = "data",
              text_key: str = "text", progress: Progress | None = None, errors: str = "strict") -> dict:
    """Train a byte-level BPE of at most `vocab_size` tokens on a text source and write it to `out` (atomically);
    the `moesys tokenizer train --json` summary. A corpus with fewer distinct merges gives a smaller vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not SPECIAL_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UserError(f"vocab_size={vocab_size} must be between {SPECIAL_VOCAB} (the 256 bytes a byte-level BPE "
                        f"starts from and its {len(SPECIAL_TOKENS)} special tokens) and {MAX_VOCAB:,} (the largest "
                        "moesys trains: vocabularies of released models stay under 300,000)")
    if is_token_file(path):
        raise UserError(f"{key}={path} is a token file; a tokenizer learns from text (a file, a directory of *.txt, "
                        "a .jsonl)")
    out = Path(out).expanduser()
    if out.is_dir():
        raise UserError(f"out={out} is a directory; give the tokenizer.json file to write")
    files = text_files(path, key)
    began = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    texts = (segment.decode("utf-8") for segment in segments(path, key, text_key, progress, errors)
             if segment is not None)  # no DOCUMENT_BREAK: breaks=False
    tokenizer.train_from_iterator(texts, trainer=trainer)
    trained = JsonTokenizer(tokenizer, str(out))
    atomic_write_text(out, trained.to_str())
    remove_stale_temps(out)  # what a run killed mid-write left beside it
    return {"data": source_name(path, key).removeprefix(f"{key}="), "out": str(out.resolve()),
            "vocab_size": trained.vocab_size, "requested_vocab_size": vocab_size, "eos_token": EOS,
            "text_bytes": sum(f.stat().st_size for f in files), "seconds": round(time.perf_counter() - began, 3)}
