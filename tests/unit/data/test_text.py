"""Text sources as segments: concatenated they are exactly the stripped text (today's bytes for files and
directories), whatever block size they are read in; .jsonl records by their text key; one-line errors."""

import json
import random
import re

import pytest

from runtime.data import text
from runtime.data.text import CORPUS_DIR, DataError, segments
from tests.references import read_text_bytes


def joined_files(folder) -> bytes:
    """What moesys read before segments: each *.txt stripped, empty ones left out, joined by a blank line."""
    parts = [p.read_bytes().strip() for p in sorted(folder.glob("*.txt"))]
    return b"\n\n".join(p for p in parts if p)


def test_the_shipped_corpus_reads_as_before():
    assert read_text_bytes(None) == joined_files(CORPUS_DIR)


def test_segments_are_the_stripped_text_and_do_not_depend_on_the_block_size(tmp_path, monkeypatch):
    rng = random.Random(0)
    alphabet = [b"a", b"b", b" ", b"\n", b"\t", "\u00e9".encode(), b"\r", "\u6771".encode()]
    path = tmp_path / "x.txt"
    for _ in range(400):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        if not data.strip():
            continue
        path.write_bytes(data)
        monkeypatch.setattr(text, "MAX_SEGMENT", 5)
        seen = []
        for block in (1, 3, 7, 100):
            monkeypatch.setattr(text, "BLOCK", block)
            found = list(segments(path))
            assert b"".join(found) == data.strip()
            assert all(len(s) <= 5 for s in found)
            for s in found:
                s.decode("utf-8")  # a cut never splits a character
            seen.append(found)
        assert all(found == seen[0] for found in seen), data


def test_blank_lines_are_segments_of_their_own_and_documents_are_joined_by_one(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo  \n\n\n")
    (tmp_path / "b.txt").write_text("   \n")  # empty once stripped: left out
    (tmp_path / "c.txt").write_text("\nthree")
    assert list(segments(tmp_path)) == [b"one", b"\n\n", b"two", b"\n\n", b"three"]


def test_jsonl_records_by_their_text_key(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"text": "first doc", "id": 1}, {"text": ""},
                                                      {"text": " second\n\npart "}]) + "\n\n")
    assert read_text_bytes(path) == b"first doc\n\nsecond\n\npart"
    other = tmp_path / "e.jsonl"
    other.write_text(json.dumps({"body": "under another key"}) + "\n")
    assert read_text_bytes(other, text_key="body") == b"under another key"


@pytest.mark.parametrize("lines,message", [
    (['{"text": "ok"}', "{broken"], "line 2 is not JSON"),
    (['{"body": "x", "id": 3}'], "line 1 has no 'text' string (its keys: body, id); set train.data_text_key"),
    (['["a", "list"]'], "line 1 has no 'text' string; set train.data_text_key"),
    (['{"text": 5}'], "line 1 has no 'text' string"),
])
def test_a_bad_jsonl_line_is_one_line_naming_the_key_the_file_and_the_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=re.escape(message)) as err:
        read_text_bytes(path, "train.eval_data")
    assert str(err.value).startswith(f"train.eval_data={path}") and "\n" not in str(err.value)


def test_missing_empty_and_txt_less_sources(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_text_bytes(tmp_path / "nope")
    (tmp_path / "blank.jsonl").write_text('{"text": "  "}\n')
    with pytest.raises(DataError, match="is empty"):
        read_text_bytes(tmp_path / "blank.jsonl")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match=r"holds no \*\.txt"):
        read_text_bytes(tmp_path / "d")


@pytest.mark.parametrize("block", [1, 2, 3, 5, 4096])
def test_utf8_is_checked_across_block_edges_and_names_the_bad_byte_in_the_file(tmp_path, monkeypatch, block):
    monkeypatch.setattr(text, "BLOCK", block)
    good = tmp_path / "good.txt"
    good.write_text("naïve café ünïcode € 𝄞 text")
    assert read_text_bytes(good) == good.read_bytes()
    for raw, offset, byte in ((b"ab\xe2\x82", 2, "byte 0xe2"), (b"abc\xe2\x28\xa1", 3, "byte 0xe2"),
                              (b"caf\xc3\xa9 \x00", 6, "byte 0x00")):
        bad = tmp_path / "bad.txt"
        bad.write_bytes(raw)
        with pytest.raises(DataError, match=f"is not UTF-8 text: {byte} at offset {offset}"):
            read_text_bytes(bad)
    bad.write_bytes(b"caf\xe9 ok \xff\xfe end")
    assert read_text_bytes(bad, errors="replace") == b"caf\xe9 ok \xff\xfe end".decode(errors="replace").encode()
