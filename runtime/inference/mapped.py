"""safetensors files read in place: every tensor is a view of the file's memory map, so opening a checkpoint costs
no memory until a tensor is used, and a tensor that is only read (an expert computed where it lies) is never
copied. The page cache is what holds the bytes; the kernel may drop and re-read them under memory pressure.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor

from runtime.errors import UserError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class MappedFileError(UserError):
    """A safetensors file that cannot be read in place (torn header, unknown dtype, data past its end)."""


def read_header(path: Path) -> tuple[dict, int]:
    """(header, byte offset where the data section starts); the header keeps its __metadata__ entry."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as exc:
        raise MappedFileError(f"{path}: not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise MappedFileError(f"{path}: not a readable safetensors file (header is not an object)")
    return header, 8 + size


class MappedFile:
    """One safetensors file, memory-mapped privately (pages shared with the page cache, never written back)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.header, self.data_start = read_header(self.path)
        self.metadata = self.header.pop("__metadata__", None) or {}
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        for name, entry in self.header.items():
            if entry.get("dtype") not in DTYPES:
                raise MappedFileError(f"{self.path}: tensor {name} has dtype {entry.get('dtype')!r}, not one of "
                                      f"{', '.join(DTYPES)}")
            begin, end = entry["data_offsets"]
            if self.data_start + end > size:
                raise MappedFileError(f"{self.path}: tensor {name} ends past the end of the file (truncated?)")
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None else None
        if self._map is not None and hasattr(mmap, "MADV_RANDOM"):
            # Tensors are read where they are used, not in file order: the kernel's readahead around a fault
            # would read the neighbouring (unrouted) experts too. `will_need` asks for exactly what is used.
            self._map.madvise(mmap.MADV_RANDOM)

    def contains(self, t: Tensor) -> bool:
        if self._bytes is None:
            return False
        offset = t.data_ptr() - self._bytes.data_ptr()
        return 0 <= offset < self._bytes.numel()

    def will_need(self, t: Tensor) -> None:
        """Start reading the pages of `t` (a view of this map) in the background, as one request."""
        offset = t.data_ptr() - self._bytes.data_ptr()
        begin = offset - offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_WILLNEED, begin, offset + t.numel() * t.element_size() - begin)

    def names(self) -> Iterable[str]:
        return self.header.keys()

    def nbytes(self, name: str) -> int:
        begin, end = self.header[name]["data_offsets"]
        return end - begin

    def tensor(self, name: str) -> Tensor:
        """A view of the mapped bytes (a copy only where the file misaligns the tensor for its dtype)."""
        entry = self.header[name]
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = (self.data_start + o for o in entry["data_offsets"])
        raw = self._bytes[begin:end]
        if begin % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).view(shape)


def copy_to(t: Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """A copy of `t` of its own on `device` (never a view of a memory map, which the kernel may drop)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=device).copy_(t)


class TensorFiles:
    """Tensors by name across a set of safetensors files, each file mapped once and shared by every view."""

    def __init__(self, files: Iterable[Path]):
        self.files = [MappedFile(f) for f in files]
        self.where: dict[str, MappedFile] = {}
        for file in self.files:
            for name in file.names():
                self.where[name] = file
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> Tensor:
        file = self.where.get(name)
        if file is None:
            raise KeyError(name)
        self.used.add(name)
        return file.tensor(name)

    def nbytes(self, name: str) -> int:
        return self.where[name].nbytes(name)

    def file_of(self, name: str) -> Path:
        return self.where[name].path

    def will_need(self, tensors: Iterable[Tensor]) -> None:
        """Ask the kernel to read these views' pages now, each as one request (a no-op for other tensors)."""
        for t in tensors:
            for file in self.files:
                if file.contains(t):
                    file.will_need(t)
                    break
