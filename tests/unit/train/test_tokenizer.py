"""ByteTokenizer: UTF-8 bytes as ids, lossless round trip, lenient decode."""

import torch

from runtime.train.tokenizer import ByteTokenizer


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
    assert tok.decode([72, 256, 105, 999, -1]) == "Hi"
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated two-byte sequence


def test_encode_bytes_matches_encode_and_decode_accepts_tensors():
    tok = ByteTokenizer()
    text = "Wind is air moving — from high to low."
    ids_T = tok.encode_bytes(text.encode("utf-8"))
    assert ids_T.dtype == torch.uint8
    assert ids_T.tolist() == tok.encode(text)
    assert tok.decode(ids_T.to(torch.int64).view(1, -1)) == text
    assert tok.encode_bytes(b"").numel() == 0
