"""The disk's own sequential write and read bandwidth, measured in a given directory (where a store lives), so a
benchmark can report the store's bytes/s against what the disk can do.

The probe file bypasses the page cache with O_DIRECT, so its bytes really move to and from the device; where the
filesystem refuses O_DIRECT (tmpfs, some FUSE mounts) it is written with fsync and dropped from the page cache
(posix_fadvise DONTNEED) before it is read back. Random bytes: a virtual disk may short-cut blocks of zeros.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime.host.page_cache import evict

BLOCK = 16 << 20


@dataclass(frozen=True)
class DiskBandwidth:
    write_bytes_per_s: float
    read_bytes_per_s: float
    probe_bytes: int
    direct: bool
    """True when O_DIRECT was used; False: buffered I/O with fsync and DONTNEED."""

    def as_dict(self) -> dict:
        return asdict(self)


def _open(path: Path, flags: int, direct: bool) -> int:
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)


def measure_disk(directory: str | Path, nbytes: int = 1 << 30) -> DiskBandwidth:
    """Write then read a temporary file of `nbytes` (rounded up to 16 MiB blocks) in `directory`, one block per
    system call, and time each pass (the write pass includes its fsync)."""
    path = Path(directory) / f".moesys-disk-probe-{os.getpid()}"
    blocks = max(1, -(-nbytes // BLOCK))
    buffer = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT requires
    buffer.write(os.urandom(BLOCK))
    direct = hasattr(os, "O_DIRECT")
    try:
        try:
            fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
        except OSError:
            direct = False
            fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
        began = time.perf_counter()
        try:
            for _ in range(blocks):
                _write_block(fd, buffer)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - began
        if not direct:
            evict(path)
        fd = _open(path, os.O_RDONLY, direct)
        began = time.perf_counter()
        try:
            done = 0
            while n := os.readv(fd, [buffer]):
                done += n
        finally:
            os.close(fd)
        read_s = time.perf_counter() - began
    finally:
        path.unlink(missing_ok=True)
        buffer.close()
    total = blocks * BLOCK
    if done != total:
        raise OSError(f"disk probe {path} read back {done} of {total} bytes")
    return DiskBandwidth(total / write_s, total / read_s, total, direct)


def _write_block(fd: int, buffer: mmap.mmap) -> None:
    view = memoryview(buffer)
    while view:
        view = view[os.write(fd, view):]
