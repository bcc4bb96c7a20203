"""Data a new user hands moesys by mistake, through the real command: a binary (not UTF-8) file is refused by every
verb that reads text, naming the first bad byte's offset, unless train.data_errors=replace asks to read it anyway;
a vocabulary the tokenizers library cannot allocate is refused with its bound; `moesys tokenize --json` gives the
fields its summary documents."""

from __future__ import annotations

import json

import pytest

from runtime.data.text import CORPUS_DIR
from tests.cli.conftest import FAST_TINY, refused, run_moesys
from tests.trained_run import train_run_dir

BINARY = "a café\n".encode() + bytes(range(128, 256)) * 1600 + b"\x00" * 1000
"""About 200 KB whose first byte that is not UTF-8 text is 0x80 at offset 8 (after "a café\\n")."""
SAYS = "is not UTF-8 text: byte 0x80 at offset 8"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_run_dir(tmp_path_factory.mktemp("run"))


def test_a_binary_file_is_refused_by_every_verb_that_reads_text(tmp_path, run_dir):
    data = tmp_path / "program"
    data.write_bytes(BINARY)
    assert SAYS in refused("tokenizer", "train", f"data={data}", "vocab_size=300", f"out={tmp_path / 'tok.json'}")
    assert SAYS in refused("tokenize", f"data={data}", f"out={tmp_path / 'tokens.bin'}")
    assert SAYS in refused("train", *FAST_TINY, f"train.data={data}", f"train.run_dir={tmp_path / 'run'}",
                           "train.max_steps=1")
    assert SAYS in refused("eval", f"checkpoint={run_dir}", f"data={data}")
    assert "train.data_errors=replace" in refused("tokenize", f"data={data}", f"out={tmp_path / 'tokens.bin'}")
    folder = tmp_path / "texts"  # a directory's file is named, and a .jsonl's line
    folder.mkdir()
    (folder / "a.txt").write_text("fine text\n")
    (folder / "b.txt").write_bytes(b"ok\xff")
    assert f"data={folder / 'b.txt'} is not UTF-8 text: byte 0xff at offset 2" in refused(
        "tokenize", f"data={folder}", f"out={tmp_path / 'tokens.bin'}")
    (tmp_path / "r.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    assert "r.jsonl line 2 is not UTF-8 text: byte 0xe9 at offset 30" in refused(
        "tokenize", f"data={tmp_path / 'r.jsonl'}", f"out={tmp_path / 'tokens.bin'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["program", "r.jsonl", "texts"]


def test_data_errors_replace_reads_bad_bytes_as_the_replacement_character(tmp_path):
    data = tmp_path / "latin1.txt"
    data.write_bytes("naïve text\n".encode("latin-1") * 100)
    out = tmp_path / "tokens.bin"
    done = run_moesys("tokenize", f"data={data}", f"out={out}", "train.data_errors=replace", "--json")
    assert done.returncode == 0, done.stderr
    expected = data.read_bytes().decode("utf-8", errors="replace").strip().encode()
    assert json.loads(done.stdout)["tokens"] == len(expected) and out.read_bytes() == b"".join(
        bytes([b, 0]) for b in expected)  # the byte tokenizer's uint16 ids
    assert "train.data_errors='sloppy' is not one of" in refused(
        "tokenize", f"data={data}", f"out={out}", "train.data_errors=sloppy")


def test_a_vocabulary_past_the_bound_is_refused_naming_it(tmp_path):
    line = refused("tokenizer", "train", f"data={CORPUS_DIR / 'weather.txt'}", "vocab_size=1000000000",
                   f"out={tmp_path / 'tok.json'}")
    assert "vocab_size=1000000000 must be between 259" in line and "1,048,576" in line
    assert not list(tmp_path.iterdir())


def test_tokenize_json_gives_the_documented_fields(tmp_path):
    done = run_moesys("tokenize", f"data={CORPUS_DIR / 'weather.txt'}", f"out={tmp_path / 'w.bin'}", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert list(summary) == ["data", "out", "tokens", "dtype", "tokenizer", "text_bytes", "seconds"]
    assert summary["text_bytes"] == (CORPUS_DIR / "weather.txt").stat().st_size
