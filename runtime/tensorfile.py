"""safetensors files that carry a checksum of their tensor bytes, written atomically and verified on load.

The CRC-32 of the data section (everything after the JSON header) goes into the header's `__metadata__` as
`moesys.crc32`, so a damaged or truncated checkpoint or expert file is named on resume instead of loading garbage.
Files without the key (written before checksums existed) are accepted as they are.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import torch
from safetensors.torch import save

from runtime.errors import UserError
from runtime.io import atomic_write_bytes

CHECKSUM_KEY = "moesys.crc32"
_CHUNK = 16 << 20


class ChecksumError(UserError):
    """A tensor file whose bytes do not match the checksum it was written with."""


def to_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors serialization of `tensors` with the checksum of its data section in the header."""
    blob = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    header_len = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + header_len])
    data = memoryview(blob)[8 + header_len:]
    header.setdefault("__metadata__", {})[CHECKSUM_KEY] = f"{zlib.crc32(data):08x}"
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section stays 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(encoded)) + encoded + bytes(data)


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` to `path` atomically (temp file, fsync, rename) with their checksum."""
    atomic_write_bytes(path, to_bytes(tensors, metadata))
    return Path(path)


def verify(path: str | Path) -> None:
    """Raise ChecksumError naming `path` when its tensor bytes do not match the recorded checksum."""
    path = Path(path)
    with open(path, "rb") as f:
        try:
            header_len = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(header_len))
        except (struct.error, ValueError) as exc:
            raise ChecksumError(f"{path} is not a readable safetensors file ({exc}); it is damaged") from None
        expected = (header.get("__metadata__") or {}).get(CHECKSUM_KEY)
        if expected is None:
            return
        crc = 0
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    if f"{crc:08x}" != expected:
        raise ChecksumError(f"{path} is damaged: its tensor bytes do not match the checksum written with it "
                            "(restore the file or resume from an older checkpoint)")
