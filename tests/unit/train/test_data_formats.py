"""Every train.data format gives the same token stream for the same documents (a directory, .jsonl, a .bin or .npy
that moesys tokenize wrote, the run's cache: documents joined by eos; one text file is one document, its paragraphs
joined by their blank lines), a rank reads only its own windows, and a resumed run trains on exactly the tokens of an
uninterrupted one, bit for bit, in every format."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.config import MoesysConfig, TrainConfig
from runtime.parallel.groups import build_groups
from runtime.train.run_setup import prepare_run_dir
from runtime.files.run_dir import read_metrics
from runtime.data.dataset import TokenDataset
from runtime.train.loop import train
from runtime.data.text import CORPUS_DIR
from runtime.files.paths import TOKENS
from runtime.data.pretokenize import prepare_tokens, read_tokens, tokenize_to_file
from runtime.data.tokenizer import load_tokenizer
from runtime.data.tokenizer_train import train_bpe
from tests.references import global_batch
from tests.trained_run import SMALL_MOE

DOCS = [(CORPUS_DIR / name).read_text().strip() for name in ("weather.txt", "machines.txt")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The same two documents as a text file, a directory, a .jsonl, and a BPE tokenizer trained on them."""
    root = tmp_path_factory.mktemp("formats")
    (root / "one.txt").write_text("\n\n".join(DOCS) + "\n")
    (root / "dir").mkdir()
    for i, doc in enumerate(DOCS):
        (root / "dir" / f"{i}.txt").write_text(doc)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    train_bpe(root / "dir", 300, root / "bpe.json")
    return {"text": root / "one.txt", "dir": root / "dir", "jsonl": root / "docs.jsonl", "bpe": root / "bpe.json"}


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_every_format_gives_the_same_token_stream(sources, tmp_path, tokenizer):
    tok = load_tokenizer(sources["bpe"] if tokenizer == "bpe" else "bytes")
    want = read_tokens(sources["dir"], tok).astype(np.int64)
    if tokenizer == "bytes":
        assert want.tolist() == [*DOCS[0].encode(), tok.eos_id, *DOCS[1].encode()]
    else:
        assert want.max() < 300 and len(want) < 0.7 * len("\n\n".join(DOCS).encode())
    one_document = read_tokens(sources["text"], tok).tolist()
    blank_line = list(tok.encode_pieces([b"\n\n"])[0])
    at = want.tolist().index(tok.eos_id)
    assert one_document == want[:at].tolist() + blank_line + want[at + 1:].tolist()
    assert np.array_equal(read_tokens(sources["jsonl"], tok), want)
    for suffix in (".bin", ".npy"):
        out = tmp_path / f"c{suffix}"
        assert tokenize_to_file(sources["jsonl"], out, tok)["tokens"] == len(want)
        assert np.array_equal(read_tokens(out, tok), want)
    made = prepare_tokens(tmp_path / TOKENS, {"train.data": str(sources["dir"])}, tok, "text")
    (tmp_path / "copy.json").write_text(tok.to_str())  # the workers read the run directory's copy of the tokenizer
    copy = load_tokenizer(tmp_path / "copy.json")
    cached = read_tokens(sources["dir"], copy, "train.data", cache_dir=tmp_path / TOKENS)
    assert isinstance(cached, np.memmap) and np.array_equal(cached, want) and made["train.data"].exists()


class Reads(np.ndarray):
    """Token ids that record every slice read from them."""

    seen: list

    def __getitem__(self, index):
        if isinstance(index, slice):
            Reads.seen.append((index.start, index.stop))
        return super().__getitem__(index)


def test_a_rank_reads_only_the_windows_of_its_own_share():
    tokens = np.arange(10_001, dtype=np.uint16).view(Reads)
    Reads.seen = []
    data = TokenDataset(tokens, seq_len=10, seed=3)
    inputs, _ = data.rank_batch(step=7, rank=1, world_size=4, micro_batch_size=2)
    assert len(Reads.seen) == 2 and all(stop - start == 11 for start, stop in Reads.seen)
    assert [start for start, _ in Reads.seen] == inputs[:, 0].tolist()
    global_inputs, _ = global_batch(data, step=7, global_batch_size=8)
    assert torch.equal(inputs, global_inputs[2:4])


def run_config(run_dir: Path, data: str, steps: int, tokenizer: str = "bytes") -> MoesysConfig:
    vocab = 300 if tokenizer != "bytes" else 256  # a copy: SMALL_MOE is shared with other modules' runs
    cfg = MoesysConfig(model=replace(SMALL_MOE, vocab_size=vocab),
                       train=TrainConfig(max_steps=steps, micro_batch_size=2, seq_len=16, warmup_steps=1,
                                         checkpoint_every=2, run_dir=str(run_dir), data=data, tokenizer=tokenizer))
    cfg.topology.nproc_per_node = 1
    return cfg


def losses_of(cfg: MoesysConfig) -> list[float]:
    path = prepare_run_dir(cfg)
    train(cfg, path, build_groups(1, 0, 1, 1), torch.device("cpu"))
    return [m["loss"] for m in read_metrics(path) if "loss" in m]


@pytest.mark.parametrize("fmt", ["text", "dir", "jsonl", "bin", "npy"])
def test_a_resumed_run_trains_on_the_tokens_of_an_uninterrupted_one_bit_for_bit(sources, tmp_path, fmt):
    tokenizer = str(sources["bpe"]) if fmt in ("jsonl", "npy") else "bytes"
    data = sources.get(fmt)
    if fmt in ("bin", "npy"):
        data = tmp_path / f"c.{fmt}"
        tokenize_to_file(sources["text"], data, load_tokenizer(tokenizer))
    whole = losses_of(run_config(tmp_path / "whole", str(data), 4, tokenizer))
    losses_of(run_config(tmp_path / "cut", str(data), 2, tokenizer))
    resumed = losses_of(run_config(tmp_path / "cut", str(data), 4, tokenizer))
    assert [m.get("resumed_from") for m in read_metrics(tmp_path / "cut")] == [None, None, 2, None]
    assert len(whole) == 4 and resumed == whole
