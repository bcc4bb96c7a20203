"""Tokenizers: the byte tokenizer (UTF-8 bytes as ids, lossless round trip, lenient decode) and the same ids from its
tokenizer.json; loading a tokenizer.json (one-line errors); a trained byte-level BPE, also through AutoTokenizer."""

import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from runtime.data.text import CORPUS_DIR
from runtime.data.tokenizer import (ByteTokenizer, JsonTokenizer, TokenizerError, byte_tokenizer_json,
                                     hf_tokenizer_config, load_tokenizer, token_dtype)
from runtime.data.tokenizer_train import train_bpe


def test_round_trip_ascii_and_non_ascii():
    tok = ByteTokenizer()
    for text in ["", "hello world\n\nnext document", "naïve café – 東京 🌧️", "tab\tand\r\nnewlines"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert len(ids) == len(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_non_ascii_takes_several_bytes():
    assert ByteTokenizer().encode("é") == [0xC3, 0xA9]
    assert ByteTokenizer().encode("A") == [65]


def test_decode_skips_out_of_range_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([72, 256, 105, 999, -1]) == "H<|endoftext|>i"  # a special token reads as its string
    assert ByteTokenizer(specials=False).decode([72, 256, 105, 999, -1]) == "Hi"
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated two-byte sequence


def test_decode_accepts_tensors():
    tok = ByteTokenizer()
    text = "Wind is air moving — from high to low."
    ids_T = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    assert ids_T.tolist() == tok.encode(text)
    assert tok.decode(ids_T.to(torch.int64).view(1, -1)) == text


# ---- tokenizer.json: the byte tokenizer in that format, loading, training a byte-level BPE ----

TEXTS = ["", "hello world\n\nnext document", "naïve café – 東京 🌧️", "tab\tand\r\nnewlines", "  lead and trail  ",
         "ĠĊ look-alikes of the byte map", "\x00\x7f control"]


@pytest.mark.parametrize("specials,size", [(True, 259), (False, 256)])
def test_the_byte_tokenizer_as_tokenizer_json_gives_exactly_the_byte_ids(specials, size):
    tok, ours = HFTokenizer.from_str(byte_tokenizer_json(specials)), ByteTokenizer(specials)
    assert tok.get_vocab_size() == ours.vocab_size == size
    for text in TEXTS + ["a<|endoftext|>b<|im_start|>user\n<|im_end|>", "<|im_end"]:
        assert tok.encode(text, add_special_tokens=False).ids == ours.encode(text), text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert ours.to_str() == byte_tokenizer_json(specials)


def test_loading_the_byte_tokenizer_json_gives_the_byte_tokenizer_and_other_files_a_json_one(tmp_path):
    (tmp_path / "bytes.json").write_text(byte_tokenizer_json())
    assert isinstance(load_tokenizer(tmp_path / "bytes.json"), ByteTokenizer)
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    result = train_bpe(CORPUS_DIR, 300, tmp_path / "bpe.json")
    bpe = load_tokenizer(tmp_path / "bpe.json")
    assert isinstance(bpe, JsonTokenizer) and bpe.vocab_size == result["vocab_size"] == 300


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing.json", "does not exist"),
    (lambda p: p, "is a directory"),
    (lambda p: (p / "x.json").write_text("{not json") and p / "x.json", "is not a Hugging Face tokenizer.json"),
    (lambda p: (p / "y.json").write_text('{"model": 3}') and p / "y.json", "is not a Hugging Face tokenizer.json"),
])
def test_a_tokenizer_that_cannot_load_is_one_line_naming_the_key(tmp_path, make, message):
    with pytest.raises(TokenizerError, match=message) as err:
        load_tokenizer(make(tmp_path), "train.tokenizer")
    assert str(err.value).startswith("train.tokenizer=") and "\n" not in str(err.value)


def test_a_trained_bpe_round_trips_text_compresses_it_and_stays_within_the_vocabulary(tmp_path):
    result = train_bpe(CORPUS_DIR, 512, tmp_path / "sub" / "tok.json")
    assert result["vocab_size"] == 512 and result["text_bytes"] > 200_000
    tok = load_tokenizer(tmp_path / "sub" / "tok.json")
    text = (CORPUS_DIR / "weather.txt").read_text()
    ids = tok.encode(text)
    assert len(ids) < 0.6 * len(text.encode()) and max(ids) < 512
    assert tok.decode(ids) == text
    for unseen in TEXTS:  # every byte is in the vocabulary: nothing is unknown
        assert tok.decode(tok.encode(unseen)) == unseen
    assert tok.decode([5, 10_000, -1, 6]) == tok.decode([5, 6])  # ids outside the vocabulary are skipped


def test_training_refuses_a_vocabulary_below_the_bytes_and_a_token_file(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=258 must be between 259"):
        train_bpe(CORPUS_DIR, 258, tmp_path / "t.json")
    with pytest.raises(ValueError, match="vocab_size=100 must be between 259"):
        train_bpe(CORPUS_DIR, 100, tmp_path / "t.json")
    with pytest.raises(ValueError, match="is a token file"):
        train_bpe(tmp_path / "c.bin", 300, tmp_path / "t.json")
    assert not list(tmp_path.iterdir())  # nothing written


def test_transformers_autotokenizer_reads_it_with_the_same_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    train_bpe(CORPUS_DIR, 400, tmp_path / "tokenizer.json")
    ours = load_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer_config(256, ours)))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS[1:] + ["<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]:
        assert auto(text)["input_ids"] == ours.encode(text)
        assert auto.decode(ours.encode(text)) == text
    assert (auto.eos_token, auto.eos_token_id, auto.pad_token_id, auto.bos_token) == ("<|endoftext|>", 0, 0, None)


def test_token_files_take_the_smallest_dtype_the_vocabulary_fits():
    assert [token_dtype(v) for v in (256, 65_536, 65_537, 200_000)] == ["uint16", "uint16", "uint32", "uint32"]
