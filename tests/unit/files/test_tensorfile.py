"""The streaming safetensors writer: files safetensors reads, with the checksum verify() checks, written one
tensor at a time from a lazy stream, and atomically (a failed stream leaves nothing behind)."""

from __future__ import annotations

import json
import struct
import weakref
import zlib

import pytest
import torch
from safetensors import safe_open

from runtime.files.tensorfile import CHECKSUM_KEY, ChecksumError, save_tensors, spec_of, verify, write_tensors


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 5, generator=g), "half": torch.randn(7, generator=g).bfloat16(),
            "t": torch.randn(5, 4, generator=g).t(), "mask": torch.tensor([True, False, True]),
            "count": torch.arange(3, dtype=torch.int16), "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 3), "grad": torch.ones(2, requires_grad=True)}


def header(path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def test_save_tensors_round_trips_through_safetensors_with_a_checksum(tmp_path):
    path = save_tensors(tmp_path / "x.safetensors", tensors(), {"note": "kept"})
    verify(path)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["note"] == "kept"
        for key, t in tensors().items():
            back = f.get_tensor(key)
            assert back.dtype == t.dtype and torch.equal(back, t.detach()), key
    n, head = header(path)
    data = path.read_bytes()[8 + n:]
    assert (8 + n) % 8 == 0 and head["__metadata__"][CHECKSUM_KEY] == f"{zlib.crc32(data):08x}"
    itemsize = {"F64": 8, "F32": 4, "I16": 2, "BF16": 2, "BOOL": 1}
    for key, info in head.items():
        if key != "__metadata__":
            assert info["data_offsets"][0] % itemsize[info["dtype"]] == 0, key  # larger item sizes first


def test_a_lazy_stream_is_written_and_dropped_one_tensor_at_a_time(tmp_path):
    written = []

    def stream():
        for i in range(4):
            assert all(ref() is None for ref in written)  # the writer let go of every tensor it wrote
            t = torch.full((10,), float(i))
            written.append(weakref.ref(t))
            yield f"t{i}", t
            del t

    specs = {f"t{i}": (torch.float32, (10,)) for i in range(4)}
    path = write_tensors(tmp_path / "s.safetensors", specs, stream())
    verify(path)
    with safe_open(str(path), framework="pt") as f:
        assert [float(f.get_tensor(f"t{i}")[0]) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("stream", [
    [("a", torch.zeros(2))],  # ends early
    [("b", torch.zeros(2)), ("a", torch.zeros(2))],  # out of order
    [("a", torch.zeros(3)), ("b", torch.zeros(2))],  # another shape than the header says
])
def test_a_stream_that_breaks_the_header_leaves_no_file(tmp_path, stream):
    specs = {"a": (torch.float32, (2,)), "b": (torch.float32, (2,))}
    with pytest.raises(ValueError):
        write_tensors(tmp_path / "bad.safetensors", specs, stream)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_byte_is_named(tmp_path):
    path = save_tensors(tmp_path / "x.safetensors", {"w": torch.ones(1000)})
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="x.safetensors is damaged"):
        verify(path)


def test_spec_of_is_dtype_and_shape():
    assert spec_of(torch.zeros(2, 3, dtype=torch.bfloat16)) == (torch.bfloat16, (2, 3))


@pytest.mark.parametrize("head", [
    struct.pack("<Q", 2**63) + b"{}",  # a header length past the end of the file: refused before reading
    struct.pack("<Q", 20) + b"{}",
    b"\x01\x02",  # shorter than the length field
    struct.pack("<Q", 2) + b"[]",  # a header that is not an object
])
def test_an_unreadable_header_is_one_line_naming_the_file(tmp_path, head):
    path = tmp_path / "torn.safetensors"
    path.write_bytes(head)
    with pytest.raises(ChecksumError, match="torn.safetensors is not a readable safetensors file") as exc:
        verify(path)
    assert "\n" not in str(exc.value)
