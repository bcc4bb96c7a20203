"""Token files: what moesys tokenize writes reads back as a memory map (numpy reads the .npy too), in the dtype the
vocabulary needs; a file written for another vocabulary, or not a token file, is a one-line error; an interrupted
write leaves nothing."""

import numpy as np
import pytest

from runtime.data.text import DataError
from runtime.data.token_file import check_ids, open_token_file, write_token_file


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
@pytest.mark.parametrize("vocab,dtype", [(256, np.uint16), (70_000, np.uint32)])
def test_written_ids_read_back_through_a_memory_map(tmp_path, suffix, vocab, dtype):
    parts = [np.arange(5), np.array([], dtype=np.int64), np.array([vocab - 1, 0, 7])]
    out = tmp_path / f"t{suffix}"
    assert write_token_file(out, parts, vocab) == 8
    tokens = open_token_file(out, vocab)
    assert isinstance(tokens, np.memmap) and tokens.dtype == dtype
    assert tokens.tolist() == [0, 1, 2, 3, 4, vocab - 1, 0, 7]
    if suffix == ".npy":
        assert np.load(out).tolist() == tokens.tolist()  # a plain .npy file
    else:
        assert out.stat().st_size == 8 * np.dtype(dtype).itemsize  # raw ids, no header


def test_a_users_npy_of_either_dtype_is_read_as_it_is(tmp_path):
    np.save(tmp_path / "a.npy", np.array([1, 2, 3], dtype=np.uint32))
    assert open_token_file(tmp_path / "a.npy", 256).tolist() == [1, 2, 3]


@pytest.mark.parametrize("make,message", [
    (lambda p: np.save(p / "f.npy", np.zeros(4, dtype=np.float32)) or p / "f.npy", "holds a float32 array"),
    (lambda p: np.save(p / "m.npy", np.zeros((2, 2), dtype=np.uint16)) or p / "m.npy", "of shape (2, 2)"),
    (lambda p: (p / "t.npy").write_bytes(b"not numpy") and p / "t.npy", "is not a readable .npy file"),
    (lambda p: (p / "odd.bin").write_bytes(b"abc") and p / "odd.bin", "not a whole number of uint16 ids"),
    (lambda p: (p / "e.bin").write_bytes(b"") is not None and p / "e.bin", "is empty"),
    (lambda p: p / "missing.bin", "does not exist"),
])
def test_a_file_that_is_not_a_token_file_is_one_line_naming_the_key(tmp_path, make, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        open_token_file(make(tmp_path), 256, "train.eval_data")
    assert str(err.value).startswith("train.eval_data=") and "\n" not in str(err.value)


def test_ids_beyond_the_vocabulary_are_refused(tmp_path):
    with pytest.raises(DataError, match="token id 300 is not below the tokenizer's 256"):
        write_token_file(tmp_path / "t.bin", [np.array([1, 300])], 256)
    assert not list(tmp_path.iterdir())  # the atomic write left nothing behind
    write_token_file(tmp_path / "t.bin", [np.array([1, 255])], 256)
    with pytest.raises(DataError, match="token id 255, not below the vocabulary's 200"):
        check_ids(open_token_file(tmp_path / "t.bin", 256), 200, "train.data=t.bin")
    with pytest.raises(DataError, match=r"must end in \.bin or \.npy"):
        write_token_file(tmp_path / "t.txt", [], 256)
