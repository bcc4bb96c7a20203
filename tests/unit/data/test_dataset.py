"""TokenDataset: deterministic order, rank shards that union to the global batch, resume, user paths."""

import pytest
import torch

from runtime.data.dataset import TokenDataset, build_task_datasets
from runtime.data.text import CORPUS_DIR, DataError
from runtime.data.tokenizer import ByteTokenizer
from tests.references import global_batch, read_text_bytes


@pytest.fixture(scope="module")
def corpus():
    return TokenDataset.from_path(None, seq_len=32, seed=7)


def test_shipped_corpus_is_readable_english_of_useful_size(corpus):
    files = sorted(CORPUS_DIR.glob("*.txt"))
    assert len(files) >= 3
    assert 150_000 <= corpus.num_tokens <= 400_000
    text = ByteTokenizer().decode(corpus.tokens.tolist())
    words = text.split()
    assert sum(w.strip(".,;:").isalpha() for w in words) / len(words) > 0.95
    assert "\n\n" in text and " the " in text


def test_targets_are_inputs_shifted_by_one(corpus):
    x, y = global_batch(corpus, step=5, global_batch_size=6)
    assert x.shape == y.shape == (6, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a contiguous window of the token stream
    stream = torch.from_numpy(corpus.tokens.astype("int64"))
    for row_x, row_y in zip(x, y):
        seq = torch.cat([row_x, row_y[-1:]])
        starts = (stream.unfold(0, 33, 32) == seq).all(dim=1).nonzero()
        assert starts.numel() >= 1


def test_deterministic_across_instances_and_seed_dependent(corpus):
    again = TokenDataset.from_path(None, seq_len=32, seed=7)
    other = TokenDataset.from_path(None, seq_len=32, seed=8)
    for step in (0, 3, 100):
        assert torch.equal(global_batch(corpus, step, 8)[0], global_batch(again, step, 8)[0])
    assert not torch.equal(global_batch(corpus, 0, 8)[0], global_batch(other, 0, 8)[0])
    assert not torch.equal(global_batch(corpus, 0, 8)[0], global_batch(corpus, 1, 8)[0])


@pytest.mark.parametrize("world_size,mbs", [(2, 4), (3, 2), (4, 1)])
def test_rank_shards_union_to_global_batch(corpus, world_size, mbs):
    for step in (0, 1, 17):
        gx, gy = global_batch(corpus, step, world_size * mbs)
        parts = [corpus.rank_batch(step, r, world_size, mbs) for r in range(world_size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), gx)
        assert torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_epochs_cover_every_window_once_then_reshuffle():
    tokens = torch.arange(41, dtype=torch.int64)  # 10 windows of 4 (+1) tokens
    ds = TokenDataset(tokens, seq_len=4, seed=3)
    assert ds.num_windows == 10
    first = global_batch(ds, 0, 10)[0][:, 0].tolist()  # batch 0 is epoch 0
    second = global_batch(ds, 1, 10)[0][:, 0].tolist()
    assert sorted(first) == sorted(second) == list(range(0, 40, 4))
    assert first != second
    # a batch that spans the epoch boundary continues with the next epoch's order
    spanning = global_batch(ds, 1, 7)[0][:, 0].tolist()  # samples 7..13
    assert spanning == first[7:] + second[:4]


def test_batches_are_a_function_of_step_so_resume_needs_only_the_step(corpus):
    """The trainer checkpoints only the step: a fresh dataset with the same seed and data resumes exactly."""
    straight = [corpus.rank_batch(step, 1, 2, 3) for step in range(8)]
    fresh = TokenDataset.from_path(None, seq_len=32, seed=7)
    for step in range(4, 8):
        got = fresh.rank_batch(step, 1, 2, 3)
        assert torch.equal(got[0], straight[step][0]) and torch.equal(got[1], straight[step][1])
    other_seed = TokenDataset.from_path(None, seq_len=32, seed=8)
    assert not torch.equal(other_seed.rank_batch(4, 1, 2, 3)[0], straight[4][0])


def test_user_file_and_directory(tmp_path):
    one = tmp_path / "a.txt"
    one.write_text("The river rose in the spring. " * 20, encoding="utf-8")
    ds = TokenDataset.from_path(one, seq_len=16, seed=0)
    assert ds.num_tokens == len(one.read_bytes().strip())
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "b.txt").write_text("second document, naïve café", encoding="utf-8")
    (folder / "a.txt").write_text("first document", encoding="utf-8")
    (folder / "notes.md").write_text("ignored", encoding="utf-8")
    assert read_text_bytes(folder) == "first document\n\nsecond document, naïve café".encode("utf-8")
    x, _ = global_batch(TokenDataset.from_path(folder, seq_len=8), 0, 2)
    assert x.shape == (2, 8)


def test_missing_empty_and_too_short_paths_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist") as err:
        TokenDataset.from_path(tmp_path / "nope.txt", seq_len=8)
    assert "nope.txt" in str(err.value) and "\n" not in str(err.value)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n ", encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        TokenDataset.from_path(empty, seq_len=8)
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match=r"no \*\.txt"):
        TokenDataset.from_path(tmp_path / "dir", seq_len=8)
    short = tmp_path / "short.txt"
    short.write_text("tiny", encoding="utf-8")
    with pytest.raises(DataError, match="fewer than train.seq_len"):
        TokenDataset.from_path(short, seq_len=8)
    assert issubclass(DataError, ValueError)


def test_bad_shard_arguments(corpus):
    with pytest.raises(DataError):
        corpus.rank_batch(0, rank=2, world_size=2, micro_batch_size=1)
    with pytest.raises(DataError):
        corpus.rank_batch(-1, rank=0, world_size=1, micro_batch_size=4)


def test_task_datasets_have_own_paths_and_orders(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("Light travels faster than sound. " * 40, encoding="utf-8")
    sets = build_task_datasets({"a": None, "b": None, "c": str(path)}, seq_len=16, seed=1)
    assert sets["a"].num_tokens == sets["b"].num_tokens != sets["c"].num_tokens
    assert not torch.equal(global_batch(sets["a"], 0, 4)[0], global_batch(sets["b"], 0, 4)[0])
    with pytest.raises(DataError, match="tasks.x.data="):
        build_task_datasets({"x": str(tmp_path / "missing")}, seq_len=16, seed=1)
