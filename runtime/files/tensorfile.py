"""safetensors files that carry a checksum of their tensor bytes, written atomically and verified on load.

The CRC-32 of the data section (everything after the JSON header) goes into the header's `__metadata__` as
`moesys.crc32`, so a damaged or truncated checkpoint or expert file is named on resume instead of loading garbage.
Files without the key (written before checksums existed) are accepted as they are.
`write_tensors` streams a file tensor by tensor (header first, checksum filled in last), so writing a checkpoint
needs no more memory than one tensor, however large the model.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open

from runtime.errors import UserError
from runtime.host.io import atomic_file

CHECKSUM_KEY = "moesys.crc32"
_CHUNK = 1 << 20
_CRC_PLACEHOLDER = "00000000"  # fixed width: the real checksum overwrites it in place once the data is written
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""The safetensors dtype names moesys reads and writes, and their torch dtypes."""
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

TensorSpec = tuple[torch.dtype, tuple[int, ...]]
"""What the header records of a tensor before its bytes exist: dtype and shape."""


class ChecksumError(UserError):
    """A tensor file whose bytes do not match the checksum it was written with."""


def spec_of(t: torch.Tensor) -> TensorSpec:
    return t.dtype, tuple(t.shape)


def _header(specs: dict[str, TensorSpec], metadata: dict[str, str] | None,
            checksum: bool = True, align: int = 8) -> tuple[bytes, int | None]:
    """The length-prefixed JSON header with a placeholder checksum, and the file offset of the placeholder (None
    without a checksum). The JSON is padded with spaces (safetensors allows it) so that the data section starts at
    a multiple of `align` bytes.

    The checksum is the first entry of the first object, so its position does not depend on any key or value."""
    if "__metadata__" in specs:
        raise ValueError("__metadata__ is reserved by safetensors and cannot name a tensor")
    meta = {CHECKSUM_KEY: _CRC_PLACEHOLDER} if checksum else {}
    meta.update({k: v for k, v in (metadata or {}).items() if k != CHECKSUM_KEY})
    header: dict = {"__metadata__": meta} if meta else {}
    offset = 0
    for key, (dtype, shape) in specs.items():
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % align)  # safetensors itself aligns the data section to 8 bytes
    if not checksum:
        return struct.pack("<Q", len(encoded)) + encoded, None
    prefix = json.dumps({"__metadata__": {CHECKSUM_KEY: ""}}, separators=(",", ":")).encode()[:-3]
    assert encoded.startswith(prefix)
    return struct.pack("<Q", len(encoded)) + encoded, 8 + len(prefix)


def encode_header(specs: dict[str, TensorSpec], align: int = 8) -> bytes:
    """The length-prefixed header of a file of tensors of `specs`, without a checksum, its data section starting at
    a multiple of `align` bytes (what `encode(..., checksum=False, align=align)` writes first)."""
    return _header(specs, None, checksum=False, align=align)[0]


def raw_bytes(t: torch.Tensor):
    """The tensor's bytes as a buffer: a view of a contiguous CPU tensor, one copy of any other."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy()  # via uint8: numpy has no bfloat16


def encode(tensors: dict[str, torch.Tensor], checksum: bool = True, align: int = 8) -> list:
    """The file of `tensors` as buffers, for a gather write: the header with the checksum of the data section
    filled in (none with checksum=False: `verify` then has nothing to check), then every tensor's own memory in
    dict order (no copy of a contiguous CPU tensor); the data section starts at a multiple of `align` bytes."""
    raws = [raw_bytes(t) for t in tensors.values()]
    if not checksum:
        return [encode_header({k: spec_of(t) for k, t in tensors.items()}, align), *raws]
    crc = 0
    for raw in raws:
        crc = zlib.crc32(raw, crc)
    head, crc_at = _header({k: spec_of(t) for k, t in tensors.items()}, None)
    assert crc_at is not None, "a header with a checksum has its place"
    return [head[:crc_at] + f"{crc:08x}".encode() + head[crc_at + 8:], *raws]


def write_tensors(path: str | Path, specs: dict[str, TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
                  metadata: dict[str, str] | None = None) -> Path:
    """Write a safetensors file atomically, one tensor at a time: `tensors` yields (key, tensor) in the order of
    `specs` and may produce each one lazily (a generator reading experts from a store); a tensor is dropped once
    its bytes are written. The CRC-32 of the data section is computed on the way and written into the header last.

    Tensors follow each other without gaps (safetensors' rule), so a tensor is aligned to its item size when
    `specs` lists larger item sizes first (save_tensors does); safetensors readers copy, so none relies on it."""
    head, crc_at = _header(specs, metadata)
    assert crc_at is not None, "a header with a checksum has its place"
    expected = iter(specs.items())
    crc = 0
    with atomic_file(path) as f:
        f.write(head)
        for key, t in tensors:
            want_key, want = next(expected, (None, None))
            if key != want_key or spec_of(t) != want:
                raise ValueError(f"write_tensors({path}): got {key} {spec_of(t)}, the header expects "
                                 f"{want_key} {want}")
            data = raw_bytes(t)
            f.write(data)
            crc = zlib.crc32(data, crc)
            del t, data
        missing = next(expected, None)
        if missing is not None:
            raise ValueError(f"write_tensors({path}): the stream ended before {missing[0]}")
        f.seek(crc_at)
        f.write(f"{crc:08x}".encode())
    return Path(path)


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` to `path` atomically (temp file, fsync, rename) with their checksum, streamed: no
    serialized copy of the dict is made. Larger item sizes first, so every tensor is aligned to its item size."""
    ordered = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    return write_tensors(path, {k: spec_of(t) for k, t in ordered}, ordered, metadata)


def read_header(f: BinaryIO) -> tuple[dict, int]:
    """(header, byte offset where the data section starts) of an open safetensors file, left positioned there; the
    header keeps its __metadata__ entry. Its length is checked against the file's size before it is read (a torn
    or foreign file cannot ask for 2**64 bytes). ValueError (or struct.error) with a one-line reason otherwise."""
    file_size = os.fstat(f.fileno()).st_size
    header_len = struct.unpack("<Q", f.read(8))[0]
    if header_len > file_size - 8:
        raise ValueError(f"its header length {header_len} is past the end of the {file_size}-byte file")
    header = json.loads(f.read(header_len))
    if not isinstance(header, dict):
        raise ValueError("its header is not an object")
    return header, 8 + header_len


def read_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor of the file at `path`, from its header alone; ChecksumError when the header is
    unreadable."""
    with open(path, "rb") as f:
        header = _readable_header(f, path)
    header.pop("__metadata__", None)
    return {name: tuple(entry["shape"]) for name, entry in header.items()}


def open_tensors(path: str | Path):
    """The file's tensors, memory-mapped and read lazily (safetensors' safe_open: `.keys()`, `.get_tensor(name)`;
    a context manager)."""
    return safe_open(str(path), framework="pt")


def unreadable_reason(exc: BaseException) -> str:
    """The first line of a header-reading error, for a one-line message."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _readable_header(f: BinaryIO, path: Path | str) -> dict:
    """read_header's header, or ChecksumError naming `path` when it cannot be parsed."""
    try:
        return read_header(f)[0]
    except (struct.error, ValueError) as exc:
        raise ChecksumError(f"{path} is not a readable safetensors file ({unreadable_reason(exc)}); it is "
                            "damaged") from None


def verify(path: str | Path) -> None:
    """Raise ChecksumError naming `path` when its tensor bytes do not match the recorded checksum (or its header
    is unreadable, read_header)."""
    path = Path(path)
    with open(path, "rb") as f:
        header = _readable_header(f, path)
        meta = header.get("__metadata__")
        expected = meta.get(CHECKSUM_KEY) if isinstance(meta, dict) else None
        if expected is None:
            return
        crc, chunk = 0, bytearray(_CHUNK)  # one reused buffer: verifying costs 1 MB, whatever the file size
        while n := f.readinto(chunk):
            crc = zlib.crc32(memoryview(chunk)[:n], crc)
    if f"{crc:08x}" != expected:
        raise ChecksumError(f"{path} is damaged: its tensor bytes do not match the checksum written with it "
                            "(restore the file or resume from an older checkpoint)")
