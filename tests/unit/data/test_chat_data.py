"""Chat data: records read as conversations (OpenAI messages, or prompt/completion), malformed lines refused naming
file:line and what is wrong; samples cut or refused past train.seq_len + 1 tokens; packing next fit in file order with
the assistant's tokens the only targets, positions restarting and segments numbering the samples of a row; one sample
a row, padded, without packing. The renderer here is a plain reference of ChatML over bytes (the template module
renders the real runs)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runtime.data.chat_data import IGNORE, ChatDataset, encode_samples, pack_rows
from runtime.data.chat_records import is_chat, read_chat
from runtime.data.text import DataError


def chatml_bytes(messages):
    """ChatML over UTF-8 bytes; the assistant's content, <|im_end|> and newline are its tokens."""
    ids, mask = [], []
    for m in messages:
        head = f"<|im_start|>{m['role']}\n".encode()
        body = (m["content"] + "<|im_end|>\n").encode()
        ids += list(head) + list(body)
        mask += [False] * len(head) + [m["role"] == "assistant"] * len(body)
    return ids, mask


def write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


CONVERSATION = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                             {"role": "assistant", "content": "Ciao"}]}


def test_messages_and_prompt_completion_records_are_conversations(tmp_path):
    path = write(tmp_path / "d.jsonl", [CONVERSATION, "", {"prompt": "2+2=", "completion": "4"}])
    records = list(read_chat(path))
    assert [r.line for r in records] == [1, 3]
    assert records[1].messages == [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    assert is_chat(path, "auto") and not is_chat(write(tmp_path / "t.jsonl", [{"text": "x"}]), "auto")
    assert not is_chat(None, "auto") and is_chat(path, "chat") and not is_chat(path, "text")


@pytest.mark.parametrize("line,says", [
    ("{not json", ":2: not valid JSON"),
    ("[1, 2]", ":2: not a JSON object"),
    ({"text": "x"}, r":2: neither 'messages' nor 'prompt' and 'completion' \(its keys: text\)"),
    ({"messages": []}, ":2: 'messages' is not a non-empty list"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r":2: messages\[0\].role='bot' is not one of system, user"),
    ({"messages": [{"role": "user", "content": 3}]}, r":2: messages\[0\].content is not a string"),
    ({"messages": [{"role": "user", "content": "x"}]}, ":2: no assistant message"),
    ({"prompt": "x"}, ":2: 'completion' is missing"),
    ({"prompt": "x", "completion": ""}, ":2: 'completion' is empty"),
])
def test_a_malformed_line_is_one_error_naming_file_line_and_problem(tmp_path, line, says):
    path = write(tmp_path / "d.jsonl", [CONVERSATION, line])
    with pytest.raises(DataError, match=f"^train.data={path}{says}"):
        list(read_chat(path))


def test_long_samples_are_cut_with_a_count_or_refused_naming_the_first(tmp_path):
    long = {"prompt": "x" * 40, "completion": "y" * 40}
    path = write(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, long, long])
    samples = encode_samples(path, chatml_bytes, seq_len=64)
    assert samples.cut == 2 and samples.count == 3 and np.diff(samples.offsets).max() == 65
    with pytest.raises(DataError, match=r"2 samples are longer than train.seq_len \+ 1 = 65 tokens \(the first: "
                                        r"line 2, 141 tokens\); raise train.seq_len"):
        encode_samples(path, chatml_bytes, seq_len=64, long_samples="refuse")


def test_rows_pack_next_fit_in_file_order():
    lengths = np.array([5, 4, 9, 2, 3, 11])  # positions: 4, 3, 8, 1, 2, 10
    assert pack_rows(lengths, 10, pack=True) == [[0, 1], [2, 3], [4], [5]]
    assert pack_rows(lengths, 10, pack=False) == [[0], [1], [2], [3], [4], [5]]


def test_a_packed_row_holds_each_sample_shifted_with_only_the_assistant_targets(tmp_path):
    records = [CONVERSATION, {"prompt": "Q", "completion": "A"}, {"prompt": "long question", "completion": "no"}]
    path = write(tmp_path / "d.jsonl", records)
    samples = encode_samples(path, chatml_bytes, seq_len=256)  # 174, 62 and 75 positions
    data = ChatDataset(samples, seq_len=256, pack=True, pad_id=0)
    assert data.rows == [[0, 1], [2]]
    batch = data.batch([0, 1])
    rendered = [chatml_bytes(m.messages) for m in read_chat(path)]
    at = 0
    for segment, (ids, mask) in enumerate(rendered[:2]):  # row 0: samples 0 and 1 back to back
        n = len(ids) - 1
        assert batch.inputs[0, at:at + n].tolist() == ids[:-1]
        assert batch.targets[0, at:at + n].tolist() == [i if m else IGNORE for i, m in zip(ids[1:], mask[1:])]
        assert batch.positions[0, at:at + n].tolist() == list(range(n))
        assert batch.segments[0, at:at + n].tolist() == [segment] * n
        at += n
    assert (batch.targets[0, at:] == IGNORE).all() and (batch.segments[0, at:] == 2).all()  # padding
    counted = sum(sum(m[1:]) for _, m in rendered)
    assert data.batch([0, 1]).target_count == counted
    assert "".join(chr(i) for i in batch.targets[0][batch.targets[0] != IGNORE].tolist()) == \
        "Hello<|im_end|>\nCiao<|im_end|>\nA<|im_end|>\n"


def test_unpacked_rows_hold_one_sample_each_padded(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "Q", "completion": "A"}] * 3)
    data = ChatDataset(encode_samples(path, chatml_bytes, seq_len=64), seq_len=64, pack=False, pad_id=7)
    batch = data.batch([0, 1, 2])
    n = len(chatml_bytes(next(read_chat(path)).messages)[0]) - 1
    assert batch.positions is None and batch.segments is None  # plain causal attention is exact
    assert (batch.inputs[:, n:] == 7).all() and (batch.targets[:, n:] == IGNORE).all()


def test_ranks_take_contiguous_slices_of_the_global_batch(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "Q" * i, "completion": "A"} for i in range(1, 40)])
    data = ChatDataset(encode_samples(path, chatml_bytes, seq_len=32), seq_len=32, seed=3)
    for step in (0, 5):
        whole = data.rank_batch(step, 0, 1, 4)
        parts = [data.rank_batch(step, r, 2, 2) for r in (0, 1)]
        for field in ("inputs", "targets", "positions", "segments"):
            assert torch.equal(torch.cat([getattr(p, field) for p in parts]), getattr(whole, field))
