"""safetensors files read in place: every header entry is checked when a file is opened (one line naming the file
and the tensor, never a traceback or a view past the map), the header length is checked against the file size
before it is read, closing a file never invalidates a view already handed out, and marking ranges for random
access leaves the bytes read unchanged."""

from __future__ import annotations

import json
import mmap
import struct

import pytest
import torch

from runtime.inference.mapped import MappedFile, MappedFileError, TensorFiles, read_header
from runtime.files.tensorfile import save_tensors
from tests.waiting import wait_until


def raw_file(path, header: dict, data: bytes = b""):
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


@pytest.mark.parametrize("entry,why", [
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "has 8 bytes, its shape [3] of F32 needs 12"),
    (5, "is not an object"),
    ({"dtype": "F32", "shape": [2]}, "has data_offsets None, not [begin, end]"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "begin must be 0 <= begin <= end"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, "begin must be 0 <= begin <= end"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "ends at byte 16 of a 8-byte data section"),
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "not a list of sizes"),
    ({"dtype": "F8", "shape": [8], "data_offsets": [0, 8]}, "has dtype 'F8', not one of"),
])
def test_a_malformed_entry_is_one_line_naming_the_file_and_tensor(tmp_path, entry, why):
    path = raw_file(tmp_path / "bad.safetensors", {"__metadata__": {}, "w": entry}, b"\0" * 8)
    with pytest.raises(MappedFileError) as exc:
        MappedFile(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: tensor w ") and why in message and "\n" not in message
    with pytest.raises(MappedFileError):
        TensorFiles([path])


@pytest.mark.parametrize("content", [
    struct.pack("<Q", 2**62) + b"{}",  # would ask for 4 EiB: refused before anything is read
    struct.pack("<Q", 9) + b"{}",
    b"\x05",
    struct.pack("<Q", 2) + b"[]",
])
def test_a_header_length_past_the_file_or_a_torn_header_is_one_line(tmp_path, content):
    path = tmp_path / "torn.safetensors"
    path.write_bytes(content)
    with pytest.raises(MappedFileError, match="torn.safetensors: not a readable safetensors file") as exc:
        read_header(path)
    assert "\n" not in str(exc.value) and str(exc.value).count("torn.safetensors") == 1


def test_a_valid_file_reads_every_tensor_and_an_empty_one(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
               "empty": torch.zeros(0, 5)}
    path = save_tensors(tmp_path / "ok.safetensors", tensors)
    files = TensorFiles([path])
    for name, t in tensors.items():
        assert torch.equal(files.get(name), t), name


def test_closing_keeps_views_valid_and_refuses_new_ones(tmp_path):
    path = save_tensors(tmp_path / "ok.safetensors", {"a": torch.arange(1000, dtype=torch.float32)})
    files = TensorFiles([path])
    view = files.get("a")
    files.close()
    assert float(view.sum()) == sum(range(1000))  # the view keeps its map
    with pytest.raises(ValueError, match="is closed"):
        files.get("a")
    files.will_need([view])  # no longer one of this object's maps: nothing to do
    files.random_access([view])


def test_page_ranges_worked_out_once_are_asked_for_while_open_and_skipped_once_closed(tmp_path):
    tensors = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(5000, dtype=torch.bfloat16)}
    files = TensorFiles([save_tensors(tmp_path / "x.safetensors", tensors)])
    views = [files.get(name) for name in tensors]
    pages = files.pages([*views, torch.ones(3)])  # a tensor of no map: skipped
    assert [file for file, _, _ in pages] == [files.files[0]] * 2
    for (_, begin, length), v in zip(pages, views, strict=True):
        assert begin % mmap.PAGESIZE == 0 and length >= v.numel() * v.element_size()
    files.will_need_pages(pages)
    files.close()
    files.will_need_pages(pages)  # closed since: nothing to ask
    assert all(torch.equal(v, tensors[name]) for v, name in zip(views, tensors, strict=True))


def test_random_access_and_will_need_leave_the_bytes_unchanged(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"e{j}": torch.randn(300, 7, generator=g) for j in range(5)}  # ranges not page aligned
    files = TensorFiles([save_tensors(tmp_path / "x.safetensors", tensors)])
    views = [files.get(f"e{j}") for j in range(5)]
    files.random_access(views[1:4])
    files.will_need(views[2:3])
    for j, v in enumerate(views):
        assert torch.equal(v, tensors[f"e{j}"])


def test_will_need_reads_pages_not_in_memory_and_asks_nothing_of_pages_that_are(tmp_path):
    """mincore says which pages are in memory: after eviction the range is not, after will_need (which starts the
    read) and a read it is, and will_need on pages in memory changes nothing."""
    from runtime.inference.mapped import in_memory
    from runtime.host.page_cache import evict

    path = save_tensors(tmp_path / "x.safetensors", {"w": torch.arange(1 << 20, dtype=torch.float32)})
    files = TensorFiles([path])
    view = files.get("w")
    file = files.files[0]
    begin, length = file._pages(view)
    address = file._bytes.data_ptr() + begin
    if not evict(path):
        pytest.skip("this system cannot evict a file from the page cache")
    assert not in_memory(address, length)
    files.will_need([view])
    assert float(view.sum()) == float(sum(range(1 << 20)))
    assert in_memory(address, length)
    files.will_need([view])
    assert in_memory(address, length)


def test_will_need_pages_asks_for_the_ranges_of_a_span_not_in_memory(tmp_path):
    """Two views of one file looked up together: after eviction their span is not in memory, so each range is asked
    for, and the kernel brings them in without anything reading them."""
    from runtime.host.page_cache import evict
    from runtime.inference.mapped import in_memory

    tensors = {"a": torch.arange(1 << 18, dtype=torch.float32), "b": torch.arange(1 << 18, dtype=torch.float32)}
    path = save_tensors(tmp_path / "x.safetensors", tensors)
    files = TensorFiles([path])
    pages = files.pages([files.get("a"), files.get("b")])
    if not evict(path):
        pytest.skip("this system cannot evict a file from the page cache")
    addresses = [(file._bytes.data_ptr() + begin, length) for file, begin, length in pages]
    assert not any(in_memory(*a) for a in addresses)
    files.will_need_pages(pages)
    wait_until(lambda: all(in_memory(*a) for a in addresses), what="the kernel to read the ranges asked for",
               timeout=30)
