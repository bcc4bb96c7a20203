"""The expert store's file I/O at disk speed: one gather write (os.writev) of a safetensors file straight from the
tensors' memory, and one scatter read (os.preadv) straight into fresh tensors (the paper's "2D Prefetch Scheduling": SSD
traffic overlapped with compute needs large requests, not a serialised copy or page faults on a memory map).

The files are the safetensors files of runtime/files/tensorfile.py, so `verify` and any safetensors reader read them.
A durable file carries the data's `moesys.crc32`, is replaced by rename (a reader sees the old or the new file, never
a torn one) and fsynced. Live files are working memory, rebuilt from a checkpoint on resume, and the store's readers
wait for the queued writes of a key (write-behind): a live file is rewritten in place, without a checksum (a CRC of
every write costs about as much CPU as the write itself, for a check nothing would make).
"""

from __future__ import annotations

import os
import struct
import tempfile
import threading
from pathlib import Path

import torch

from runtime.io import fsync_dir
from runtime.files.tensorfile import DTYPES, ChecksumError, encode, raw_bytes, read_header

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def write_file(path: Path, tensors: dict[str, torch.Tensor], durable: bool) -> int:
    """Write `path` as a file of `tensors` with one gather write; returns its size. Not `durable`, a file of that
    size already there is rewritten in place (its blocks reused: no new file, no rename, no unlink of the old one);
    else a temp file beside it is renamed over it, with `durable` fsynced first and the directory after."""
    buffers = encode(tensors, checksum=durable)
    size = sum(len(memoryview(b).cast("B")) for b in buffers)
    if not durable and _size_of(path) == size:
        fd = os.open(path, os.O_WRONLY)
        try:
            written = _transfer(fd, buffers)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # start writeback now (see below)
        finally:
            os.close(fd)
        return written
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{threading.get_ident()}.tmp", dir=path.parent)
    try:
        try:
            size = _transfer(fd, buffers)
            if durable:
                os.fsync(fd)
            else:  # start writeback now: dirty pages a memory cgroup cannot reclaim get its processes OOM-killed
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return size


def _size_of(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def read_file(path: Path, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, filled by one scatter read: into the tensors of `into` (same names,
    shapes and dtypes, contiguous) or fresh memory of their own; the checksum is not verified here
    (tensorfile.verify does). A malformed or truncated file, or one that does not match `into`, raises
    ChecksumError."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        try:
            header, data_start = read_header(f)
            header.pop("__metadata__", None)
            tensors, end = {}, 0
            for key, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, stop = entry["data_offsets"]
                t = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]]) if into is None else into[key]
                if (begin != end or stop - begin != t.numel() * t.element_size() or not t.is_contiguous()
                        or t.dtype != DTYPES[entry["dtype"]]):
                    raise ValueError(f"{key} at bytes {begin}..{stop}")
                tensors[key], end = t, stop
        except (struct.error, ValueError, KeyError, TypeError) as exc:  # KeyError: a name `into` lacks
            raise ChecksumError(f"{path} is not a readable safetensors file ({exc}); it is damaged") from None
        got = _transfer(fd, [raw_bytes(t) for t in tensors.values()], read_at=data_start)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the tensors hold the bytes now; free the page cache
    if got != end:
        raise ChecksumError(f"{path} is damaged: it holds {got} of its {end} tensor bytes")
    return {key: tensors[key] for key in header}


def _transfer(fd: int, buffers: list, read_at: int | None = None) -> int:
    """Write every buffer at the file position (writev), or fill them from file offset `read_at` (preadv), in as
    few system calls as the kernel allows; returns the bytes moved (fewer only at the end of a file)."""
    views = [view for view in (memoryview(b).cast("B") for b in buffers) if len(view)]
    done = i = 0
    while i < len(views):
        batch = views[i:i + _IOV_MAX]
        n = os.writev(fd, batch) if read_at is None else os.preadv(fd, batch, read_at + done)
        if n == 0:
            break
        done += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
    return done
