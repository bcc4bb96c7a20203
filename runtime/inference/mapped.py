"""safetensors files read in place: every tensor is a view of the file's memory map, so opening a checkpoint costs
no memory until a tensor is used, and a tensor that is only read (an expert computed where it lies) is never
copied. The page cache is what holds the bytes; the kernel may drop and re-read them under memory pressure.
Whole tensors are copied with the kernel's readahead; ranges read piecemeal (streamed experts) are marked random.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor

from runtime.errors import UserError
from runtime.files import tensorfile
from runtime.files.tensorfile import DTYPES, unreadable_reason
from runtime.inference.cpu_bandwidth import empty_weight


class MappedFileError(UserError):
    """A safetensors file that cannot be read in place (torn header, unknown dtype, data past its end)."""


def read_header(path: Path) -> tuple[dict, int]:
    """(header, byte offset where the data section starts) of the file at `path` (runtime/files/tensorfile.read_header);
    MappedFileError when it is unreadable."""
    try:
        with open(path, "rb") as f:
            return tensorfile.read_header(f)
    except (OSError, struct.error, ValueError) as exc:
        raise MappedFileError(f"{path}: not a readable safetensors file ({unreadable_reason(exc)})") from None


def _entry_error(name: str, entry, data_size: int) -> str | None:
    """Why a header entry does not describe a tensor inside a data section of `data_size` bytes (None: it does)."""
    if not isinstance(entry, dict):
        return "is not an object"
    if entry.get("dtype") not in DTYPES:
        return f"has dtype {entry.get('dtype')!r}, not one of {', '.join(DTYPES)}"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        return f"has shape {shape!r}, not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        return f"has data_offsets {offsets!r}, not [begin, end]"
    begin, end = offsets
    if not 0 <= begin <= end:
        return f"has data_offsets {offsets} (begin must be 0 <= begin <= end)"
    if end > data_size:
        return f"ends at byte {end} of a {data_size}-byte data section (truncated?)"
    expected = math.prod(shape) * DTYPES[entry["dtype"]].itemsize
    if end - begin != expected:
        return f"has {end - begin} bytes, its shape {shape} of {entry['dtype']} needs {expected}"
    return None


def _mincore() -> Callable[..., int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):  # no mincore on this OS
        return None
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return call


_MINCORE = _mincore()


def in_memory(address: int, length: int) -> bool:
    """Whether every page of the mapped range [address, address + length) is in memory (mincore; the address
    page-aligned); False where the kernel cannot say."""
    if _MINCORE is None:
        return False
    pages = -(-length // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    if _MINCORE(address, length, vec) != 0:
        return False
    return b"\0" not in vec.raw[:pages]  # bit 0 of each byte: resident; the other bits are unused


class MappedFile:
    """One safetensors file, memory-mapped privately (pages shared with the page cache, never written back).

    Every header entry is checked when the file is opened (known dtype, 0 <= begin <= end <= data size, as many
    bytes as its shape needs), so a damaged header is one error naming the file and tensor, never a view past the
    map."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.header, self.data_start = read_header(self.path)
        self.metadata = self.header.pop("__metadata__", None) or {}
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            for name, entry in self.header.items():
                why = _entry_error(name, entry, size - self.data_start)
                if why is not None:
                    raise MappedFileError(f"{self.path}: tensor {name} {why}")
            self._map: mmap.mmap | None = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                                              if size else None)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None else None

    def close(self) -> None:
        """Let go of the map: it is unmapped once no tensor view of it is left (a view keeps it alive, so closing
        never invalidates a tensor already handed out)."""
        self._map = self._bytes = None

    def contains(self, t: Tensor) -> bool:
        if self._bytes is None:
            return False
        offset = t.data_ptr() - self._bytes.data_ptr()
        return 0 <= offset < self._bytes.numel()

    def _mapped(self) -> tuple[mmap.mmap, Tensor]:
        """The map and its bytes; an error once closed (or for an empty file, which has no pages)."""
        if self._map is None or self._bytes is None:
            raise RuntimeError(f"{self.path} is not mapped (closed, or empty)")
        return self._map, self._bytes

    def _pages(self, t: Tensor) -> tuple[int, int]:
        """(offset of the first page in the map, bytes up to the end of `t`) of the pages `t` lies on."""
        offset = t.data_ptr() - self._mapped()[1].data_ptr()
        begin = offset - offset % mmap.PAGESIZE
        return begin, offset + t.numel() * t.element_size() - begin

    def _advise(self, t: Tensor, advice: int) -> None:
        self._mapped()[0].madvise(advice, *self._pages(t))

    def will_need(self, begin: int, length: int) -> None:
        """Start reading the pages [begin, begin + length) of this map (page-aligned offsets) that are not in memory,
        as one request; nothing when all are (asking costs the kernel a look-up per page, a tenth of reading them;
        asking whether they are in memory costs a page-table walk)."""
        mapped, data = self._mapped()
        if not in_memory(data.data_ptr() + begin, length):
            mapped.madvise(mmap.MADV_WILLNEED, begin, length)

    def random_access(self, t: Tensor) -> None:
        """Turn off readahead on `t`'s pages: it is read where it is used, not in file order (a streamed expert:
        readahead around a fault would read the neighbouring, unrouted experts too; `will_need` asks for exactly
        what is used). Elsewhere the kernel's readahead stays on, for whole-tensor copies."""
        if hasattr(mmap, "MADV_RANDOM"):
            self._advise(t, mmap.MADV_RANDOM)

    def names(self) -> Iterable[str]:
        return self.header.keys()

    def nbytes(self, name: str) -> int:
        begin, end = self.header[name]["data_offsets"]
        return end - begin

    def tensor(self, name: str) -> Tensor:
        """A view of the mapped bytes (a copy only where the file misaligns the tensor for its dtype)."""
        if self._bytes is None:
            raise ValueError(f"{self.path} is closed")
        entry = self.header[name]
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = (self.data_start + o for o in entry["data_offsets"])
        raw = self._bytes[begin:end]
        if begin % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).view(shape)


def copy_to(t: Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """A copy of `t` of its own on `device` (never a view of a memory map, which the kernel may drop); a large one
    on the CPU on huge pages (`empty_weight`)."""
    return empty_weight(t.shape, dtype or t.dtype, device).copy_(t)


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

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of tensor `name`, from its file's header (nothing read)."""
        entry = self.where[name].header[name]
        return DTYPES[entry["dtype"]], tuple(entry["shape"])

    def file_of(self, name: str) -> Path:
        return self.where[name].path

    def _mapped(self, tensors: Iterable[Tensor]) -> Iterable[tuple[MappedFile, Tensor]]:
        """(file, view) for each tensor that is a view of one of these files' maps; other tensors are skipped. A
        view shares its file's storage, so the storage's address names the file (one look-up, not one per file)."""
        by_storage = {file._bytes.data_ptr(): file for file in self.files if file._bytes is not None}
        for t in tensors:
            file = by_storage.get(t.untyped_storage().data_ptr())
            if file is not None and file.contains(t):
                yield file, t

    def will_need(self, tensors: Iterable[Tensor]) -> None:
        """Ask the kernel to read these views' pages now, one request a view (a no-op for other tensors). Not one
        request for views that lie next to each other: under a memory cap whose page cache holds less than a token's
        experts, a request of several experts' bytes reads at a fraction of the disk's pace (bench infer's capped
        runs)."""
        self.will_need_pages(self.pages(tensors))

    def pages(self, tensors: Iterable[Tensor]) -> list[tuple[MappedFile, int, int]]:
        """(file, offset of the first page, bytes) of each of these views (other tensors skipped): what `will_need`
        asks for, worked out once by a caller that asks for the same views again."""
        return [(file, *file._pages(t)) for file, t in self._mapped(tensors)]

    def will_need_pages(self, pages: list[tuple[MappedFile, int, int]]) -> None:
        """`will_need` for ranges from `pages`, one request a range; nothing for a file closed since. Ranges in one
        file are first looked up together, over the span from the first to the last (an expert's weights usually
        lie next to each other): nothing more is asked when all of it is in memory, the usual case."""
        by_file: dict[MappedFile, list[tuple[int, int]]] = {}
        for file, begin, length in pages:
            if file._bytes is not None:
                by_file.setdefault(file, []).append((begin, length))
        for file, ranges in by_file.items():
            if len(ranges) > 1:
                begin = min(b for b, _ in ranges)
                if in_memory(file._mapped()[1].data_ptr() + begin, max(b + n for b, n in ranges) - begin):
                    continue
            for begin, length in ranges:
                file.will_need(begin, length)

    def random_access(self, tensors: Iterable[Tensor]) -> None:
        """Turn off readahead on these views' pages (read piecemeal where they are used; a no-op for others)."""
        for file, t in self._mapped(tensors):
            file.random_access(t)

    def close(self) -> None:
        """Let go of every file's map (each is unmapped once no tensor view of it is left)."""
        for file in self.files:
            file.close()
