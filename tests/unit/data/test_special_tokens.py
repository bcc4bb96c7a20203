"""The special tokens: eos and ChatML's markers as the byte tokenizer's ids 256-258 and a trained BPE's 0-2; a model
of 256 rows keeps the bytes alone, the very tokenizer.json runs made before the special tokens carry; training data's
documents joined by eos (against a plain join of each document's ids from the `tokenizers` library itself), their
special tokens' strings read as text, while prompts read them as the tokens."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from tokenizers import Tokenizer as LibraryTokenizer

from runtime.config import ModelConfig, MoesysConfig
from runtime.data.pretokenize import encode_source, tokenize_to_file
from runtime.data.text import CORPUS_DIR
from runtime.data.token_file import open_token_file
from runtime.data.tokenizer import (EOS, IM_END, IM_START, ByteTokenizer, JsonTokenizer, byte_tokenizer,
                                    byte_tokenizer_json, load_tokenizer, run_tokenizer)
from runtime.data.tokenizer_train import train_bpe
from tests.references import read_text_bytes

BYTES_BEFORE_SPECIALS_SHA256 = "a392c4a454514617a0725843eb628a4b3fb1fa3f5c31b82ceea06cbbaa956ad9"
"""sha256 of the tokenizer.json every byte-level run made before the special tokens carries."""

DOCS = ["The river rose in spring.", "A page about <|endoftext|> and <|im_start|>user, naïve café.",
        "Third one, with a line\nbreak."]


def test_a_model_of_256_rows_keeps_the_bytes_alone_as_runs_made_before(tmp_path):
    legacy = byte_tokenizer_json(specials=False)
    assert hashlib.sha256(legacy.encode()).hexdigest() == BYTES_BEFORE_SPECIALS_SHA256
    (tmp_path / "tokenizer.json").write_text(legacy)
    old = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(old, ByteTokenizer) and old.vocab_size == 256 and old.eos_id is None and old.stop_ids == ()
    for rows in (256, 258):
        assert byte_tokenizer(rows).to_str() == legacy
        assert run_tokenizer(MoesysConfig(model=ModelConfig(vocab_size=rows))).to_str() == legacy


@pytest.mark.parametrize("rows", [None, 259, 320])
def test_the_byte_tokenizer_of_a_model_with_rows_for_them_has_the_special_tokens(rows):
    tok = byte_tokenizer(rows)
    assert tok.special_ids == {EOS: 256, IM_START: 257, IM_END: 258} and tok.vocab_size == 259
    assert (tok.eos_id, tok.stop_ids) == (256, (256, 258))
    assert tok.to_str() == byte_tokenizer_json() != byte_tokenizer_json(specials=False)


def test_a_trained_bpe_has_the_special_tokens_as_its_first_ids(tmp_path):
    train_bpe(CORPUS_DIR, 300, tmp_path / "bpe.json")
    bpe = load_tokenizer(tmp_path / "bpe.json")
    assert isinstance(bpe, JsonTokenizer) and bpe.special_ids == {EOS: 0, IM_START: 1, IM_END: 2}
    assert (bpe.eos_id, bpe.stop_ids) == (0, (0, 2))
    added = json.loads((tmp_path / "bpe.json").read_text())["added_tokens"]
    assert [(t["id"], t["content"], t["special"]) for t in added] == [(0, EOS, True), (1, IM_START, True),
                                                                       (2, IM_END, True)]


def test_prompts_read_special_strings_as_the_tokens_and_training_text_as_text(tmp_path):
    train_bpe(CORPUS_DIR, 300, tmp_path / "bpe.json")
    for tok in (ByteTokenizer(), load_tokenizer(tmp_path / "bpe.json")):
        text = "hi<|im_start|>"
        assert tok.encode(text)[-1] == tok.special_ids[IM_START]
        assert tok.special_ids[IM_START] not in list(tok.encode_pieces([text.encode()])[0])
        ids, offsets = tok.encode_offsets(text)
        assert ids == tok.encode(text) and offsets[-1] == (2, 14)


def _plain_ids(tok, text: str, path) -> list[int]:
    """A document's ids as the `tokenizers` library gives them with special tokens' strings read as text."""
    if isinstance(tok, ByteTokenizer):
        return list(text.encode("utf-8"))
    library = LibraryTokenizer.from_file(str(path))
    library.encode_special_tokens = True
    return library.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_documents_are_joined_by_eos_and_their_special_strings_stay_text(tmp_path, kind):
    train_bpe(CORPUS_DIR, 300, tmp_path / "bpe.json")
    tok = ByteTokenizer() if kind == "bytes" else load_tokenizer(tmp_path / "bpe.json")
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"{i}.txt").write_text(f"\n  {doc}\n\n", encoding="utf-8")  # stripped as before
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS))
    expected = []
    for n, doc in enumerate(DOCS):
        expected += ([tok.eos_id] if n else []) + _plain_ids(tok, doc, tmp_path / "bpe.json")
    for source in (folder, tmp_path / "d.jsonl"):
        assert np.concatenate(list(encode_source(source, tok))).tolist() == expected
    tokenize_to_file(folder, tmp_path / "t.bin", tok)
    assert open_token_file(tmp_path / "t.bin", tok.vocab_size).tolist() == expected


def test_a_tokenizer_without_eos_joins_documents_by_a_blank_line_as_before():
    ids = np.concatenate(list(encode_source(None, ByteTokenizer(specials=False)))).tolist()
    assert ids == list(read_text_bytes(None))
    with_eos = np.concatenate(list(encode_source(None, ByteTokenizer()))).tolist()
    assert with_eos.count(256) == len(list(CORPUS_DIR.glob("*.txt"))) - 1  # one between each two files
